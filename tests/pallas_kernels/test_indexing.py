"""Tile-level index helpers against brute force (the oracle re-derives the rules)."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels import indexing


def _read_rows(lo, end, num_rows, window):
  """Oracle: {row: key} for a segment's read range, rows by plain arithmetic."""
  return {(k if window is None else k % num_rows): k for k in range(lo, end)}


@pytest.mark.parametrize("window", [None, 1, 3, 7], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("block, align", [(1, 1), (4, 1), (8, 8), (16, 8)])
def test_tiles_cover_the_read_range_once_in_key_order(window, block, align, rng):
  for _ in range(40):
    width = int(rng.integers(1, 6))
    num_rows = 64 if window is None else window + width - 1
    pos0 = int(rng.integers(0, 4 * num_rows if window else num_rows - width))
    q_len = int(rng.integers(1, width + 1))
    end = pos0 + q_len
    lo = int(indexing.read_start(np.int32(pos0), window=window))
    if window is None:
      first_row, first_len, second_len = lo, end - lo, 0
    else:
      first_row, first_len, second_len = (int(x) for x in indexing.ring_runs(
          np.int32(lo), np.int32(end), num_rows=num_rows))
    tile0_row, num_first, num_second = (int(x) for x in indexing.run_tiling(
        np.int32(first_row), np.int32(first_len), np.int32(second_len), block=block,
        align=align))
    seen, keys = {}, []
    for tile in range(num_first + num_second):
      tile_row, rows_start, rows_end, key0 = (int(x) for x in indexing.tile_span(
          np.int32(tile), np.int32(lo), np.int32(first_row), np.int32(first_len),
          np.int32(second_len), np.int32(tile0_row), np.int32(num_first), block=block))
      assert tile_row % align == 0 and tile_row <= rows_start < rows_end <= tile_row + block
      for row in range(rows_start, rows_end):
        assert row not in seen, (tile, row)
        seen[row] = key0 + row - rows_start
        keys.append(seen[row])
        tile_of = indexing.tile_of_key(np.int32(seen[row]), np.int32(lo),
                                       np.int32(first_row), np.int32(first_len),
                                       np.int32(tile0_row), np.int32(num_first), block=block)
        assert int(tile_of) == tile
    assert seen == _read_rows(lo, end, num_rows, window)
    assert keys == sorted(keys)


@pytest.mark.parametrize("window", [None, 2, 5])
@pytest.mark.parametrize("kind", [indexing.KIND_CAUSAL, indexing.KIND_BLOCK])
def test_visible_key_range_is_the_union_and_swapped_the_intersection(window, kind, rng):
  for _ in range(40):
    pos0 = int(rng.integers(0, 30))
    q_len = int(rng.integers(1, 7))
    end = pos0 + q_len
    lo = int(indexing.read_start(np.int32(pos0), window=window))
    first = pos0 + int(rng.integers(0, q_len))
    last = int(rng.integers(first, end))
    keys = np.arange(lo, end)
    visible = np.stack([np.asarray(indexing.is_visible(keys, np.int32(p), lo, end, kind,
                                                       window=window))
                        for p in range(first, last + 1)])
    start, stop = (int(x) for x in indexing.visible_key_range(
        np.int32(first), np.int32(last), np.int32(lo), np.int32(end), np.int32(kind),
        window=window))
    any_visible = keys[visible.any(axis=0)]
    assert (start, stop) == (any_visible.min(), any_visible.max() + 1)
    assert visible.any(axis=0).sum() == stop - start   # the union is one interval
    start, stop = (int(x) for x in indexing.visible_key_range(
        np.int32(last), np.int32(first), np.int32(lo), np.int32(end), np.int32(kind),
        window=window))
    all_visible = set(keys[visible.all(axis=0)].tolist())
    assert all_visible == set(range(start, stop))


@pytest.mark.parametrize("block, align", [(4, 1), (8, 8), (64, 8), (192, 8)])
def test_full_tile_range_is_exactly_the_first_runs_tiles_that_need_no_mask(block, align, rng):
  # Oracle: a first-run tile needs no mask when its rows all lie in the run and all
  # hold keys every query sees; rows and keys by plain arithmetic, tile by tile.
  for _ in range(300):
    lo = int(rng.integers(0, 500))
    first_row = int(rng.integers(0, 300))
    first_len = int(rng.integers(0, 6 * block))
    all_start = lo + int(rng.integers(-block, 3 * block))
    all_stop = lo + int(rng.integers(-2 * block, first_len + 2 * block + 1))
    tile0_row, num_first, _ = (int(x) for x in indexing.run_tiling(
        np.int32(first_row), np.int32(first_len), np.int32(0), block=block, align=align))
    want = []
    for tile in range(num_first):
      row0 = tile0_row + tile * block
      key0 = lo + row0 - first_row
      if (first_row <= row0 and row0 + block <= first_row + first_len and key0 >= all_start
          and key0 + block <= all_stop):
        want.append(tile)
    begin, end = (int(x) for x in indexing.full_tile_range(
        np.int32(lo), np.int32(first_row), np.int32(first_len), np.int32(tile0_row),
        np.int32(num_first), np.int32(all_start), np.int32(all_stop), block=block))
    assert list(range(max(begin, 0), end)) == want, (lo, first_row, first_len, all_start,
                                                     all_stop, begin, end)
