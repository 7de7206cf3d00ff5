"""Seeded random Steps for the kernel tests (CONTRACT scenario 49).

Builds, with NumPy only and without `pallas_kernels.indexing` (the rules are
re-derived here, independently), a random step of several live sequences:
random live sets and histories, sequences spanned twice, owner blocks, rings
before/at/after wrap, padded steps. Storage is NaN everywhere except the rows a
sequence still holds (its ring window or its flat history), so any stray read of
another column, the scratch column, a stale ring row or a padded token shows up
as NaN in a real output row.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Family:
  """Static shapes shared by a group of random Steps (one compilation each)."""

  name: str
  dtype: object
  window: int | None          # None: flat layer
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  width: int                  # W = max_write
  max_seqs: int
  capacity: int
  num_steps: int
  q_dtype: object = None      # None: same as the storage dtype

  @property
  def num_rows(self) -> int:
    if self.window is None:
      return self.capacity
    return min(self.capacity, self.window + self.width - 1)

  def __str__(self):
    return self.name


@dataclasses.dataclass
class Step:
  """One random step: plan arrays plus the storage it attends over."""

  n_tokens: int
  seq_cols: np.ndarray      # [W] int32
  positions: np.ndarray     # [W] int32
  rows: np.ndarray          # [W] int32
  seq_info: np.ndarray      # [W, 5] int32
  n_segments: int
  description: str


def _runs(rng, live, n_tokens, allow_blocks):
  """Random runs `(seq, length, is_block)` covering `n_tokens` tokens."""
  runs, left = [], n_tokens
  while left:
    seq = int(rng.choice(live))
    length = int(rng.integers(1, left + 1)) if rng.random() < 0.4 else min(left, 1 + int(
        rng.integers(0, 3)))
    if runs and runs[-1][0] == seq:
      runs[-1] = (seq, runs[-1][1] + length, False)
    else:
      runs.append((seq, length, False))
    left -= length
  if allow_blocks:
    # A sequence's last run may become its owner block (CONTRACT §9 rules 2-4).
    last = {}
    for i, (seq, _, _) in enumerate(runs):
      last[seq] = i
    for seq, i in sorted(last.items(), key=lambda item: -item[1]):
      if rng.random() < 0.35:
        length = runs[i][1]
        causal = int(rng.integers(0, length)) if rng.random() < 0.5 else 0
        # The owner's causal run before its block is a separate segment.
        runs[i:i + 1] = ([(seq, causal, False)] if causal else []) + [
            (seq, length - causal, True)]
  return runs


def random_step(rng, family: Family, *, pad: bool, allow_blocks: bool) -> Step:
  """A random valid step of `family` (positions continue each live history)."""
  width, max_seqs = family.width, family.max_seqs
  num_live = int(rng.integers(1, max_seqs + 1))
  live = rng.choice(max_seqs, size=num_live, replace=False)
  n_tokens = int(rng.integers(1, width + 1)) if pad else width
  runs = _runs(rng, live, n_tokens, allow_blocks)
  tokens_of = {int(s): 0 for s in live}
  for seq, length, _ in runs:
    tokens_of[seq] += length
  # Histories: short, near a ring's size (before/at/after wrap) or long.
  room = family.capacity - sum(tokens_of.values())
  pos = {}
  for s in map(int, live):
    top = max(0, min(room // max(num_live, 1), family.capacity - tokens_of[s]))
    choice = rng.integers(0, 3)
    if choice == 0 or family.window is None:
      p = int(rng.integers(0, top + 1))
    else:
      r = family.num_rows
      p = int(np.clip(r + rng.integers(-3, 3 * width + 1), 0, top))
    pos[s] = p
  seq_cols = np.full(width, max_seqs, np.int32)
  positions = np.zeros(width, np.int32)
  seq_info = np.zeros((width, 5), np.int32)
  seq_info[:] = [n_tokens, 0, max_seqs, 0, 0]
  cursor, t = dict(pos), 0
  segments = []
  for seq, length, is_block in runs:
    segments.append([t, length, seq, cursor[seq], int(is_block)])
    for _ in range(length):
      seq_cols[t], positions[t] = seq, cursor[seq]
      cursor[seq] += 1
      t += 1
  seq_info[:len(segments)] = segments
  rows = positions % family.num_rows if family.window is not None else positions.copy()
  rows[n_tokens:] = 0
  desc = f"n={n_tokens} runs={runs} pos={pos}"
  return Step(n_tokens, seq_cols, positions, rows.astype(np.int32), seq_info,
              len(segments), desc)


def resident_storage(rng, family: Family, step: Step):
  """K/V storage holding each stepped sequence's resident history; NaN elsewhere."""
  shape = (family.num_rows, family.max_seqs + 1, family.num_kv_heads, family.head_dim)
  k = np.full(shape, np.nan, np.float32)
  v = np.full(shape, np.nan, np.float32)
  ends = {}
  for q_start, q_len, col, pos0, _ in step.seq_info[:step.n_segments]:
    ends[int(col)] = max(ends.get(int(col), 0), int(pos0 + q_len))
  for col, end in ends.items():
    first = 0 if family.window is None else max(0, end - family.num_rows)
    for p in range(first, end):
      row = p % family.num_rows
      k[row, col] = rng.standard_normal((family.num_kv_heads, family.head_dim))
      v[row, col] = rng.standard_normal((family.num_kv_heads, family.head_dim))
  return jnp.asarray(k, family.dtype), jnp.asarray(v, family.dtype)


def queries(rng, family: Family, step: Step):
  """`[W, H_q, D]` queries; padded tokens are NaN."""
  q = rng.standard_normal((family.width, family.num_q_heads, family.head_dim))
  q[step.n_tokens:] = np.nan
  return jnp.asarray(q, family.q_dtype or family.dtype)
