"""Paged copies of the kernel tests' column storage (CONTRACT §3.1), built with NumPy only.

`paged_copy` lays a column storage `[R, C, K, D]` out in a pool
`[num_pages, P, K, D]` through a page table of scattered, non-contiguous pages
(a random permutation of the pool), without `pallas_kernels.paged`: the
addressing is re-derived here. Everything no column holds is NaN: free pages,
the scratch page, and the rows of held pages at or past each column's end (the
column storage is NaN there already), so a stray read shows up in an output.
With `fork`, a second column shares the first one's full pages below both
columns' first step position, as `seq_clone` leaves them (its column storage
gets the donor's rows there, so both layouts hold the same logical contents).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Paged:
  """A paged layout and the column storage with the same logical contents."""

  k_cols: jnp.ndarray      # [M * P, C, K, D]: the input rows, NaN-padded to whole pages
  v_cols: jnp.ndarray
  k_pool: jnp.ndarray      # [num_pages, P, K, D]
  v_pool: jnp.ndarray
  page_table: jnp.ndarray  # [C, M] int32
  shared_pages: int        # table entries that name another column's page


def _column_extents(step):
  """`{col: (first pos0, end)}` of the columns the step's real segments read."""
  extents = {}
  for _, q_len, col, pos0, _ in np.asarray(step.seq_info)[:step.n_segments]:
    first, end = extents.get(int(col), (int(pos0), 0))
    extents[int(col)] = (min(first, int(pos0)), max(end, int(pos0 + q_len)))
  return extents


def paged_copy(rng, k, v, step, *, page_size: int, fork: bool,
               extra_pages: int = 2) -> Paged:
  """The paged layout of column storage `k`, `v` `[R, C, K, D]` for `step`'s columns.

  Every column the step reads holds `ceil(end / P)` pages; the others hold none
  (their table rows name the scratch page, the pool's last). `extra_pages` free
  pages stay unowned.
  """
  dtype = k.dtype
  k = np.asarray(k.astype(jnp.float32))
  v = np.asarray(v.astype(jnp.float32))
  num_rows, num_cols = k.shape[:2]
  pages_per_col = -(-num_rows // page_size)
  pad = ((0, pages_per_col * page_size - num_rows), (0, 0), (0, 0), (0, 0))
  k = np.pad(k, pad, constant_values=np.nan)
  v = np.pad(v, pad, constant_values=np.nan)
  num_pages = pages_per_col * num_cols + extra_pages + 1
  scratch = num_pages - 1
  table = np.full((num_cols, pages_per_col), scratch, np.int32)
  extents = _column_extents(step)
  donor = shares = 0
  if fork and len(extents) >= 2:
    # The pair whose first step positions leave the most full pages to share.
    pairs = [(min(extents[a][0], extents[b][0]) // page_size, a, b)
             for a in extents for b in extents if a != b]
    shares, donor, sharer = max(pairs)
  fresh = iter(rng.permutation(num_pages - 1))
  for col, (_, end) in sorted(extents.items()):
    for slot in range(-(-end // page_size)):
      table[col, slot] = next(fresh)
  if shares:
    rows = slice(0, shares * page_size)
    table[sharer, :shares] = table[donor, :shares]   # the sharer's own pages become free
    k[rows, sharer], v[rows, sharer] = k[rows, donor], v[rows, donor]
  k_pool = np.full((num_pages, page_size) + k.shape[2:], np.nan, np.float32)
  v_pool = k_pool.copy()
  for col, (_, end) in extents.items():
    for slot in range(-(-end // page_size)):
      rows = slice(slot * page_size, (slot + 1) * page_size)
      k_pool[table[col, slot]], v_pool[table[col, slot]] = k[rows, col], v[rows, col]
  as_jnp = lambda x: jnp.asarray(x, dtype)
  return Paged(as_jnp(k), as_jnp(v), as_jnp(k_pool), as_jnp(v_pool), jnp.asarray(table),
               shares)


def read_through_table(pool, table, page_size: int) -> np.ndarray:
  """`[M * P, C, K, D]` float32: every column's logical rows, looked up in NumPy."""
  pool = np.asarray(jnp.asarray(pool).astype(jnp.float32))
  table = np.asarray(table)
  rows = np.arange(table.shape[1] * page_size)
  pages = table[:, rows // page_size]                       # [C, M * P]
  return pool[pages, rows % page_size].transpose(1, 0, 2, 3)
