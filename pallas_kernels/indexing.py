"""The one home of jaxkv's index and mask arithmetic.

Ring row <-> position, ring size, the ring floor, a segment's read range and key
visibility live here and nowhere else. Kernel bodies, the pure-jnp references and
the jaxkv core all call these functions, so they cannot drift; only the test
oracle re-derives the rules, independently.

Conventions: ranges are half-open (`*_end` exclusive); `window=None` means a flat
layer (`row(p) = p`, no lower bound); every traced value is int32. A "ring" of
`num_rows` rows stores position `p` at row `p % num_rows`.

The segment table (`seq_info`, `[W, 5]` int32) has the columns named by the
`SEG_*` constants below; rows `[0, n_segments)` are real, in step order, and
padded rows are `[n, 0, max_seqs, 0, 0]`.
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

# Columns of the segment table `seq_info`.
SEG_Q_START = 0
SEG_Q_LEN = 1
SEG_COL = 2
SEG_POS0 = 3
SEG_KIND = 4
NUM_SEG_FIELDS = 5

# Segment kinds.
KIND_CAUSAL = 0
KIND_BLOCK = 1  # bidirectional owner block (DFlash draft)


def ring_num_rows(window: int, max_write: int, capacity: int) -> int:
  """Rows of a ring layer: `min(capacity, window + max_write - 1)`.

  A step writes all its tokens before attending, and its first query still needs
  the `window - 1` positions before it, hence `window + max_write - 1`. A ring
  clamped to `capacity` never wraps, because no position reaches `capacity`.
  """
  return min(capacity, window + max_write - 1)


def row_of(positions, *, num_rows: int, window: int | None):
  """Physical row of each logical position: `p` (flat) or `p % num_rows` (ring)."""
  if window is None:
    return positions
  return positions % num_rows


def ring_floor(hw, *, num_rows: int, window: int):
  """Lowest length a rewind or clone may target for one ring layer (CONTRACT §4.2).

  A ring written up to `hw - 1` still holds positions `[hw - num_rows, hw)`;
  resuming at `p` needs `[p - window + 1, p)`, so `p >= hw - num_rows + window - 1`
  once the ring has wrapped (`hw > num_rows`), and 0 before.
  """
  wrapped_floor = hw - num_rows + window - 1
  return jnp.where(hw > num_rows, wrapped_floor, jnp.zeros_like(hw))


def floor(hw, rings):
  """Floor over all ring layers: `max_l ring_floor(hw, R_l, w_l)`; 0 without rings.

  Args:
    hw: int32 array of high-water marks (any shape).
    rings: iterable of `(num_rows, window)` static pairs, one per ring layer.
  """
  result = jnp.zeros_like(hw)
  for num_rows, window in rings:
    result = jnp.maximum(result, ring_floor(hw, num_rows=num_rows, window=window))
  return result


def read_start(pos0, *, window: int | None):
  """First logical key position a segment starting at `pos0` reads (`lo`)."""
  if window is None:
    return jnp.zeros_like(pos0)
  return jnp.maximum(pos0 - window + 1, 0)


def key_positions(rows, lo, end, *, num_rows: int, window: int | None):
  """Logical position held by each physical row for a read of `[lo, end)`.

  Flat rows hold their own index. Ring row `r` holds `lo + ((r - lo) mod R)`; the
  result is only meaningful where it lies below `end` (see `in_read_range`).
  Overflow-free in int32 for any ring size: `rows` and `lo mod R` lie in
  `[0, R)`, so their difference lies in `(-R, R)` (`rows - lo + R` would
  overflow once R exceeds 2**30).
  """
  if window is None:
    return rows
  offset = rows - lo % num_rows
  return lo + jnp.where(offset < 0, offset + num_rows, offset)


def ring_runs(lo, end, *, num_rows: int):
  """The one or two ring row runs covering logical `[lo, end)`, oldest first.

  Returns `(a, first_len, second_len)`: rows `[a, a + first_len)` then
  `[0, second_len)`. Requires `end - lo <= num_rows` (CONTRACT §7.2).
  """
  a = lo % num_rows
  length = end - lo
  first_len = jnp.minimum(length, num_rows - a)
  return a, first_len, length - first_len


def in_read_range(key_pos, lo, end):
  """Whether a key position lies in the segment's read range `[lo, end)`."""
  return (key_pos >= lo) & (key_pos < end)


def is_visible(key_pos, query_pos, lo, end, kind, *, window: int | None):
  """Whether a query at `query_pos` may see the key at `key_pos` (CONTRACT §7.2).

  A causal query sees read-range keys at or before itself and, on a ring, inside
  its window. An owner-block query (`kind == KIND_BLOCK`) sees the whole read
  range, which already ends at the block's end. All arguments broadcast.
  """
  visible = in_read_range(key_pos, lo, end)
  causal = key_pos <= query_pos
  if window is not None:
    causal = causal & (key_pos >= query_pos - window + 1)
  return visible & (causal | (kind == KIND_BLOCK))


