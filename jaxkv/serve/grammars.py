"""The incremental API's grammar pool on the host: where each automaton lives, what is free.

Requests arrive one by one, so their automata are placed one by one in the loop state's
pool (`LoopState.grammar`) and stay where they are while any request in flight uses them:
a column holds global state ids, so an automaton in use never moves. One placed for an
earlier request is reused by every later request with the same spec (`identity`: the spec's
digest, so a copy from a front process counts as the same automaton), and evicted, first placed first, only when a new
one needs its room. The host keeps a mirror of the pool and uploads it whole after a
placement (a few megabytes, once per new spec).
"""

from __future__ import annotations

import numpy as np

from jaxkv.structured.automaton import TokenAutomaton
from jaxkv.structured.pool import DEAD, capacity_of, empty_pool


class _Ranges:
  """First-fit allocation of `[0, size)`: free holes as sorted `(start, length)`."""

  def __init__(self, size: int):
    self.holes = [(0, size)]

  def take(self, n: int) -> int | None:
    for k, (start, length) in enumerate(self.holes):
      if length >= n:
        self.holes[k:k + 1] = [(start + n, length - n)] if length > n else []
        return start
    return None

  def give(self, start: int, n: int) -> None:
    holes = sorted(self.holes + [(start, n)])
    merged = [holes[0]]
    for s, length in holes[1:]:
      ps, pl = merged[-1]
      if ps + pl == s:
        merged[-1] = (ps, pl + length)
      else:
        merged.append((s, length))
    self.holes = merged


class GrammarPlacer:
  """Places automata in a pool of `capacity = (states, masks, transitions, automata)` for a
  model of `vocab_size` tokens; `pool` is the host mirror to upload after `place` changed it."""

  def __init__(self, vocab_size: int, capacity):
    self.vocab_size, self.capacity = vocab_size, capacity_of(capacity)
    self.pool = empty_pool(vocab_size, *self.capacity)
    self._ranges = [_Ranges(n) for n in self.capacity]
    self._placed: dict[object, tuple[TokenAutomaton, tuple[int, ...]]] = {}

  def initial(self, automaton: TokenAutomaton) -> int | None:
    """The automaton's initial state in the pool, if it is placed."""
    hit = self._placed.get(automaton.identity)
    return None if hit is None else hit[1][0] + automaton.initial

  def place(self, automaton: TokenAutomaton, in_use) -> bool | None:
    """Places `automaton` unless it is; evicts placed automata whose ids are not in `in_use`
    (first placed first) while it does not fit. True: placed now (upload `pool`); False:
    already placed; None: no room while the others stay in use (nothing changed)."""
    if automaton.identity in self._placed:
      return False
    need = _need(automaton)
    while True:
      taken = [r.take(n) for r, n in zip(self._ranges, need)]
      if None not in taken:
        break
      for r, n, at in zip(self._ranges, need, taken):   # undo the partial take
        if at is not None:
          r.give(at, n)
      idle = next((key for key in self._placed if key not in in_use), None)
      if idle is None:
        return None
      self._evict(idle)
    self._write(automaton, taken)
    self._placed[automaton.identity] = (automaton, tuple(taken))
    return True

  def _evict(self, key: int) -> None:
    automaton, taken = self._placed.pop(key)
    for r, at, n in zip(self._ranges, taken, _need(automaton)):
      r.give(at, n)
    s0 = taken[0]
    p = self.pool
    p.count[s0:s0 + automaton.num_states] = 0   # a stale id allows nothing but stop tokens
    p.final[s0:s0 + automaton.num_states] = 0

  def _write(self, a: TokenAutomaton, at) -> None:
    s0, m0, t0, row = at
    p, ns, nm, nt = self.pool, a.num_states, a.masks.shape[0], a.tokens.shape[0]
    p.final[s0:s0 + ns] = a.final
    p.mask_of[s0:s0 + ns] = a.mask_of + m0
    p.start[s0:s0 + ns] = a.start + t0
    p.count[s0:s0 + ns] = a.count
    p.masks[m0:m0 + nm] = 0
    p.masks[m0:m0 + nm, :a.masks.shape[1]] = a.masks
    p.tokens[t0:t0 + nt] = a.tokens
    p.next[t0:t0 + nt] = np.where(a.next >= 0, a.next + s0, DEAD)
    p.row[s0:s0 + ns] = row
    p.class_of[row] = 0
    p.class_of[row, :a.vocab_size] = a.class_of


def _need(a: TokenAutomaton) -> tuple[int, int, int, int]:
  """What `a` takes of each range: states, masks, transitions, one row of classes."""
  return a.num_states, a.masks.shape[0], a.tokens.shape[0], 1
