"""Item planning for `varlen_attention_sm90`: segment fields, key splits and the item table.

All on device (jnp), once per call; the paged wrapper (`paged_sm90`) plans the
same way over a page table's logical rows. `split_bound` is the static cap on
key splits that a cache's row count allows, which sizes the epilogue's merge.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import indexing
from pallas_kernels.common import prefix_sum
from pallas_kernels.common import searchsorted_iota
from pallas_kernels.common import sort_rows
from pallas_kernels.common import sorted_prefix_sum
from pallas_kernels.varlen_kernel_sm90 import ROW_ALIGN


def _cdiv(a, b):
  return (a + b - 1) // b


# The compared elements up to which the plan's prefix sums and longest-first orders are
# compare-and-sums (`common.prefix_sum`, `sorted_prefix_sum`, `sort_rows`), for tables of
# up to 5,792 entries, above the helpers' own bound (`common.COMPARE_ELEMENTS`): for the
# mixed step's and wide prefills' tables the compares measured faster on the H200 than
# the argsorts (two kernels each) and cumsums they replace.
PLAN_COMPARE_ELEMENTS = 1 << 25


def split_bound(num_rows: int, *, block_k: int, window, config) -> int:
  """The most key splits any segment of a `num_rows`-row cache can get (static).

  A segment reads at most `num_rows` keys (CONTRACT §7.2): one run of rows (flat)
  or two (a ring's wrap), each tiled from an 8-aligned row, so at most
  `ceil((num_rows + 7) / block_k)` tiles, one more on a ring. `_segment_plan`
  splits only segments of more than `split_len` keys' tiles, into chunks of at
  least that many tiles, so no segment gets more than
  `ceil(max_tiles / ceil(split_len / block_k))` splits. The epilogue merges this
  many partials per token instead of `config.max_splits` (16): one (no merge at
  all) for flat caches of up to `split_len - 7` rows, two up to about twice that.
  The plan clips to the same bound, so plan and epilogue agree on any input.
  """
  max_tiles = _cdiv(num_rows + ROW_ALIGN - 1, block_k) + (0 if window is None else 1)
  min_tiles = _cdiv(config.split_len, block_k)
  return max(1, min(config.max_splits, _cdiv(max_tiles, min_tiles)))


def bounded_config(config, num_rows: int, *, block_k: int, window):
  """`config` with `max_splits` lowered to `split_bound`: the epilogue merges, and the
  item table reserves, only as many splits as the cache's rows allow."""
  bound = split_bound(num_rows, block_k=block_k, window=window, config=config)
  return config if bound == config.max_splits else dataclasses.replace(config, max_splits=bound)


def _segment_plan(seq_info, n_segments, *, num_rows, window, group, tile_rows, block_k,
                  align, config):
  """Per-segment fields and item counts, all `[W]` int32 (jnp, on device)."""
  width = seq_info.shape[0]
  q_start = seq_info[:, indexing.SEG_Q_START]
  q_len = seq_info[:, indexing.SEG_Q_LEN]
  is_real = (jnp.arange(width, dtype=jnp.int32) < n_segments) & (q_len > 0)
  q_len = jnp.where(is_real, q_len, 0)
  pos0 = seq_info[:, indexing.SEG_POS0]
  kind = seq_info[:, indexing.SEG_KIND]
  lo = indexing.read_start(pos0, window=window)
  end = pos0 + q_len
  if window is None:
    first_row, first_len, second_len = lo, end - lo, jnp.zeros_like(lo)
  else:
    first_row, first_len, second_len = indexing.ring_runs(lo, end, num_rows=num_rows)
  first_len = jnp.where(is_real, first_len, 0)
  second_len = jnp.where(is_real, second_len, 0)
  tile0_row, num_first, num_second = indexing.run_tiling(
      first_row, first_len, second_len, block=block_k, align=align)
  num_tiles = num_first + num_second
  q_tiles = _cdiv(q_len * group, tile_rows)
  splits = _split_counts(q_tiles, q_len, num_tiles, block_k=block_k, config=config)
  tiles_per_split = jnp.maximum(_cdiv(num_tiles, splits), 1)
  # Every split gets at least one tile: drop the empty tail of a rounded split.
  splits = jnp.maximum(_cdiv(num_tiles, tiles_per_split), 1)
  num_items = jnp.where(is_real, q_tiles * splits, 0)
  return dict(q_start=q_start, q_len=q_len, col=seq_info[:, indexing.SEG_COL], pos0=pos0,
              kind=kind, lo=lo, end=end, first_row=first_row, first_len=first_len,
              second_len=second_len, tile0_row=tile0_row, num_first=num_first,
              num_tiles=num_tiles, splits=splits, tiles_per_split=tiles_per_split,
              num_items=num_items,
              cu_items=prefix_sum(num_items, max_elements=PLAN_COMPARE_ELEMENTS))


def _split_counts(q_tiles, q_len, num_tiles, *, block_k, config):
  """Key splits per segment, before the empty tails are dropped (`_segment_plan`).

  All ones, without the plan, when the cache is too short for any segment to split
  (`config.max_splits` is then 1, see `split_bound`): the plan would compute the
  same ones through a compare-and-sum (a sort and a cumsum for wide calls) per call.
  """
  if config.max_splits == 1:
    return jnp.ones_like(num_tiles)
  # Only segments of one q tile long enough to split may split, and only as many
  # (longest first) as keep their tokens within `max_split_tokens`: the combine
  # merges splits for that many tokens and copies every other token's one row.
  min_tiles = _cdiv(config.split_len, block_k)
  may_split = (q_tiles == 1) & (num_tiles > min_tiles)
  split_tokens = sorted_prefix_sum(-jnp.where(may_split, num_tiles, -1),
                                   jnp.where(may_split, q_len, 0),
                                   max_elements=PLAN_COMPARE_ELEMENTS)
  splittable = may_split & (split_tokens <= config.max_split_tokens)
  # The split length grows with the total work so that all splits fit in the
  # static budget (sum of splits <= budget + segments).
  split_work = jnp.sum(jnp.where(splittable, num_tiles, 0))
  chunk = jnp.maximum(min_tiles, _cdiv(split_work, max(config.split_budget, 1)))
  if config.split_budget == 0:
    chunk = jnp.maximum(chunk, jnp.max(num_tiles))
  return jnp.where(splittable, jnp.clip(_cdiv(num_tiles, chunk), 1, config.max_splits), 1)


def item_capacity(num_tokens: int, *, group: int, tile_rows: int, config,
                  num_segments: int | None = None) -> int:
  """Rows of the item table (static): the tokens' q tiles, one partly filled tile
  more per segment (at most one per token, and at most one per row of a segment
  table of `num_segments` rows), and `split_budget` more items when segments may
  split (none when the cache is too short to, see `split_bound`).

  A cache step's table has a row per token, so its plan is sized for as many
  segments as tokens; a 16,384-token prefill of one sequence passed with a one-row
  table plans 1,537 items instead of 17,920 (the item table's order and the
  searches over it are then compare-and-sums, not sorts).
  """
  segments = num_tokens if num_segments is None else min(num_tokens, num_segments)
  return (_cdiv(num_tokens * group, tile_rows) + segments
          + (config.split_budget if config.max_splits > 1 else 0))


def _item_table(seg, *, max_items, group, tile_rows, block_k, window, sort_items):
  """Flat int32 `[1 + max_items * NUM_ITEM_FIELDS]`: the active count, then one row per item."""
  item = jnp.arange(max_items, dtype=jnp.int32)
  cu = seg["cu_items"]
  s = jnp.minimum(searchsorted_iota(cu, max_items), cu.shape[0] - 1)
  active = item < cu[-1]
  f = {name: value[s] for name, value in seg.items() if name != "cu_items"}
  local = item - (cu[s] - f["num_items"])
  q_tile = local // f["splits"]
  split = local % f["splits"]
  q_tok0 = q_tile * tile_rows                    # first row of the tile in the segment
  rows = jnp.minimum(f["q_len"] * group - q_tok0, tile_rows)
  first_q = f["pos0"] + q_tok0 // group
  last_q = f["pos0"] + (q_tok0 + jnp.maximum(rows, 1) - 1) // group
  key_start, key_stop = indexing.visible_key_range(first_q, last_q, f["lo"], f["end"],
                                                   f["kind"], window=window)
  # Keys every query of the tile sees: the range of its last query's window
  # start and its first query's causal end.
  all_start, all_stop = indexing.visible_key_range(last_q, first_q, f["lo"], f["end"],
                                                   f["kind"], window=window)
  tile_args = (f["lo"], f["first_row"], f["first_len"], f["tile0_row"], f["num_first"])
  t_lo = indexing.tile_of_key(key_start, *tile_args, block=block_k)
  t_hi = indexing.tile_of_key(key_stop - 1, *tile_args, block=block_k) + 1
  t_begin = jnp.maximum(t_lo, split * f["tiles_per_split"])
  t_end = jnp.minimum(t_hi, (split + 1) * f["tiles_per_split"])
  t_end = jnp.where(active, jnp.maximum(t_end, t_begin), t_begin)
  table = jnp.stack([
      item, active.astype(jnp.int32), f["col"], f["kind"],
      f["q_start"] * group + q_tok0, q_tok0, f["pos0"], f["lo"], f["end"],
      f["first_row"], f["first_len"], f["second_len"], f["tile0_row"], f["num_first"],
      t_begin, t_end, all_start, all_stop, rows,
      (f["splits"] == 1).astype(jnp.int32)], axis=1).astype(jnp.int32)   # IT_WHOLE
  if sort_items:
    # Longest first: workers take items in table order, so this shortens the tail.
    # Active items stay first.
    table = sort_rows(jnp.where(active, -(t_end - t_begin), 1), table,
                      max_elements=PLAN_COMPARE_ELEMENTS)
  return jnp.concatenate([cu[-1:], table.reshape(-1)])
