"""`_plan.build_step` equals the formulation it replaced, on random declarations.

The segment lengths were counted per token (a scatter-add over the segment
index, taken by `cumsum`); `build_step` now takes them from consecutive segment
starts and the index by a compare-and-sum. The oracle below is the earlier
code; every `Step` field must be bitwise equal for declarations with a sequence
spanned twice, owner-block flags, padding, and no token at all.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import _plan
from pallas_kernels import indexing


def _cumsum_seq_info(config, decl_ids, decl_block, decl_n, positions):
  width = config.step_width
  tokens = jnp.arange(width, dtype=jnp.int32)
  is_real = _plan.token_mask(config, decl_n)
  is_start = is_real & ((tokens == 0) | (decl_ids != jnp.roll(decl_ids, 1))
                        | (decl_block != jnp.roll(decl_block, 1)))
  seg_index = jnp.cumsum(is_start, dtype=jnp.int32) - 1
  token_target = jnp.where(is_real, seg_index, width)
  q_len = jnp.zeros((width,), jnp.int32).at[token_target].add(1, mode="drop")
  seq_cols = jnp.where(is_real, decl_ids, config.scratch_col)
  fields = jnp.stack([tokens, q_len[jnp.clip(seg_index, 0, width - 1)], seq_cols,
                      positions, decl_block], axis=1)
  pad_row = indexing.pad_segment_row(decl_n, config.scratch_col)
  seq_info = jnp.tile(pad_row[None, :], (width, 1))
  return seq_info.at[jnp.where(is_start, seg_index, width)].set(fields, mode="drop")


@pytest.mark.parametrize("width", [1, 4, 16])
def test_build_step_matches_the_counted_segment_lengths(width, rng):
  layer = jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), 1, 8)
  config = jaxkv.CacheConfig([layer], capacity=256, max_seqs=3, max_write=width)
  for _ in range(30):
    n = int(rng.integers(0, width + 1))
    ids = np.full((width,), config.max_seqs, np.int32)
    ids[:n] = rng.integers(0, config.max_seqs, n)   # runs of one id, ids recurring
    if n > 2 and rng.random() < 0.5:
      ids[:n] = np.sort(ids[:n])
    block = np.zeros((width,), np.int32)
    block[:n] = rng.random(n) < 0.3
    decl_ids, decl_block, decl_n = jnp.asarray(ids), jnp.asarray(block), jnp.int32(n)
    pos = jnp.asarray(rng.integers(0, 50, config.max_seqs), jnp.int32)
    positions = _plan.derive_positions(config, decl_ids, decl_n, pos)
    step = _plan.build_step(config, decl_ids, decl_block, decl_n, positions)
    want = _cumsum_seq_info(config, decl_ids, decl_block, decl_n, positions)
    np.testing.assert_array_equal(step.seq_info, want, err_msg=f"{ids=} {block=} {n=}")
    assert int(step.n_segments) == int(np.sum(np.asarray(want)[:, indexing.SEG_Q_LEN] > 0))
