"""The pure-Python model of the jaxkv cache: bookkeeping (CONTRACT §4-§6, §9), attention through the oracle.

It shares no code with `jaxkv` or `pallas_kernels` (it imports neither) and has
no storage: each sequence's history is a dict `position -> (k, v)` per layer, so
rows, rings, columns and the scratch column do not exist here. Ring size and the
floor are re-derived from the CONTRACT's formulas (§2, §4.2) with plain integers.

Every verb returns a status code with the CONTRACT §10.4 values (the `Status` names
below), checked in the CONTRACT's order; a refused verb changes nothing. The facade
maps NO_DECLARATION, BAD_POSITIONS, NOT_PREPARED and NOT_ATTENDED to StepError
and every other non-OK status to None/False (`FACADE_STEP_ERRORS`).

A commit is refused (NOT_ATTENDED) unless every layer was served since the step
was prepared, so every committed position of every layer holds known K/V.
"""

from __future__ import annotations

import copy
import enum
import math

import numpy as np

from oracle import attend_naive, visible_positions


class Status(enum.IntEnum):
  """CONTRACT §10.4 codes, restated (not imported) so the model stays independent."""

  OK = 0
  NOT_LIVE = 1
  NO_ROOM = 2
  NO_FREE_ID = 3
  EMPTY = 4
  TOO_WIDE = 5
  BAD_BLOCKS = 6
  BAD_TARGET = 7
  BELOW_FLOOR = 8
  NO_DECLARATION = 9
  BAD_POSITIONS = 10
  NEEDS_ROWS = 11
  NOT_PREPARED = 12
  NOT_ATTENDED = 13
  TOO_LONG = 14


class Phase(enum.IntEnum):
  IDLE = 0
  DECLARED = 1
  PREPARED = 2
  COMMITTED = 3


# A history entry the model cannot know. `attend` skips rows that would read one;
# the merge that moved `attend` here dropped this name, so every stateful test
# raised NameError.
UNKNOWN = object()

FACADE_STEP_ERRORS = (Status.NO_DECLARATION, Status.BAD_POSITIONS, Status.NOT_PREPARED,
                      Status.NOT_ATTENDED)