def page_address(page_table, cols, rows, page_size: int):
  """`(page, offset)` holding logical `rows` of columns `cols` (arrays of one shape) when paged.

  Position `p` of column `c` lives at offset `p % P` of page `page_table[c, p // P]`
  (CONTRACT §3.1); the slot is clamped into the table, so any row indexes safely.
  """
  pages_per_col = page_table.shape[1]
  slot = jnp.clip(rows // page_size, 0, pages_per_col - 1)
  return page_table[cols, slot], rows % page_size


def pad_segment_row(n_tokens, scratch_col):
  """The padded segment row `[n, 0, scratch_col, 0, 0]` as an int32 vector."""
  n = jnp.asarray(n_tokens, jnp.int32)
  zero = jnp.zeros((), jnp.int32)
  return jnp.stack([n, zero, jnp.asarray(scratch_col, jnp.int32), zero, zero])


# Tile-level helpers for the Mosaic GPU attention kernel. A segment's read range
# is one or two row runs (`ring_runs`; a flat layer has one run starting at row
# `lo`). Each run is cut into tiles of `block` rows whose first tile starts at the
# run's first row rounded down to `align` (TMA on tiled shared memory needs
# aligned row offsets); tiles are numbered across both runs, oldest keys first,
# so key positions increase with the tile number.


def visible_key_range(first_query_pos, last_query_pos, lo, end, kind, *,
                      window: int | None):
  """Keys `[start, stop)` that some query in `[first, last]` of a segment may see.

  A causal query at `p` sees at most up to `p` and, on a ring, from
  `p - window + 1`; an owner block sees its whole read range `[lo, end)`.
  Called with `first` and `last` swapped, it gives the keys that every query
  in `[first, last]` sees (empty when `start >= stop`).
  """
  is_block = kind == KIND_BLOCK
  stop = jnp.where(is_block, end, jnp.minimum(end, last_query_pos + 1))
  if window is None:
    return lo, stop
  start = jnp.where(is_block, lo, jnp.maximum(lo, first_query_pos - window + 1))
  return start, stop


def run_tiling(first_row, first_len, second_len, *, block: int, align: int):
  """Tiles covering the runs `[first_row, first_row + first_len)` and `[0, second_len)`.

  Returns `(tile0_row, num_first_tiles, num_second_tiles)`: first-run tile `t`
  starts at row `tile0_row + t * block`, second-run tile `u` at `u * block`.
  """
  tile0_row = first_row - first_row % align
  num_first = jnp.where(first_len > 0, (first_row + first_len - tile0_row + block - 1) // block, 0)
  num_second = (second_len + block - 1) // block
  return tile0_row, num_first, num_second


def tile_of_key(key_pos, lo, first_row, first_len, tile0_row, num_first_tiles, *,
                block: int):
  """Tile number (see `run_tiling`) holding logical key `key_pos` of `[lo, end)`."""
  in_first = key_pos < lo + first_len
  first_tile = (first_row + (key_pos - lo) - tile0_row) // block
  second_tile = num_first_tiles + (key_pos - lo - first_len) // block
  return jnp.where(in_first, first_tile, second_tile)


def full_tile_range(lo, first_row, first_len, tile0_row, num_first_tiles, all_start, all_stop,
                    *, block: int):
  """First-run tiles `[begin, end)` whose rows all hold keys that every query sees.

  Every tile `t` in the range lies inside the first run (rows `[first_row,
  first_row + first_len)`, so `tile_span` gives it no partial rows) and holds keys
  in `[all_start, all_stop)`, the keys every query of the item sees: the tiles
  whose scores need no mask. The range may be empty (`end <= begin`) and may
  leave out full tiles (second-run tiles, and the rounding below is toward zero,
  which only shrinks it); it never includes a tile that needs a mask. Scalar
  int32 arithmetic, traced or not (the kernel computes it once per item).
  """
  # Rows whose keys (`lo + row - first_row` in the first run) are seen by every query.
  row_lo = first_row + jnp.maximum(all_start - lo, 0)
  row_hi = first_row + jnp.minimum(first_len, all_stop - lo)
  b = jnp.int32(block)
  # Tile t starts at `tile0_row + t * block` (`tile0_row <= first_row <= row_lo`): the
  # first tile starting at or past `row_lo`, and the tiles ending by `row_hi`.
  begin = lax.div(row_lo - tile0_row + b - 1, b)
  end = jnp.minimum(lax.div(row_hi - tile0_row, b), num_first_tiles)
  return begin, end


def tile_span(tile, lo, first_row, first_len, second_len, tile0_row, num_first_tiles, *,
              block: int):
  """Rows and keys of one tile: `(tile_row, rows_start, rows_end, key_at_rows_start)`.

  The tile covers rows `[tile_row, tile_row + block)`; of these, rows
  `[rows_start, rows_end)` belong to the read range, and row `r` there holds
  logical key `key_at_rows_start + (r - rows_start)` (rows of one run hold
  consecutive positions). Works on scalars, traced or not.
  """
  in_first = tile < num_first_tiles
  second_tile = tile - num_first_tiles
  tile_row = jnp.where(in_first, tile0_row + tile * block, second_tile * block)
  run_start = jnp.where(in_first, first_row, 0)
  run_end = jnp.where(in_first, first_row + first_len, second_len)
  run_key = jnp.where(in_first, lo, lo + first_len)
  rows_start = jnp.maximum(run_start, tile_row)
  rows_end = jnp.minimum(run_end, tile_row + block)
  return tile_row, rows_start, rows_end, run_key + (rows_start - run_start)
