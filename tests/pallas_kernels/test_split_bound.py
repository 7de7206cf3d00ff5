"""The static split bound: the epilogue merges `split_bound` partials per token, never fewer than a plan makes.

`varlen_attention_sm90.split_bound` caps `max_splits` from the cache's row count so
the epilogue of a short cache gathers one or two partials per token instead of 16.
The cap must never bind on valid input (else the plan would split less than it
would have); these tests check that over random segment tables, and that the
bounded and unbounded calls give bitwise the same output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import Family
from kernel_cases import queries
from kernel_cases import random_step
from kernel_cases import resident_storage
import pallas_kernels
from pallas_kernels import combine_sm90
from pallas_kernels import common
from pallas_kernels import config as config_lib
from pallas_kernels import indexing
from pallas_kernels import varlen_attention_sm90
from pallas_kernels import varlen_plan as column


def _random_table(rng, *, num_rows, window, width):
  """A valid segment table: per segment a column, a start position and a length
  whose read range fits the cache (CONTRACT §7.2), and a real-segment count."""
  info = np.zeros((width, 5), np.int32)
  n = int(rng.integers(1, width + 1))
  q_start = 0
  for i in range(n):
    q_len = int(rng.integers(1, 4)) if rng.random() < 0.7 else int(rng.integers(1, width + 1))
    if window is None:
      # Flat: positions end inside the rows; often right at the end (the longest read).
      q_len = min(q_len, num_rows)
      end = num_rows if rng.random() < 0.4 else int(rng.integers(q_len, num_rows + 1))
      pos0 = end - q_len
    else:
      # Ring: a read `[pos0 - window + 1, pos0 + q_len)` of at most `num_rows` keys.
      q_len = min(q_len, num_rows - window + 1)
      pos0 = int(rng.integers(0, 5 * num_rows))
    info[i, indexing.SEG_Q_START] = q_start
    info[i, indexing.SEG_Q_LEN] = q_len
    info[i, indexing.SEG_POS0] = pos0
    info[i, indexing.SEG_COL] = i
    q_start += q_len
  return jnp.asarray(info), jnp.int32(n)


@pytest.mark.parametrize("seed", range(4))
def test_split_bound_never_binds_on_valid_tables(seed):
  """Plans made with `max_splits` 16 never split a segment more than the bound allows."""
  rng = np.random.default_rng(seed)
  checked_multi = 0
  for _ in range(60):
    block_k = int(rng.choice([8, 16, 64, 128]))
    split_len = int(block_k * rng.choice([1, 2, 3, 8, 16]))
    window = None if rng.random() < 0.5 else int(rng.integers(1, 300))
    num_rows = int(rng.integers(1, 1200)) if window is None else window + int(rng.integers(0, 64))
    config = config_lib.VarlenAttentionConfig(
        block_q=8, block_k=block_k, split_len=split_len, max_splits=16,
        split_budget=int(rng.choice([0, 4, 512])), max_split_tokens=64, use_wgmma=False)
    bound = column.split_bound(num_rows, block_k=block_k, window=window, config=config)
    table, n = _random_table(rng, num_rows=num_rows, window=window, width=16)
    seg = column._segment_plan(table, n, num_rows=num_rows, window=window, group=1,  # pylint: disable=protected-access
                               tile_rows=8, block_k=block_k, align=column.ROW_ALIGN,
                               config=config)
    most = int(jnp.max(seg["splits"]))
    assert 1 <= most <= bound, (num_rows, block_k, split_len, window, most, bound)
    checked_multi += most > 1
  # The tables are not all too short to split: the bound was tested where splits happen.
  assert checked_multi >= 5


def test_split_bound_values():
  """The bound follows the longest read: one split up to `split_len` rows, then more."""
  config = config_lib.VarlenAttentionConfig(block_k=128, split_len=2048, max_splits=16)
  bound = lambda rows, window=None: column.split_bound(rows, block_k=128, window=window,
                                                       config=config)
  assert bound(384) == 1          # no segment can read more than split_len keys
  assert bound(2048 - 7) == 1
  assert bound(2304) == 2
  assert bound(1 << 20) == 16     # capped by max_splits
  assert bound(2041, window=2000) == 2   # a ring's wrap may add a tile


FAMILY = Family("bf16-flat-gqa4x2-d64", jnp.bfloat16, None, 4, 2, 64, width=8, max_seqs=3,
                capacity=48, num_steps=6)
RING = Family("fp16-ring20-mha-d64", jnp.float16, 20, 2, 2, 64, width=6, max_seqs=3,
              capacity=48, num_steps=6)


# Each family at one split length: 16 lowers max_splits on the flat cache, 64 on the ring.
@pytest.mark.parametrize("family, split_len", [(FAMILY, 16), (RING, 64)], ids=str)
def test_bounded_and_unbounded_calls_agree_bitwise(family, split_len, rng, monkeypatch):
  """Lowering `max_splits` to the bound changes no output bit.

  With `split_len` 16 and 8-row tiles the 48-row flat cache allows at most
  `ceil(7 / 2) = 4` splits (the 25-row ring 3), so `max_splits` 6 is lowered; with
  `split_len` 64 the bound is 1 and the epilogue merges nothing. Either way each
  token's partials combine exactly as before: the dropped slots held weight 0,
  and a single partial is copied where the merge computed `1 * o / 1`.
  """
  config = config_lib.VarlenAttentionConfig(
      block_q=8, block_k=8, num_stages=2, split_len=split_len, split_budget=6, max_splits=6,
      max_split_tokens=8, max_programs=4, use_wgmma=False)
  rows = family.num_rows
  bound = column.split_bound(rows, block_k=8, window=family.window, config=config)
  assert bound < config.max_splits and (bound == 1) == (split_len == 64)
  scale = 1.0 / np.sqrt(family.head_dim)
  for index in range(3):
    step = random_step(rng, family, pad=index % 2 == 0, allow_blocks=index == 1)
    k, v = resident_storage(rng, family, step)
    q = queries(rng, family, step)
    args = (q, k, v, jnp.asarray(step.seq_info), jnp.int32(step.n_segments))
    outs = []
    for bounded in (True, False):
      # Unbounded: the wrapper's `bounded_config` keeps `config.max_splits`.
      monkeypatch.setattr(varlen_attention_sm90, "bounded_config",
                          column.bounded_config if bounded else _unbounded)
      jax.clear_caches()
      outs.append(np.asarray(pallas_kernels.varlen_attention(
          *args, window=family.window, scale=scale, config=config, interpret=True), np.float32))
    np.testing.assert_array_equal(outs[0], outs[1], err_msg=step.description)
  jax.clear_caches()   # no later call reuses a trace made with the bound patched out


def _unbounded(config, num_rows, *, block_k, window):
  del num_rows, block_k, window
  return config


def test_bounded_config_keeps_other_fields():
  config = config_lib.VarlenAttentionConfig(block_k=128, split_len=2048, max_splits=16)
  bounded = column.bounded_config(config, 384, block_k=128, window=None)
  assert bounded == dataclasses.replace(config, max_splits=1)
  assert column.bounded_config(config, 1 << 20, block_k=128, window=None) is config


@pytest.mark.parametrize("seed", range(3))
def test_plan_without_sorts_matches_the_sorted_plan(seed, monkeypatch):
  """The segment plan and the item table are the same built with compare-and-sums
  (`common.prefix_sum`, `sorted_prefix_sum`, `sort_rows`) as with the cumsums and
  stable argsorts they replace (the helpers' fallback, forced by zero bounds: the
  plan's `PLAN_COMPARE_ELEMENTS` and the helpers' own), and
  with the item and token searches compared pair by pair as by their linear form
  (`common.searchsorted_iota` past `SEARCH_COMPARE_PAIRS`), on tables with ties in
  length and padded rows."""
  rng = np.random.default_rng(seed)
  for _ in range(20):
    block_k = int(rng.choice([8, 16]))
    window = None if rng.random() < 0.5 else int(rng.integers(1, 100))
    num_rows = int(rng.integers(1, 400)) if window is None else window + int(rng.integers(0, 64))
    config = config_lib.VarlenAttentionConfig(
        block_q=8, block_k=block_k, split_len=block_k * int(rng.choice([1, 2])), max_splits=16,
        split_budget=int(rng.choice([0, 4, 64])), max_split_tokens=int(rng.choice([4, 64])),
        use_wgmma=False)
    width = int(rng.choice([4, 16, 40]))
    table, n = _random_table(rng, num_rows=num_rows, window=window, width=width)
    plans = []
    for bound, search_pairs in ((1 << 62, 1 << 62), (0, 0)):
      monkeypatch.setattr(column, "PLAN_COMPARE_ELEMENTS", bound)
      monkeypatch.setattr(common, "COMPARE_ELEMENTS", bound)
      monkeypatch.setattr(common, "SEARCH_COMPARE_PAIRS", search_pairs)
      seg = column._segment_plan(table, n, num_rows=num_rows, window=window, group=2,  # pylint: disable=protected-access
                                 tile_rows=8, block_k=block_k, align=column.ROW_ALIGN,
                                 config=config)
      max_items = column.item_capacity(width, group=2, tile_rows=8, config=config)
      items = column._item_table(seg, max_items=max_items, group=2, tile_rows=8,  # pylint: disable=protected-access
                                 block_k=block_k, window=window, sort_items=True)
      tokens = combine_sm90.token_items(seg, num_tokens=width, group=2, block_q=8,
                                        num_items=max_items)
      plans.append((seg, items, tokens))
    (seg, items, tokens), (want_seg, want_items, want_tokens) = plans
    for name in want_seg:
      np.testing.assert_array_equal(seg[name], want_seg[name], err_msg=name)
    np.testing.assert_array_equal(items, want_items)
    for got, want in zip(tokens, want_tokens):
      np.testing.assert_array_equal(got, want)
