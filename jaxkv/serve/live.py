"""Incremental serving over one persistent loop state: `add_request`, `abort`, `step`.

`Engine.run` packs a known queue and serves it in one jitted call. `LiveQueue`
keeps one `LoopState` (one cache) alive across calls and serves requests that
arrive and leave while others run:

- **Requests** are checked at `add_request` (`Engine.check`) and wait on the
  host until the device queue (`Q` slots, `LoopState.queue`) has room. Between
  loop entries the host rewrites the queue arrays: the requests not yet
  admitted first (a partly admitted head keeps its `copies`), then newly
  arrived ones, `next = 0`. The loop admits from it in order, as in `run`.
- **Output rows** (`R` rows of `LoopState.out`) are allocated on the host, `n`
  contiguous rows per request (forked samples write `out_base + index`), when
  the request enters the device queue; they return to a free map when the
  request ends, and are cleared (`Outputs.length = done = stop = 0`) before
  reuse. Rows of in-flight samples never move.
- **A step** is one loop entry of at most `k` steps (`max_steps`); the host
  then reads `Outputs.length` (tokens so far, updated every step) and reports each
  sample's new tokens as a `Delta`, with a finish reason when it ended.
- **Aborts** are applied between entries by `_abort_columns` (jitted, the
  state donated): `jaxkv.pure.seq_rm` on each of the request's columns, and
  `used/active/done/reserve/forks` cleared, so its columns and reserved room
  are free for the next admission.
- **Stop tokens past the engine's `max_stop_tokens`** are checked on the host:
  the sample is cut after the first one and its column aborted.
- **Logprobs** land in a window of `LOGPROB_WINDOW` tokens per output row
  (token `t` at `t % LOGPROB_WINDOW`); while a request that wants them is in
  flight, a loop entry runs at most that many steps, so the host reads every
  token's logprobs before its slot is written again.

Everything here runs on the host between loop entries; the jitted loop
(`loop.serve_loop`) is the same one `run` uses. The host's request records are in
`live_records.py`; reading an entry back (snapshot, deltas) is in `live_read.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxkv import Status
from jaxkv.serve.admission import check_admission, plain_greedy
from jaxkv.serve.errors import EngineError
from jaxkv.serve.live_ops import abort_columns, clear_rows, snapshot
from jaxkv.serve.live_read import SnapshotReader
from jaxkv.serve.live_records import Tracked, Waiting, first_fit
from jaxkv.serve.requests import Request
from jaxkv.serve.results import Delta, RequestTiming
from jaxkv.serve.state import (LOGPROB_WINDOW, NO_ROW, HostQueue, _bucket, init_loop_state,
                               pack_queue)
from jaxkv.serve.timing import compile_seconds


class LiveQueue(SnapshotReader):
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
    self._lock = threading.Lock()        # host bookkeeping (add_request/abort from any thread)
    self._stepping = threading.Lock()    # one loop entry at a time
    self._tracked: dict = {}             # request_id -> Tracked, in arrival order
    self._waiting = Waiting(engine.scheduling)  # on the host, not yet in the device queue
    self._queued: list = []              # == device queue[next:count]
    self._head_copies = 0
    self._dev_next = 0                   # the device queue's `next` when the host last saw it
    self._free = np.ones((self.out_rows,), bool)
    self._aborts: dict = {}   # (request_id, index) -> None, in call order: O(1) membership
    self._ids = itertools.count()
    self._host: dict | None = None       # last host copy of the column arrays
    self._dirty = False                  # the device queue must be rewritten
    self._steps_seen = 0                 # the loop's step counter after the last entry
    self.held = 0                        # cache positions held after the last step
    self._sampled = 0                    # requests in flight that are not plain greedy
    self._pending = None                 # (snapshot, window, k) of the entry in flight, unread
    self.waiting_tokens = 0              # prompt tokens of the requests not yet admitted
    self._cut_rows: list = []            # rows cut at a host-side stop, removed at next dispatch

  # ------------------------------------------------------------------ requests

  def add_request(self, request: Request):
    if not isinstance(request, Request):
      raise TypeError(f"request must be a jaxkv.serve.Request; got {type(request).__name__}")
    engine, p = self.engine, request.params
    seed = secrets.randbelow(2**31) if p.seed is None else p.seed
    device = dataclasses.replace(p, seed=seed, stop_tokens=p.stop_tokens[:engine.max_stop])
    bad = [t for t in p.stop_tokens if not 0 <= t < engine.vocab_size]
    with self._lock:
      rid = request.request_id
      if rid is None:
        rid = next(i for i in self._ids if i not in self._tracked)
      elif rid in self._tracked:
        raise ValueError(f"request_id={rid!r} is already in flight")
      checked = request.replace(params=device, request_id=rid)
      engine.check(checked)
      if bad:
        raise ValueError(f"request {rid!r}: stop_tokens holds token id {bad[0]}, outside "
                         f"[0, vocab_size={engine.vocab_size})")
      if p.n > self.out_rows:
        raise ValueError(f"request {rid!r}: n={p.n} must be <= out_rows={self.out_rows}")
      self._sampled += not plain_greedy(p)
      self.waiting_tokens += len(request.prompt)
      self._tracked[rid] = Tracked(checked, frozenset(p.stop_tokens[engine.max_stop:]),
                                    time.perf_counter(), emitted=[0] * p.n,
                                    finished=[False] * p.n)
      self._waiting.append(rid, p.max_tokens)
    return rid

  def abort(self, request_id, index: int | None = None) -> bool:
    with self._lock:
      return self._abort(request_id, index)

  def abort_many(self, request_ids) -> int:
    """Aborts every request in `request_ids` under one lock (O(1) each); how many were in flight."""
    with self._lock:
      return sum(self._abort(rid, None) for rid in request_ids)

  def _abort(self, request_id, index) -> bool:   # holds `_lock`
    t = self._tracked.get(request_id)
    if t is None or (request_id, None) in self._aborts or (request_id, index) in self._aborts:
      return False
    if index is not None and not (0 <= index < t.n and t.emitted[index]
                                  and not t.finished[index]):
      return False   # one sample is aborted only once it runs (it has a column of its own)
    self._aborts[(request_id, index)] = None
    return True

  def has_unfinished(self) -> bool:
    with self._lock:
      return bool(self._tracked)

  def counts(self) -> tuple[int, int]:
    """`(running, waiting)` requests: admitted into the loop, and not yet."""
    with self._lock:
      waiting = len(self._waiting) + len(self._queued) - (self._head_copies > 0)
      return len(self._tracked) - waiting, waiting

  # ------------------------------------------------------------------ one step

  def step(self, max_steps: int | None = None, *, overlap: bool = False) -> list[Delta]:
    """One loop entry; its deltas (see `Engine.step`).

    With `overlap`, the entry's successor is dispatched before the host builds
    the entry's deltas, so the device runs entry N+1 while the host formats
    entry N (JAX dispatch is asynchronous; each entry's snapshot is its own
    buffer). The call then returns the deltas of the entry dispatched by the
    previous call, and leaves one entry in flight while work remains. Aborts and
    host-side stop cuts take effect at the next dispatch, which follows the
    in-flight entry. Off while a request that wants logprobs is in flight (their
    window is rewritten by the next entry before the host would read it).
    """
    engine = self.engine
    k = engine.max_steps if max_steps is None else max_steps
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"max_steps={max_steps!r} must be an int >= 1")
    if not self._stepping.acquire(blocking=False):
      raise RuntimeError("step: another loop entry is running (one at a time)")
    started, compiled = time.perf_counter(), compile_seconds()
    with self._lock:
      if any(t.request.params.logprobs is not None for t in self._tracked.values()):
        k = min(int(k), self.logprob_window)   # no logprob slot is rewritten before it is read
        overlap = False
    deltas: list[Delta] = []
    try:
      try:
        deltas = self._step_overlapped(int(k), deltas) if overlap else self._step(int(k), deltas)
      except BaseException as e:   # pylint: disable=broad-except  (model, device or status failure)
        # A KeyboardInterrupt mid-entry too: the state was donated, so the bookkeeping is
        # reset with it (the engine stays usable) and the interrupt goes on, naming the dropped.
        # `deltas` holds what finished before the failure (the fronts deliver it first).
        failed = self._reset()
        if not isinstance(e, Exception):
          e.failed, e.deltas = failed, deltas
          raise
        err = EngineError(f"step failed; requests {failed} were dropped: "
                          f"{type(e).__name__}: {e}", [])
        err.failed, err.deltas = failed, deltas
        raise err from e
      stats = engine.stats
      stats.seconds += time.perf_counter() - started
      stats.compile_seconds += compile_seconds() - compiled
      return deltas
    finally:
      self._stepping.release()

  def _step(self, k: int, deltas: list) -> list[Delta]:
    """Dispatches one entry and reads it back (an entry left in flight by `overlap` first)."""
    if self._pending is not None:
      deltas += self._deltas(*self._read(), defer_cuts=False)
    deltas += self._dispatch(k)
    if self._pending is not None:
      deltas += self._deltas(*self._read(), defer_cuts=False)
    return deltas

  def _step_overlapped(self, k: int, deltas: list) -> list[Delta]:
    """Reads the entry in flight, dispatches the next one, then builds the first one's deltas."""
    if self._pending is None:
      deltas += self._dispatch(k)
      if self._pending is None:
        return deltas
    read = self._read()
    deltas += self._dispatch(k)
    deltas += self._deltas(*read, defer_cuts=self._pending is not None)
    return deltas

  def _dispatch(self, k: int) -> list[Delta]:
    """Applies aborts and cuts, fills the device queue and dispatches one entry (unless idle)."""
    engine = self.engine
    if engine.state is None:
      self._init_state()
    deltas = self._apply_aborts()
    self._fill()
    with self._lock:
      if not self._queued and not self._device_busy():
        return deltas
    ls, engine.state = engine.state, None   # donated below
    # With only plain greedy requests in flight, the loop without the sampler's `lax.cond`
    # (whose predicate is a host sync per step on a GPU), as `Engine.run` picks for such queues.
    ls = engine.enter(ls, k, greedy=self._sampled == 0)
    engine.state = ls
    engine.stats.loop_entries += 1
    window = _bucket(k)   # one snapshot compiled per power of two, not per k
    self._pending = (snapshot(ls, window), window, k)
    return deltas

  def _device_busy(self) -> bool:
    """Whether a column holds an unfinished sample (by the last snapshot). Holds `_lock`."""
    host = self._host
    if host is None:
      return any(t.base >= 0 and t.admitted is not None for t in self._tracked.values())
    used = host["used"] == 1
    return bool((used & (host["out_done"][np.where(used, host["out_row"], 0)] == 0)).any())

  def _init_state(self) -> None:
    engine, q = self.engine, self.queue_size
    arrays = self._pack([]).arrays
    host_queue = HostQueue(arrays, rows=self.out_rows, max_new=engine.max_len, count=0,
                           lp_rows=self.out_rows, lp_window=self.logprob_window,
                           num_logprobs=engine.max_logprobs)
    state = init_loop_state(engine.config, host_queue, num_widths=len(engine.widths),
                            mesh=engine.mesh, kv_axis=engine.kv_axis,
                            prefix_cache=engine.prefix_cache)
    # Committed from the start, as the loop's outputs are: jit keys its compiled code on
    # whether each argument is committed, so a mix would compile the loop a second time.
    engine.state = state if engine.mesh is not None else self._place(state)
    assert engine.state.queue.prompt.shape[0] == q

  def _pack(self, requests) -> HostQueue:
    """The queue arrays of `requests`, padded with never-admitted fillers to `Q` slots."""
    engine = self.engine
    filler = Request((0,))
    padded = list(requests) + [filler] * (self.queue_size - len(requests))
    return pack_queue([r.prompt for r in padded], [r.params for r in padded],
                      max_len=engine.max_len, max_stop=engine.max_stop,
                      num_logprobs=engine.max_logprobs)

  def _place(self, tree):
    """`tree` committed where the loop state lives: replicated on the mesh, or the first device."""
    mesh = self.engine.mesh
    return jax.device_put(tree, NamedSharding(mesh, P()) if mesh is not None
                          else SingleDeviceSharding(jax.devices()[0]))

  def _fill(self) -> None:
    """Moves waiting requests into the device queue while slots and output rows allow."""
    engine = self.engine
    with self._lock:
      moved = []
      while self._waiting and len(self._queued) < self.queue_size:
        t = self._tracked[self._waiting.peek()]
        base = first_fit(self._free, t.n)
        if base is None:
          break   # in order: a later request never overtakes one waiting for rows
        self._free[base:base + t.n] = False
        t.base = base
        moved.append(self._waiting.popleft())
        self._queued.append(moved[-1])
      if not moved and not self._dirty:
        return
      queued = [self._tracked[rid] for rid in self._queued]
      self._dirty = False
    grow = engine._grow_for   # pylint: disable=protected-access
    ls = grow(engine.state, [t.request for t in queued]) if queued else engine.state
    host_queue = self._pack([t.request for t in queued])
    out_base = np.zeros((self.queue_size,), np.int32)
    out_base[:len(queued)] = [t.base for t in queued]
    # Logprob rows are the output rows (the window has `out_rows` rows).
    lp_base = np.full((self.queue_size,), NO_ROW, np.int32)
    lp_base[:len(queued)] = [t.base if t.request.params.logprobs is not None else NO_ROW
                             for t in queued]
    arrays = host_queue.arrays | {"out_base": out_base, "lp_base": lp_base}
    queue = dataclasses.replace(
        ls.queue, **self._place({k: jnp.asarray(v) for k, v in arrays.items()}),
        next=self._place(jnp.int32(0)), copies=self._place(jnp.int32(self._head_copies)),
        count=self._place(jnp.int32(len(queued))))
    clear = np.zeros((self.out_rows,), bool)
    for rid in moved:
      t = self._tracked[rid]
      clear[t.base:t.base + t.n] = True
    length, stop, done = clear_rows(ls.out.length, ls.out.stop, ls.out.done,
                                    self._place(jnp.asarray(clear)))
    engine.state = dataclasses.replace(ls, queue=queue, out=dataclasses.replace(
        ls.out, length=length, stop=stop, done=done))
    self._dev_next = 0

  def _columns_of(self, rows) -> np.ndarray:
    """`bool[S]`: used columns writing to any of `rows`."""
    host = self._host
    if host is None:
      return np.zeros((self.engine.config.max_seqs,), bool)
    return (host["used"] == 1) & np.isin(host["out_row"], list(rows))

  def _remove_columns(self, mask: np.ndarray) -> None:
    if not mask.any():
      return
    engine = self.engine
    ls, engine.state = engine.state, None
    engine.state = abort_columns(engine.config, ls, self._place(jnp.asarray(mask)))
    self._host["used"] = np.where(mask, 0, self._host["used"])
    if int(engine.state.status) != Status.OK:
      raise RuntimeError(f"aborting columns failed: {Status(int(engine.state.status)).name}")

  def _apply_aborts(self) -> list[Delta]:
    with self._lock:
      aborts, self._aborts = list(self._aborts), {}
      deltas, mask = [], np.zeros((self.engine.config.max_seqs,), bool)
      if self._cut_rows:   # samples cut at a host-side stop while an entry was in flight
        mask |= self._columns_of(self._cut_rows)
        self._cut_rows = []
      for rid, index in aborts:
        t = self._tracked.get(rid)
        if t is None or (index is not None and t.finished[index]):
          continue   # it finished in the step that ran when abort() was called
        if index is not None:
          mask |= self._columns_of([t.base + index])
          t.finished[index] = True
          self.engine.stats.aborted += 1
          deltas.append(Delta(rid, index, (), "abort", t.request.params.seed,
                              logprobs=t.logprobs_of_none))
          if all(t.finished):
            deltas[-1] = dataclasses.replace(deltas[-1], timing=self._release(rid))
          continue
        if rid in self._waiting:
          self._waiting.remove(rid)
        elif rid in self._queued:
          if self._queued[0] == rid:
            self._head_copies = 0
          self._queued.remove(rid)
          self._dirty = True
        if t.base >= 0:
          mask |= self._columns_of(range(t.base, t.base + t.n))
        for j in range(t.n):
          if not t.finished[j]:
            t.finished[j] = True
            self.engine.stats.aborted += 1
            deltas.append(Delta(rid, j, (), "abort", t.request.params.seed,
                                logprobs=t.logprobs_of_none))
        deltas[-1] = dataclasses.replace(deltas[-1], timing=self._release(rid))
    self._remove_columns(mask)
    return deltas

  def _release(self, rid) -> RequestTiming:
    """Forgets a finished request and frees its output rows; its timing. Holds `_lock`."""
    t = self._tracked.pop(rid)
    self._sampled -= not plain_greedy(t.request.params)
    if t.admitted is None:
      self.waiting_tokens -= len(t.request.prompt)
    if t.base >= 0:
      self._free[t.base:t.base + t.n] = True
    now = time.perf_counter()
    since = lambda x: None if x is None else x - t.arrived
    tokens = max(t.emitted)   # the longest sample: the request's last token came with it
    between = (now - t.first_token) / (tokens - 1) if tokens > 1 else None
    return RequestTiming(since(t.admitted), since(t.first_token), now - t.arrived, between)

  def _reset(self) -> list:
    """After a failed entry: drops the state and every request the device held; their ids."""
    with self._lock:
      failed = [rid for rid, t in self._tracked.items() if t.base >= 0]
      for rid in failed:
        t = self._tracked.pop(rid)
        self._sampled -= not plain_greedy(t.request.params)
        self.waiting_tokens -= len(t.request.prompt) if t.admitted is None else 0
      self._queued, self._head_copies, self._aborts, self._dev_next = [], 0, {}, 0
      self._steps_seen = 0
      self._free[:] = True
      self._host, self.held, self._dirty = None, 0, False
      self._pending, self._cut_rows = None, []
    self.engine.state = None   # rebuilt (a fresh cache) at the next step
    return failed