class CacheModel:
  """Bookkeeping and attention of a jaxkv cache, one Python dict per sequence.

  Args:
    windows: per layer, None (flat) or the ring window w >= 1.
    capacity, max_seqs, max_write, initial_capacity: as in `CacheConfig`.
    max_seq_len: as in `CacheConfig` (None: capacity): the most positions one
      sequence holds, and the flat rows' ceiling.
    kv_dtype: NumPy dtype K/V are rounded to on write (float32, float16, bfloat16).
    scales: per-layer softmax scale.
  """

  def __init__(self, windows, *, capacity: int, max_seqs: int, max_write: int,
               initial_capacity: int, kv_dtype, scales, max_seq_len: int | None = None):
    self.windows = list(windows)
    self.capacity = capacity
    self.max_rows = capacity if max_seq_len is None else max_seq_len
    self.max_seqs = max_seqs
    self.width = max_write
    self.kv_dtype = np.dtype(kv_dtype)
    self.scales = list(scales)
    self.has_flat = any(w is None for w in self.windows)
    self.flat_rows = min(initial_capacity, self.max_rows) if self.has_flat else 0
    self.live = [False] * max_seqs
    self._pos = [0] * max_seqs
    self._hw = [0] * max_seqs
    self.hist: dict[int, list[dict]] = {}
    self.phase = Phase.IDLE
    self.decl = None          # (ids, block flags)
    self.step = None          # dict: ids, positions, flags, segments
    self.served: set[int] = set()

  @classmethod
  def for_config(cls, config) -> "CacheModel":
    """The model of a `jaxkv.CacheConfig`, read by attribute (nothing of jaxkv is imported)."""
    windows = [None if lc.policy.kind == "flat" else int(lc.policy.window) for lc in config.layers]
    # Paged storage (CONTRACT §3.1) addresses every position a sequence may hold
    # from the start: its flat rows are `max_seq_len` (else `capacity`), never grown.
    paged = getattr(config, "page_size", None) is not None
    max_seq_len = getattr(config, "max_seq_len", None)
    return cls(windows, capacity=config.capacity, max_seqs=config.max_seqs,
               max_write=config.max_write,
               initial_capacity=config.capacity if paged else config.initial_capacity,
               kv_dtype=config.kv_dtype, max_seq_len=max_seq_len,
               scales=[1.0 / math.sqrt(lc.head_dim) for lc in config.layers])

  # ------------------------------------------------------------------ queries

  def ring_rows(self, layer: int) -> int:
    """R = min(capacity, w + W - 1) of a ring layer (CONTRACT §2)."""
    return min(self.capacity, self.windows[layer] + self.width - 1)

  def is_live(self, s) -> bool:
    return isinstance(s, int) and 0 <= s < self.max_seqs and self.live[s]

  def pos(self, s) -> int:
    return self._pos[s] if self.is_live(s) else 0

  def hw(self, s) -> int:
    return self._hw[s] if self.is_live(s) else 0

  @property
  def held(self) -> int:
    return sum(p for p, l in zip(self._pos, self.live) if l)

  def floor(self, s) -> int:
    """CONTRACT §4.2: max over rings of (0 if hw <= R else hw - R + w - 1)."""
    hw = self.hw(s)
    result = 0
    for layer, w in enumerate(self.windows):
      if w is not None:
        rows = self.ring_rows(layer)
        result = max(result, 0 if hw <= rows else hw - rows + w - 1)
    return result

  def control(self) -> dict:
    """The control values the state must hold: live, pos, hw (int lists), held, phase."""
    return dict(live=[int(l) for l in self.live], pos=list(self._pos), hw=list(self._hw),
                held=self.held, phase=int(self.phase))

  # ------------------------------------------------------------------ helpers

  def _lowest_free(self):
    for s in range(self.max_seqs):
      if not self.live[s]:
        return s
    return None

  def _invalidate(self):
    self.phase = Phase.IDLE
    self.decl = None

  def _has_room(self, k: int) -> bool:
    return self.held + k <= self.capacity

  # ------------------------------------------------------------------ sequence verbs

  def seq_new(self):
    """-> (status, id or None)."""
    s = self._lowest_free()
    if s is None:
      return Status.NO_FREE_ID, None
    self.live[s], self._pos[s], self._hw[s] = True, 0, 0
    self.hist[s] = [dict() for _ in self.windows]
    return Status.OK, s

  def seq_clone(self, src, upto=None):
    """-> (status, id or None); `upto=None` means pos(src)."""
    if not self.is_live(src):
      return Status.NOT_LIVE, None
    keep = self._pos[src] if upto is None else min(upto, self._pos[src])
    if keep <= 0:
      return Status.EMPTY, None
    if keep < self.floor(src):
      return Status.BELOW_FLOOR, None
    if not self._has_room(keep):
      return Status.NO_ROOM, None
    dst = self._lowest_free()
    if dst is None:
      return Status.NO_FREE_ID, None
    self.live[dst], self._pos[dst], self._hw[dst] = True, keep, self._hw[src]
    self.hist[dst] = [{p: kv for p, kv in h.items() if p < keep} for h in self.hist[src]]
    self._invalidate()
    return Status.OK, dst

  def seq_rm(self, s):
    if not self.is_live(s):
      return Status.NOT_LIVE
    self.live[s], self._pos[s], self._hw[s] = False, 0, 0
    del self.hist[s]
    self._invalidate()
    return Status.OK

  def rewind(self, s, position):
    if not self.is_live(s):
      return Status.NOT_LIVE
    if position < 0 or position > self._pos[s]:
      return Status.BAD_TARGET
    if position < self.floor(s):
      return Status.BELOW_FLOOR
    self._pos[s] = position
    for h in self.hist[s]:
      for p in [p for p in h if p >= position]:
        del h[p]
    self._invalidate()
    return Status.OK

  def clear(self):
    for s in range(self.max_seqs):
      self.live[s], self._pos[s], self._hw[s] = False, 0, 0
    self.hist.clear()
    self._invalidate()
    self.step = None
    return Status.OK

  # ------------------------------------------------------------------ the step

  def blocks_valid(self, ids, blocks) -> bool:
    """CONTRACT §9 rules 1-4 for `blocks` ((start, length) pairs) on `ids`."""
    n = len(ids)
    owners = []
    for start, length in blocks:
      if not (start >= 0 and length >= 1 and start + length <= n):
        return False
      owner = ids[start]
      if any(ids[t] != owner for t in range(start, start + length)):
        return False
      if owner in owners:
        return False
      if any(ids[t] == owner for t in range(start + length, n)):
        return False
      owners.append(owner)
    return True

  def declare_step(self, ids, blocks=()):
    ids, blocks = list(ids), list(blocks or ())
    if not ids:
      return Status.EMPTY
    if len(ids) > self.width:
      return Status.TOO_WIDE
    if not all(self.is_live(s) for s in ids):
      return Status.NOT_LIVE
    if not self.blocks_valid(ids, blocks):
      return Status.BAD_BLOCKS
    if not self._has_room(len(ids)):
      return Status.NO_ROOM
    if any(self._pos[s] + ids.count(s) > self.max_rows for s in set(ids)):
      return Status.TOO_LONG
    flags = [False] * len(ids)
    for start, length in blocks:
      for t in range(start, start + length):
        flags[t] = True
    self.decl = (ids, flags)
    self.phase = Phase.DECLARED
    return Status.OK

  def derived_positions(self) -> list[int]:
    """Positions of the standing declaration (CONTRACT §6.3)."""
    ids, _ = self.decl
    seen: dict[int, int] = {}
    out = []
    for s in ids:
      out.append(self._pos[s] + seen.get(s, 0))
      seen[s] = seen.get(s, 0) + 1
    return out

  def rows_needed(self) -> int:
    if self.phase not in (Phase.DECLARED, Phase.PREPARED):
      return 0
    return max(p + 1 for p in self.derived_positions())

  def grow(self, rows: int) -> None:
    assert self.has_flat and self.flat_rows < rows <= self.max_rows, rows
    self.flat_rows = rows

  def growth_target(self) -> int:
    """Rows the facade grows to: min(max_seq_len or capacity, max(required, 2F)) (CONTRACT §3)."""
    return min(self.max_rows, max(self.rows_needed(), 2 * self.flat_rows))

  def prepare_step(self, positions=None, *, grow: bool = True):
    """`positions`: None or the n caller positions. `grow=False` is the pure API."""
    if self.phase not in (Phase.DECLARED, Phase.PREPARED):
      return Status.NO_DECLARATION
    derived = self.derived_positions()
    if positions is not None and list(positions) != derived:
      return Status.BAD_POSITIONS
    if self.phase == Phase.PREPARED:
      return Status.OK
    if self.has_flat and self.rows_needed() > self.flat_rows:
      if not grow:
        return Status.NEEDS_ROWS
      self.flat_rows = self.growth_target()
    ids, flags = self.decl
    for s, p in zip(ids, derived):
      self._hw[s] = max(self._hw[s], p + 1)
    segments = []
    for t, (s, f, p) in enumerate(zip(ids, flags, derived)):
      if segments and segments[-1][2] == s and bool(segments[-1][4]) == f:
        segments[-1][1] += 1
      else:
        segments.append([t, 1, s, p, int(f)])
    self.step = dict(ids=list(ids), flags=list(flags), positions=derived,
                     segments=[tuple(x) for x in segments])
    self.served = set()
    self.phase = Phase.PREPARED
    return Status.OK

  def write_rows(self, layer: int) -> list[int]:
    """Rows of the prepared step's tokens on `layer`: p (flat) or p mod R (ring)."""
    if self.windows[layer] is None:
      return list(self.step["positions"])
    rows = self.ring_rows(layer)
    return [p % rows for p in self.step["positions"]]

  def visible(self, layer: int, t: int) -> range:
    """Positions step token `t` sees on `layer` (CONTRACT §8, through the oracle's table)."""
    p = self.step["positions"][t]
    block = None
    if self.step["flags"][t]:
      s = self.step["ids"][t]
      members = [i for i in range(len(self.step["ids"]))
                 if self.step["ids"][i] == s and self.step["flags"][i]]
      block = (self.step["positions"][members[0]], len(members))
    return visible_positions(p, self.windows[layer], block=block)

  def attend(self, layer: int, q, k, v):
    """Writes then attends; -> (status, out [n, H_q, D] float64, checked bool[n]).

    `checked` marks the rows a caller may compare; every row is, since a commit
    needs every layer served, but callers keep the mask for partial comparisons.
    """
    if self.phase != Phase.PREPARED:
      return Status.NOT_PREPARED, None, None
    q = np.asarray(q, np.float64)
    k = np.asarray(k).astype(self.kv_dtype).astype(np.float64)
    v = np.asarray(v).astype(self.kv_dtype).astype(np.float64)
    ids, positions = self.step["ids"], self.step["positions"]
    n = len(ids)
    for t in range(n):
      self.hist[ids[t]][layer][positions[t]] = (k[t], v[t])
    out = np.zeros((n,) + q.shape[1:], np.float64)
    checked = np.ones(n, bool)
    for t in range(n):
      h = self.hist[ids[t]][layer]
      entries = [h[kp] for kp in self.visible(layer, t)]
      out[t] = attend_naive(q[t][None], np.stack([e[0] for e in entries]),
                            np.stack([e[1] for e in entries]), np.ones((1, len(entries)), bool),
                            self.scales[layer])[0]
    self.served.add(layer)
    return Status.OK, out, checked

  def commit_step(self):
    if self.phase == Phase.COMMITTED:
      return Status.OK
    if self.phase != Phase.PREPARED:
      return Status.NOT_PREPARED
    if len(self.served) != len(self.windows):
      return Status.NOT_ATTENDED
    ends: dict[int, int] = {}
    for _, q_len, s, pos0, kind in self.step["segments"]:
      if not kind:
        ends[s] = max(ends.get(s, 0), pos0 + q_len)
    for s, end in ends.items():
      self._pos[s] = max(self._pos[s], end)
    for s in set(self.step["ids"]):   # drop uncommitted writes (block drafts)
      for h in self.hist[s]:
        for p in [p for p in h if p >= self._pos[s]]:
          del h[p]
    self.phase = Phase.COMMITTED
    self.decl = None
    return Status.OK

  def fork_copy(self) -> "CacheModel":
    return copy.deepcopy(self)
