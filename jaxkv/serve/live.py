"""Incremental serving over one persistent loop state: `add_request`, `abort`, `dispatch`, `collect`.

`Engine.run` packs a known queue and serves it in one jitted call. `LiveQueue`
keeps one `LoopState` (one cache) alive across calls and serves requests that
arrive and leave while others run. Its work has two halves, so that the device
never waits for the host's formatting:

- **`dispatch(k)`** (one thread at a time: the driver) applies aborts on the
  device, appends waiting requests to the device queue, and runs one loop entry
  of at most `k` steps. On a GPU a jitted call holding a `while` loop returns
  only when the device has finished it (each loop predicate is read back by the
  host), releasing the GIL meanwhile; the entry's snapshot (`live_ops.snapshot`)
  is queued for `collect`, and the driver can dispatch the next entry at once.
- **`collect()`** (another thread, or the same one) turns the oldest entry's snapshot into `Delta`s.

The host never needs the in-flight entry's results to dispatch the next one:

- **The device queue** is a ring (`columns.head_slot`): `live_ops.enqueue`
  appends requests behind whatever the device still holds; the host counts its
  free slots from the last entry it read plus what it appended since (admissions
  only free slots, so the count is safe when stale).
- **Output rows** (`R` rows of `LoopState.out`) are allocated on the host, `n`
  contiguous rows per request (forked samples write `out_base + index`), when
  the request enters the device queue; `enqueue` clears them on the device. They
  return to a free map when the request ends. A snapshot is read only for the
  requests enqueued before its entry was dispatched, so rows reused later are
  never misread.
- **Aborts** are applied on the device by output row (`live_ops.abort_rows`,
  the state donated): the columns writing to the rows are removed and, for a
  whole request, its queue slot if it was not admitted yet, whatever the entry
  in flight did. Samples cut at a stop token past the engine's
  `max_stop_tokens` (checked on the host) are removed the same way.
- **Logprobs** land in a window of `LOGPROB_WINDOW` tokens per output row
  (token `t` at `t % LOGPROB_WINDOW`) read from the state itself: while a
  request that wants them is in flight, entries are at most that long and each
  is read before the next one is dispatched.

The loop is `run`'s (`loop.serve_loop`); records: `live_records.py`; reading back: `live_read.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import threading
import time

import numpy as np

from jaxkv.serve.admission import check_admission
from jaxkv.serve.errors import EngineError
from jaxkv.serve.grammars import GrammarPlacer
from jaxkv.serve.live_ops import enqueue_batches
from jaxkv.serve.live_read import Entry, EntryReader
from jaxkv.serve.live_records import Ledger, Tracked, first_fit
from jaxkv.serve.requests import Request
from jaxkv.serve.results import Delta
from jaxkv.serve.state import LOGPROB_WINDOW, HostQueue, _bucket, pack_queue
from jaxkv.serve.timing import compile_seconds

# Entries dispatched and not yet collected, at most: the driver runs one entry ahead (two
# when stepping: a step is short, and the host reads and dispatches between two steps).
MAX_IN_FLIGHT = 2
MAX_IN_FLIGHT_STEPPING = 3
# Stepping: steps queued on the device and not yet known to have run, at most. Two keep the
# device fed while the host prepares the next; more only delay what the host decides.
RUN_AHEAD = 2

class LiveQueue:
  """The incremental API's host side for one `Engine` (`Engine.add_request` etc. delegate here).

  Args:
    engine: the `Engine`; its `state` holds the persistent `LoopState`.
    queue_size: device queue slots `Q` (rounded up to a power of two).
    out_rows: output rows `R` (rounded up to a power of two, at least `max_seqs`).
  """

  def __init__(self, engine, *, queue_size: int | None = None, out_rows: int | None = None):
    check_admission(engine.scheduling)
    s = engine.config.max_seqs
    self.engine = engine
    self.queue_size = _bucket(2 * s if queue_size is None else queue_size)
    self.out_rows = _bucket(max(s, 2 * self.queue_size if out_rows is None else out_rows))
    self.logprob_window = min(LOGPROB_WINDOW, engine.max_len)
    # Most tokens a step adds to an output row: a speculating column's token and its draft.
    self.per_step = 1 + (0 if engine.speculative is None else engine.speculative.k)
    self.ledger = Ledger(self.out_rows, engine.scheduling)
    self.reader = EntryReader(self.ledger, engine, self.out_rows)
    self._dispatching = threading.Lock()  # one dispatch at a time: the core's verbs, in order
    self._collecting = threading.Lock()   # one collect at a time, entries in order
    self._ids = itertools.count()
    self._broken: Exception | None = None   # a status failure read back, reset at next dispatch
    # Stepping (driver only): markers of the steps not yet known to have run, and the steps
    # (and whether an admission block) dispatched since the last entry read back.
    self._ahead: collections.deque = collections.deque()
    self._unread, self._unread_admit = 0, False
    self._last_greedy: bool | None = None   # which variant (greedy or sampled) last ran
    self._grammars = GrammarPlacer(engine.vocab_size, engine.grammar_pool)

  @property
  def held(self) -> int:
    """Cache positions held after the last entry read."""
    return self.ledger.held

  @property
  def waiting_tokens(self) -> int:
    """Prompt tokens of the requests not yet admitted."""
    return self.ledger.waiting_tokens

  # ------------------------------------------------------------------ requests

  def add_request(self, request: Request):
    if not isinstance(request, Request):
      raise TypeError(f"request must be a jaxkv.serve.Request; got {type(request).__name__}")
    engine, p = self.engine, request.params
    seed = secrets.randbelow(2**31) if p.seed is None else p.seed
    device = dataclasses.replace(p, seed=seed, stop_tokens=p.stop_tokens[:engine.max_stop])
    bad = [t for t in p.stop_tokens if not 0 <= t < engine.vocab_size]
    if p.min_tokens and len(p.stop_tokens) > engine.max_stop:
      # Only the device's stop-token slots are held back while min_tokens is not reached.
      raise ValueError(f"request {request.request_id!r}: min_tokens={p.min_tokens} with "
                       f"{len(p.stop_tokens)} stop_tokens; at most max_stop_tokens="
                       f"{engine.max_stop} with min_tokens")
    with self.ledger.lock:
      rid = request.request_id
      if rid is None:
        rid = next(i for i in self._ids if i not in self.ledger.tracked)
      elif rid in self.ledger.tracked:
        raise ValueError(f"request_id={rid!r} is already in flight")
      checked = request.replace(params=device, request_id=rid)
      engine.check(checked)
      if bad:
        raise ValueError(f"request {rid!r}: stop_tokens holds token id {bad[0]}, outside "
                         f"[0, vocab_size={engine.vocab_size})")
      if p.n > self.out_rows:
        raise ValueError(f"request {rid!r}: n={p.n} must be <= out_rows={self.out_rows}")
      self.ledger.track(rid, Tracked(checked, frozenset(p.stop_tokens[engine.max_stop:]),
                                     time.perf_counter(), emitted=[0] * p.n,
                                     finished=[False] * p.n))
    return rid

  def abort(self, request_id, index: int | None = None) -> bool:
    with self.ledger.lock:
      return self._abort(request_id, index)

  def abort_many(self, request_ids) -> int:
    """Aborts every request in `request_ids` under one lock (O(1) each); how many were in flight."""
    with self.ledger.lock:
      return sum(self._abort(rid, None) for rid in request_ids)

  def _abort(self, request_id, index) -> bool:   # holds `ledger.lock`
    t, aborts = self.ledger.tracked.get(request_id), self.ledger.aborts
    if t is None or (request_id, None) in aborts or (request_id, index) in aborts:
      return False
    if index is not None and not (0 <= index < t.n and t.emitted[index]
                                  and not t.finished[index]):
      return False   # one sample is aborted only once it runs (it has a column of its own)
    self.ledger.aborts[(request_id, index)] = None
    return True

  def has_unfinished(self) -> bool:
    with self.ledger.lock:
      return bool(self.ledger.tracked)

  def counts(self) -> tuple[int, int]:
    """`(running, waiting)` requests: admitted into the loop, and not yet."""
    with self.ledger.lock:
      return len(self.ledger.tracked) - self.ledger.unadmitted, self.ledger.unadmitted

  def has_work(self) -> bool:
    """Whether a dispatch would give the device something to do (by the last entry read)."""
    with self.ledger.lock:
      return bool(self.ledger.aborts or self.ledger.cut_rows or self._broken is not None
                  or any(not all(t.finished) for t in self.ledger.tracked.values())
                  or self._retire_due())

  @property
  def in_flight(self) -> int:
    """Entries dispatched and not yet collected."""
    with self.ledger.lock:
      return len(self.ledger.pending)

  def wait_for_entry(self, timeout: float | None = None) -> bool:
    """Blocks until an entry is in flight (or `timeout` seconds pass); whether one is."""
    with self.ledger.changed:
      return self.ledger.changed.wait_for(lambda: bool(self.ledger.pending), timeout)

  def notify(self) -> None:
    """Wakes the threads waiting in `wait_for_entry` (a front that is closing)."""
    with self.ledger.changed:
      self.ledger.changed.notify_all()

  # ------------------------------------------------------------------ stepping

  def step(self, max_steps: int | None = None, *, overlap: bool = False,
           stepwise: bool = False) -> list[Delta]:
    """One loop entry; its deltas (see `Engine.step`): `dispatch`, then `collect`.

    With `overlap`, the next entry is dispatched before the last one is
    collected, and left in flight while work remains: the call returns the
    deltas of the entry the previous call dispatched. `stepwise`: see `dispatch`.
    """
    deltas: list[Delta] = []
    try:
      if overlap and not self.in_flight:
        deltas += self.dispatch(max_steps, stepwise=stepwise)
        if not self.in_flight:   # nothing to run, or collected at once (logprobs)
          return deltas
      before = self.ledger.dispatched
      deltas += self.dispatch(max_steps, stepwise=stepwise)
      keep = 1 if overlap and self.ledger.dispatched != before else 0
      while self.in_flight > keep:
        deltas += self.collect()
    except EngineError as e:
      e.deltas = deltas + e.deltas
      raise
    return deltas

  def dispatch(self, max_steps: int | None = None, *, wait: bool = True,
               stepwise: bool = False, read_every: int | None = None,
               run_ahead: int = RUN_AHEAD) -> list[Delta]:
    """Applies aborts and cuts, appends waiting requests and dispatches one entry (unless idle).

    Returns the deltas of the aborts it applied (and, while a request that wants
    logprobs is in flight, of the entry itself, which is collected at once). With
    `wait`, it first waits until fewer than `MAX_IN_FLIGHT` entries are uncollected
    (another thread collects them); without, it raises RuntimeError instead.

    With `stepwise`, the entry is not a loop entry but the admission block where it
    is due (`_admission_due`) and then `max_steps` single steps (`EngineCore.step`),
    read back as one entry: nothing in it but the admission block waits for the
    device, so the host queues it while the entry before it runs (at most
    `RUN_AHEAD` steps ahead of the device). That holds while every request in flight
    is plain greedy or plain sampled (`admission.plain_sampled`: their steps draw with
    no branch, `loop.serve_step`); while another request is in flight it runs a loop
    entry of `max(max_steps, read_every)` steps instead. With
    `read_every` too, the steps are read back only while fewer than `run_ahead`
    entries wait to be collected (the reader is no further behind than the
    device's queue) or once `read_every` steps are unread (else with a later
    dispatch's): the host reads every step while it keeps up, and less often,
    never making the device wait, when it does not. `run_ahead` is how many steps it keeps queued
    on the device, at most (`RUN_AHEAD`).

    Raises:
      EngineError: the model, device or cache failed (now, or in an entry read
        since the last dispatch); see `Engine.step`.
    """
    engine = self.engine
    k = engine.max_steps if max_steps is None else max_steps
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"max_steps={max_steps!r} must be an int >= 1")
    if isinstance(run_ahead, bool) or not isinstance(run_ahead, int) or run_ahead < 1:
      raise ValueError(f"run_ahead={run_ahead!r} must be an int >= 1")
    limit = max(MAX_IN_FLIGHT_STEPPING, run_ahead + 1) if stepwise else MAX_IN_FLIGHT
    with self.ledger.changed:
      while len(self.ledger.pending) >= limit:
        if not wait:
          raise RuntimeError(f"dispatch: {limit} entries are uncollected")
        self.ledger.changed.wait()
    if not self._dispatching.acquire(blocking=False):
      raise RuntimeError("step: another loop entry is running (one at a time)")
    started, compiled = time.perf_counter(), compile_seconds()
    deltas: list[Delta] = []
    try:
      try:
        if self._broken is not None:
          raise self._broken
        with self.ledger.lock:
          sync = self.ledger.with_logprobs > 0
        if sync:   # no logprob slot is rewritten before it is read
          k = min(int(k), self.logprob_window)
        deltas += self._dispatch(int(k), stepwise, None if sync else read_every, run_ahead)
        if sync:
          while self.in_flight:
            deltas += self.collect(_from_dispatch=True)
      except BaseException as e:   # pylint: disable=broad-except  (model, device or status failure)
        err = self._failed(e, deltas)
        if err is e:
          raise
        raise err from e
      stats = engine.stats
      stats.seconds += time.perf_counter() - started
      stats.compile_seconds += compile_seconds() - compiled
      return deltas
    finally:
      self._dispatching.release()

  def collect(self, *, reset: bool = True, _from_dispatch: bool = False) -> list:
    """Reads the oldest uncollected entry (waiting for the device); its deltas ([] if none).

    Args:
      reset: on a failure read back, reset and raise here (unless another thread
        is dispatching); False leaves both to the next `dispatch` (a reader
        thread beside a driver thread: it never waits for the driver).

    Raises:
      EngineError: the cache refused a step in that entry; the requests the
        device held are dropped (`error.failed`) and the next dispatch starts on
        a fresh cache. Where this call does not reset (above), it returns []
        and the next `dispatch` raises it.
    """
    with self._collecting:
      try:
        return self._collect_one()
      except EngineError:
        raise
      except Exception as e:   # pylint: disable=broad-except  (reported by the next dispatch too)
        self._broken = e
    if _from_dispatch:   # the dispatch resets and reports
      raise self._broken
    if not reset or not self._dispatching.acquire(blocking=False):
      return []   # the next dispatch resets and reports
    try:
      if self._broken is None:   # a dispatch reported and reset it already
        return []
      raise self._failed(self._broken, [])
    finally:
      self._dispatching.release()

  def _collect_one(self) -> list:
    with self.ledger.lock:
      if self._broken is not None:
        return []
    return self.reader.read_oldest()

  def _failed(self, e: BaseException, deltas: list) -> BaseException:
    """Resets after a failure (the state was donated); the error to raise, naming the dropped.

    A KeyboardInterrupt mid-entry too: the bookkeeping is reset with the state
    (the engine stays usable) and the interrupt goes on. `deltas` holds what
    finished before the failure (the fronts deliver it first). Holds `_dispatching`.
    """
    with self._collecting:   # what finished in entries still uncollected is delivered first
      while self.ledger.pending and self._broken is None:
        try:
          deltas += self._collect_one()
        except Exception:   # pylint: disable=broad-except  (its own failure: dropped with the rest)
          break
      failed = self._reset()
    cause = e if self._broken is None or e is self._broken else self._broken
    self._broken = None
    if not isinstance(e, Exception):
      e.failed, e.deltas = failed, deltas
      return e
    err = EngineError(f"step failed; requests {failed} were dropped: "
                      f"{type(cause).__name__}: {cause}", [])
    err.failed, err.deltas = failed, deltas
    return err

  def _dispatch(self, k: int, stepwise: bool = False, read_every: int | None = None,
                run_ahead: int = RUN_AHEAD) -> list[Delta]:
    """Aborts, appends, and dispatches one entry unless the device has nothing to do."""
    core = self.engine.core
    if not core.started:
      self._init_state()
    deltas = self._apply_aborts()
    self._fill()
    ledger = self.ledger
    with ledger.lock:
      # Device work: a request it holds, or a queue the last entry read left non-empty (aborts
      # may have emptied it since; an entry reads that back and frees the slots), or (stepping)
      # finished columns to retire.
      live = [t for t in ledger.tracked.values() if not all(t.finished)]
      work = any(t.base >= 0 for t in live) or ledger.queued > 0
      if not (work or stepwise and self._retire_due()):
        return deltas
      greedy = ledger.sampled == 0
      if stepwise and ledger.branched and not greedy:
        # A request the draw alone does not serve (penalties, logprobs, a bias, a grammar, or
        # a top-k or top-p that may need the bisection; `admission.plain_sampled`): the loop
        # sampler's stages sit behind branches, and each would make a step wait for the
        # device, so a loop entry instead.
        stepwise, k = False, max(k, read_every or 1)
      if not live and self._last_greedy is not None:
        # Only aborted requests to free: the variant last run, never a first compile of the
        # other one (seconds; a whole loop, a minute on a GPU) at the last abort or a drain.
        greedy = self._last_greedy
      self._last_greedy = greedy
      admit = not stepwise or self._admission_due()
      if not work:
        k = 0   # stepping: the admission block retires the finished columns, nothing to step
      index, enqueued, enqueued_tokens = ledger.dispatched, ledger.enqueued, ledger.enqueued_tokens
    # With only plain greedy requests in flight, the loop (or step) without the sampler, whose
    # `lax.cond`s are a host sync per step on a GPU, as `Engine.run` picks for such queues.
    if not stepwise:
      core.enter(k, greedy=greedy)
      k += self._unread   # steps queued before it and not read yet are read with it
      self._unread, self._unread_admit = 0, False
    else:
      stats, clock = self.engine.stats, time.perf_counter
      if admit:
        t0 = clock()
        core.admit()
        stats.admit_seconds += clock() - t0
        stats.admissions += 1
        with ledger.lock:
          ledger.admitted_at, ledger.enqueued_at_admit = index, enqueued
      for _ in range(k):
        t0 = clock()
        while len(self._ahead) >= run_ahead:   # paced by the device, not ahead of it
          self._ahead.popleft().block_until_ready()
        stats.pace_seconds += clock() - t0
        which = self._step_width()
        t1 = clock()
        self._ahead.append(core.step(which, greedy=greedy))
        stats.step_call_seconds += clock() - t1
        with ledger.lock:
          ledger.width_total += self.engine.widths[which]
          ledger.steps_total += 1
      self._unread += k
      self._unread_admit |= admit
      with ledger.lock:
        # The reader is behind by more than the steps the device holds: a later entry reads
        # these steps. (Waiting for no entry at all would read every second step: the last
        # step's read-back is pending until the device runs it.)
        if (read_every is not None and len(ledger.pending) >= run_ahead
            and self._unread < read_every):
          return deltas
      k, admit, self._unread, self._unread_admit = self._unread, self._unread_admit, 0, False
      enqueued, enqueued_tokens = ledger.enqueued, ledger.enqueued_tokens
    self.engine.stats.loop_entries += 1
    # One snapshot compiled per power of two, not per k; a step adds `per_step` tokens at most.
    window = _bucket(max(k, 1) * self.per_step)
    entry = Entry(core.snapshot(window), window, k, index, enqueued, admit=admit,
                  width_total=ledger.width_total, steps_total=ledger.steps_total,
                  enqueued_tokens=enqueued_tokens)
    with ledger.changed:
      if admit and not stepwise:
        ledger.admitted_at, ledger.enqueued_at_admit = index, enqueued
      ledger.dispatched += 1
      ledger.pending.append(entry)
      ledger.changed.notify_all()
    return deltas

  def warm_steps(self, read_every: int = 1) -> None:
    """Runs every width's step programs, greedy and sampled, on the idle state (each carries
    no token), the admission block, and the snapshots of up to `read_every` steps: what
    stepping may run, compiled."""
    with self.ledger.lock:
      if any(t.base >= 0 for t in self.ledger.tracked.values()) or self.ledger.pending:
        raise RuntimeError("warm_steps: requests are on the device")
    core = self.engine.core
    if not core.started:
      self._init_state()
    started, compiled = time.perf_counter(), compile_seconds()
    with self._dispatching:
      core.admit()
      for which in range(len(self.engine.widths)):
        for greedy in (True, False):
          core.step(which, greedy=greedy)
      window = 1
      while window <= _bucket(read_every * self.per_step):
        core.snapshot(window)
        window *= 2
      core.read(lambda ls: ls.status)
    stats = self.engine.stats
    stats.seconds += time.perf_counter() - started
    stats.compile_seconds += compile_seconds() - compiled

  def _fresh(self):
    """The last entry read, if it was dispatched with or after the last admission block (what
    it says is not already acted on). Holds `ledger.lock`."""
    seen = self.ledger.seen
    return seen if seen is not None and seen.index >= self.ledger.admitted_at else None

  def _retire_due(self) -> bool:
    """Stepping: whether finished columns hold the device's only work (retire them, freeing
    their K/V, once nothing else runs). Holds `ledger.lock`."""
    seen = self._fresh()
    return seen is not None and seen.done > 0 and seen.active == 0

  def _admission_due(self) -> bool:
    """Stepping: whether the admission block has work (module docstring). Holds `ledger.lock`.

    Due when requests entered the device queue since the last one, and when the last
    entry read after it shows a column ready to fork, a stall (a step that did not
    fit, or a head that may now adopt a prefix), or finished columns while requests
    or preempted columns wait or nothing else runs.
    """
    ledger = self.ledger
    if ledger.admitted_at < 0 or ledger.enqueued_at_admit != ledger.enqueued:
      return True
    seen = self._fresh()
    if seen is None:
      return False
    return bool(seen.forking or seen.stalled
                or seen.done and (ledger.queued > 0 or seen.parked or not seen.active))

  def _step_width(self) -> int:
    """The index of the width the next step takes: the narrowest that holds the tokens the
    columns want by the last entry read (its prompt remainders less what the steps
    dispatched since could carry of them past one token per running column), plus the
    prompts enqueued since. A stale guess costs rows or a slower prefill, never tokens:
    the step schedules what fits its width."""
    widths, ledger = self.engine.widths, self.ledger
    with ledger.lock:
      seen = ledger.seen
      if seen is None:
        want = ledger.enqueued_tokens
      else:
        # A running column wants its token and at most a draft a step (`per_step`).
        steps, decode = ledger.steps_total - seen.steps_total, seen.active * self.per_step
        prefill = seen.wanted - decode - (ledger.width_total - seen.width_total - steps * decode)
        want = decode + max(prefill, 0) + ledger.enqueued_tokens - seen.enqueued_tokens
    return next((i for i in range(len(widths) - 1, -1, -1) if want <= widths[i]), 0)

  def _init_state(self) -> None:
    engine = self.engine
    arrays = self._empty_queue().arrays
    host_queue = HostQueue(arrays, rows=self.out_rows, max_new=engine.max_len, count=0,
                           lp_rows=self.out_rows, lp_window=self.logprob_window,
                           num_logprobs=engine.max_logprobs,
                           grammar=type(self._grammars.pool)(*map(np.array, self._grammars.pool)))
    engine.core.start(host_queue, commit=True)
    assert engine.core.state.queue.prompt.shape[0] == self.queue_size

  def _empty_queue(self) -> HostQueue:
    """The queue arrays of `Q` never-admitted fillers (the device queue starts empty)."""
    engine = self.engine
    filler = Request((0,))
    return pack_queue([filler.prompt] * self.queue_size, [filler.params] * self.queue_size,
                      max_len=engine.max_len, max_stop=engine.max_stop,
                      num_logprobs=engine.max_logprobs)

  def _fill(self) -> None:
    """Appends waiting requests to the device queue while its slots and output rows allow."""
    engine = self.engine
    placed = False
    with self.ledger.lock:
      room = self.queue_size - self.ledger.queued
      moved = []
      in_use = None
      while self.ledger.waiting and len(moved) < room:
        t = self.ledger.tracked[self.ledger.waiting.peek()]
        base = first_fit(self.ledger.free, t.n)
        if base is None:
          break   # in order: a later request never overtakes one waiting for rows
        grammar = t.request.params.grammar
        if grammar is not None:
          if in_use is None:   # the automata of the requests on the device stay where they are
            in_use = {u.request.params.grammar.identity for u in self.ledger.tracked.values()
                      if u.base >= 0 and u.request.params.grammar is not None}
          done = self._grammars.place(grammar, in_use)
          if done is None:
            break   # no room in the grammar pool until a request using another one ends
          placed |= done
          in_use.add(grammar.identity)
        self.ledger.free[base:base + t.n] = False
        t.base, t.entry = base, self.ledger.dispatched
        self.ledger.waiting.popleft()
        moved.append(t)
      self.ledger.enqueued += len(moved)
      self.ledger.enqueued_tokens += sum(len(t.request.prompt) for t in moved)
    if not moved:
      return
    if placed:
      engine.core.set_grammar(self._grammars.pool)
    engine.core.grow_for([t.request for t in moved])
    starts = [-1 if t.request.params.grammar is None
              else self._grammars.initial(t.request.params.grammar) for t in moved]
    for batch in enqueue_batches([t.request for t in moved], [t.base for t in moved],
                                 max_stop=engine.max_stop, num_logprobs=engine.max_logprobs,
                                 grammar_starts=starts):
      engine.core.enqueue(*batch)

  def _apply_aborts(self) -> list[Delta]:
    """Ends the aborted requests and samples on the host, then removes theirs on the device."""
    rows = self.out_rows
    column_rows, queue_rows = np.zeros((rows,), bool), np.zeros((rows,), bool)
    with self.ledger.lock:
      aborts, self.ledger.aborts = list(self.ledger.aborts), {}
      deltas = []
      for row in self.ledger.cut_rows:   # cut at a host-side stop while an entry was in flight
        column_rows[row] = True
      self.ledger.cut_rows = []
      freed, self.ledger.free_after_abort = self.ledger.free_after_abort, []
      for rid, index in aborts:
        t = self.ledger.tracked.get(rid)
        if t is None or (index is not None and t.finished[index]):
          continue   # it finished in the step that ran when abort() was called
        samples = range(t.n) if index is None else (index,)
        if t.base >= 0:
          column_rows[t.base + np.asarray(samples)] = True
          if index is None:
            queue_rows[t.base] = True
        elif index is None:
          self.ledger.waiting.remove(rid)
        for j in samples:
          if not t.finished[j]:
            t.finished[j] = True
            self.engine.stats.aborted += 1
            deltas.append(Delta(rid, j, (), "abort", t.request.params.seed,
                                logprobs=t.logprobs_of_none))
        if all(t.finished):
          deltas[-1] = dataclasses.replace(deltas[-1], timing=self.ledger.release(rid))
    if column_rows.any():
      self.engine.core.abort_rows(column_rows, queue_rows)
    with self.ledger.lock:   # their columns are gone before any later use of the rows
      for base, n in freed:
        self.ledger.free[base:base + n] = True
      self.ledger.settle_held()
    return deltas

  def _reset(self) -> list:
    """After a failure: drops the state and every request the device held; their ids."""
    failed = self.ledger.reset()
    self._ahead.clear()
    self._unread, self._unread_admit = 0, False
    self.engine.core.drop()   # rebuilt (a fresh cache) at the next step
    return failed
