"""The incremental API's host records: what `LiveQueue` (`live.py`) and its reader share.

`Ledger` is the bookkeeping of one persistent loop state, guarded by its lock:
the requests in flight (`Tracked`: checked request, arrival, output rows,
tokens reported per sample), the line waiting on the host (`Waiting`, in
admission order), the output rows' free map (`first_fit`), the entries in
flight and the device queue's counters as last read. `LiveQueue` writes it
when it dispatches, `EntryReader` (`live_read.py`) when it reads an entry.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import threading
import time
from typing import NamedTuple

import numpy as np

from jaxkv.serve.admission import plain_greedy, plain_sampled
from jaxkv.serve.requests import Request
from jaxkv.serve.results import RequestTiming
from jaxkv.serve.sampling import TOP_CAP


@dataclasses.dataclass
class Tracked:
  request: Request            # seed resolved, stop tokens cut to the engine's max_stop_tokens
  host_stops: frozenset       # stop tokens past max_stop_tokens, checked on the host
  arrived: float
  base: int = -1              # first output row; -1 while waiting on the host
  entry: int = -1             # the loop entry it was appended to the device queue before
  admitted: float | None = None
  first_token: float | None = None
  emitted: list = dataclasses.field(default_factory=list)    # tokens reported, per sample
  finished: list = dataclasses.field(default_factory=list)   # per sample

  @property
  def n(self) -> int:
    return self.request.params.n

  @property
  def logprobs_of_none(self) -> tuple | None:   # a token-less delta's: () if asked, else None
    return None if self.request.params.logprobs is None else ()


class Waiting:
  """Requests waiting on the host, in admission order: arrival (`"fcfs"`) or the largest
  `max_tokens` first (`"longest_first"`, ties by arrival); push, pop and remove in O(log n)."""

  def __init__(self, order: str):
    self.longest_first = order == "longest_first"
    self._heap: list = []
    self._live: set = set()
    self._seq = itertools.count()

  def append(self, rid, max_tokens: int) -> None:
    key = -max_tokens if self.longest_first else 0
    heapq.heappush(self._heap, (key, next(self._seq), rid))
    self._live.add(rid)

  def _settle(self) -> None:   # drops removed entries off the top
    while self._heap and self._heap[0][2] not in self._live:
      heapq.heappop(self._heap)

  def peek(self):
    self._settle()
    return self._heap[0][2]

  def popleft(self):
    self._settle()
    rid = heapq.heappop(self._heap)[2]
    self._live.discard(rid)
    return rid

  def remove(self, rid) -> None:
    self._live.discard(rid)   # its heap entry goes when it reaches the top

  def __contains__(self, rid) -> bool:
    return rid in self._live

  def __len__(self) -> int:
    return len(self._live)


def first_fit(free: np.ndarray, n: int) -> int | None:
  """Start of the first run of `n` free rows, or None (vectorised: called per request
  while the host holds the queue's lock)."""
  if n > free.size:
    return None
  runs = np.convolve(free.astype(np.int32), np.ones((n,), np.int32), mode="valid")
  hits = np.flatnonzero(runs == n)
  return int(hits[0]) if hits.size else None


class Seen(NamedTuple):
  """What the last entry read says about the device's columns (`live_ops.SNAPSHOT_COLUMNS`)."""
  index: int            # the entry's index
  active: int           # columns running
  done: int             # finished, not yet retired
  forking: int          # ready to fork
  parked: int           # preempted, waiting to come back
  wanted: int           # tokens the columns could feed now
  stalled: bool         # it ran fewer steps than dispatched (a step did not fit, or a head may adopt)
  width_total: int      # `Ledger.width_total` and `steps_total` after its steps were dispatched
  steps_total: int
  enqueued_tokens: int  # `Ledger.enqueued_tokens` when it was dispatched


class Ledger:
  """The host bookkeeping of the incremental API's loop state (module docstring).

  Args:
    out_rows: the output rows `R` of the loop state.
    scheduling: the waiting line's order (`Engine.scheduling`).
  """

  def __init__(self, out_rows: int, scheduling: str):
    self.lock = threading.Lock()           # every field below (add_request/abort from any thread)
    self.changed = threading.Condition(self.lock)   # an entry dispatched or collected
    self.tracked: dict = {}                # request_id -> Tracked, in arrival order
    self.waiting = Waiting(scheduling)     # on the host, not yet in the device queue
    self.free = np.ones((out_rows,), bool)
    self.aborts: dict = {}   # (request_id, index) -> None, in call order: O(1) membership
    self.pending: collections.deque = collections.deque()   # dispatched entries, oldest first
    self.dispatched = 0                    # entries dispatched on this state
    self.enqueued = 0                      # requests ever appended to the device queue
    self.queued_seen = 0                   # device queue length after the last entry read
    self.enqueued_seen = 0                 # `enqueued` when that entry was dispatched
    self.steps_seen = 0                    # the loop's step counter after the last entry read
    self.cut_rows: list = []               # rows cut at a host-side stop, removed at next dispatch
    self.free_after_abort: list = []       # (base, n) of released requests holding cut rows
    self.held = 0                          # cache positions held after the last entry read
    self.sampled = 0                       # requests in flight that are not plain greedy
    self.branched = 0                      # of them, those a step with no branch cannot sample
                                           # (`admission.plain_sampled`)
    self.with_logprobs = 0                 # requests in flight that want logprobs
    self.waiting_tokens = 0                # prompt tokens of the requests not yet admitted
    self.unadmitted = 0                    # requests not yet admitted (counts() is O(1))
    # Stepping (`LiveQueue.dispatch(stepwise=True)`): prompt tokens ever enqueued, rows of the
    # steps ever dispatched, the last admission block's entry, and the last entry read.
    self.enqueued_tokens = 0
    self.width_total = 0
    self.steps_total = 0
    self.admitted_at = -1                  # index of that entry
    self.enqueued_at_admit = 0             # `enqueued` when it was dispatched
    self.seen: Seen | None = None

  @property
  def queued(self) -> int:
    """Requests in the device queue by the last entry read, plus those appended since (an
    upper bound: admissions since then only free slots)."""
    return self.queued_seen + self.enqueued - self.enqueued_seen

  def track(self, rid, t: Tracked) -> None:
    """Records a new request `t` as waiting on the host, with its share of the counters
    (`_forget` takes it back). Holds `lock`."""
    self.sampled += not plain_greedy(t.request.params)
    self.branched += not plain_sampled(t.request.params, TOP_CAP)
    self.with_logprobs += t.request.params.logprobs is not None
    self.waiting_tokens += len(t.request.prompt)
    self.unadmitted += 1
    self.tracked[rid] = t
    self.waiting.append(rid, t.request.params.max_tokens)

  def settle_held(self) -> None:
    """`held` is 0 once no request is on the device (a snapshot read after the last one left
    may still count its columns, which are gone). Holds `lock`."""
    if len(self.tracked) == len(self.waiting):
      self.held = 0

  def _forget(self, rid) -> Tracked:
    """Drops `rid`'s record and its share of the counters. Holds `lock`."""
    t = self.tracked.pop(rid)
    self.sampled -= not plain_greedy(t.request.params)
    self.branched -= not plain_sampled(t.request.params, TOP_CAP)
    self.with_logprobs -= t.request.params.logprobs is not None
    if t.admitted is None:
      self.waiting_tokens -= len(t.request.prompt)
      self.unadmitted -= 1
    return t

  def release(self, rid) -> RequestTiming:
    """Forgets a finished request and frees its output rows; its timing. Holds `lock`.

    Rows freed here are reused only by a later dispatch, which runs after any
    device work on them (an abort or the entry that finished them) in the device's order.
    """
    t = self._forget(rid)
    if t.base >= 0:
      if any(t.base <= row < t.base + t.n for row in self.cut_rows):
        self.free_after_abort.append((t.base, t.n))   # a column still writes there
      else:
        self.free[t.base:t.base + t.n] = True
    now = time.perf_counter()
    since = lambda x: None if x is None else x - t.arrived
    tokens = max(t.emitted)   # the longest sample: the request's last token came with it
    between = (now - t.first_token) / (tokens - 1) if tokens > 1 else None
    return RequestTiming(since(t.admitted), since(t.first_token), now - t.arrived, between)

  def reset(self) -> list:
    """After a failure: forgets every request the device held (their ids) and the device's
    counters; requests waiting on the host stay."""
    with self.lock:
      failed = [rid for rid, t in self.tracked.items() if t.base >= 0]
      for rid in failed:
        self._forget(rid)
      self.aborts = {k: v for k, v in self.aborts.items() if k[0] in self.tracked}
      self.free[:] = True
      self.pending.clear()
      self.dispatched = self.enqueued = self.queued_seen = self.enqueued_seen = 0
      self.steps_seen, self.held, self.cut_rows, self.free_after_abort = 0, 0, [], []
      self.enqueued_tokens = self.width_total = self.steps_total = self.enqueued_at_admit = 0
      self.admitted_at, self.seen = -1, None
      self.changed.notify_all()
    return failed
