"""The incremental API's host records of its requests (`LiveQueue`, `live.py`, keeps them).

`Tracked` is one request in flight (its checked request, arrival, output rows,
tokens reported per sample); `Waiting` is the line of requests on the host not
yet in the device queue, in admission order; `first_fit` finds output rows
for a request's samples.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import numpy as np

from jaxkv.serve.requests import Request


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
