"""The attention kernel's tile mask against a brute-force oracle.

`varlen_kernel_sm90.row_bound_mask` turns the read range and visibility into two
column limits per row. It must give the mask the oracle re-derives from CONTRACT
§7.2, element by element, for any tile geometry: tiles cut by the read rows at
either end, keys before or after the queries, rings (windows), owner blocks, rows
whose queries see nothing. Plain arrays on CPU: the function is the kernel's own.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexing
from pallas_kernels import varlen_kernel_sm90 as body


def _oracle(load_row, rows_start, rows_end, key0, query_row, lo, end, kind, window, block_k):
  """{(r, c): visible} by the contract's rules, one score at a time."""
  mask = np.zeros((len(query_row), block_k), bool)
  for r, q in enumerate(query_row):
    for c in range(block_k):
      row = load_row + c
      if not rows_start <= row < rows_end:
        continue
      key = key0 + (row - rows_start)
      if not lo <= key < end:
        continue
      if kind == indexing.KIND_BLOCK:
        mask[r, c] = True
      else:
        mask[r, c] = key <= q and (window is None or key > q - window)
  return mask


def _draw(rng, block_q, block_k, window):
  load_row = int(rng.integers(0, 4096)) // 8 * 8
  rows_start = load_row + int(rng.integers(0, block_k))
  rows_end = int(rng.integers(rows_start + 1, load_row + block_k + 1))
  key0 = int(rng.integers(0, 5000))
  lo = key0 - int(rng.integers(-block_k, 3 * block_k))
  end = key0 + int(rng.integers(-block_k, 3 * block_k))
  group = int(rng.integers(1, 9))
  pos0 = key0 + int(rng.integers(-2 * block_k, 3 * block_k))
  q_tok0 = int(rng.integers(0, 4))
  query_row = pos0 + (q_tok0 + np.arange(block_q)) // group
  kind = int(rng.integers(0, 2))
  return load_row, rows_start, rows_end, key0, query_row, lo, end, kind


@pytest.mark.parametrize("window", [None, 1, 5, 64, 200], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("block_q, block_k", [(8, 8), (16, 64), (64, 128)])
def test_row_bound_mask_matches_the_oracle(window, block_q, block_k, rng):
  key_col = jnp.broadcast_to(jnp.arange(block_k, dtype=jnp.int32), (block_q, block_k))
  for _ in range(25):
    load_row, rows_start, rows_end, key0, query_row, lo, end, kind = _draw(
        rng, block_q, block_k, window)
    want = _oracle(load_row, rows_start, rows_end, key0, query_row, lo, end, kind, window,
                   block_k)
    scalars = [jnp.int32(x) for x in (load_row, rows_start, rows_end, key0)]
    common = dict(lo=jnp.int32(lo), end=jnp.int32(end), kind=jnp.int32(kind), window=window)
    by_rows = body.row_bound_mask(*scalars, key_col, jnp.asarray(query_row, jnp.int32),
                                  **common)
    np.testing.assert_array_equal(np.asarray(by_rows), want)
