"""The kernel's online-softmax update, tile by tile, against a float64 softmax.

`varlen_kernel_sm90.online_softmax` is plain jnp on `[rows, block_k]` tiles, so it
runs here outside any kernel, tile by tile as the kernel runs it, on scores whose
max creeps up, jumps, falls, and rows masked for whole tiles (or entirely). The
normalized output and log-sum-exp (base 2) are compared with a float64 softmax
that shares no code with the kernel.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import varlen_kernel_sm90 as body
from pallas_kernels.common import MASK_VALUE

ROWS, BLOCK_K, D, TILES = 16, 8, 4, 6


def _run(scores, values, valid):
  """The kernel's per-tile loop and its final normalization (`store_partial`)."""
  m_i = jnp.full((ROWS,), MASK_VALUE, jnp.float32)
  l_i = jnp.zeros((ROWS,), jnp.float32)
  acc = (jnp.zeros((ROWS, D), jnp.float32),)
  for t in range(TILES):
    cols = slice(t * BLOCK_K, (t + 1) * BLOCK_K)
    s = jnp.asarray(scores[:, cols], jnp.float32)
    mask = jnp.asarray(valid[:, cols])
    m_i, l_i, acc, p = body.online_softmax(s, m_i, l_i, acc, mask, jnp.float32)
    acc = (acc[0] + p @ jnp.asarray(values[cols], jnp.float32),)
  has = l_i > 0
  out = np.asarray(acc[0] / jnp.where(has, l_i, 1.0)[:, None])
  lse = np.asarray(jnp.where(has, m_i + jnp.log2(jnp.where(has, l_i, 1.0)), MASK_VALUE))
  return out, lse


def _oracle(scores, values, valid):
  out = np.zeros((ROWS, D))
  lse = np.full((ROWS,), np.nan)
  for r in range(ROWS):
    s = scores[r, valid[r]].astype(np.float64)
    if s.size:
      w = np.exp2(s - s.max())
      out[r] = w @ values[valid[r]].astype(np.float64) / w.sum()
      lse[r] = s.max() + np.log2(w.sum())
  return out, lse


def _scores(rng, kind):
  n = TILES * BLOCK_K
  base = rng.normal(size=(ROWS, n))
  if kind == "creeping":      # each tile's max a little above the last
    return base + np.repeat(np.arange(TILES) * 1.5, BLOCK_K)[None, :]
  if kind == "jumps":         # large steps on some tiles, rows apart
    steps = rng.choice([0.0, 3.0, 12.0, 40.0], size=(ROWS, TILES))
    return base + np.repeat(np.cumsum(steps, axis=1), BLOCK_K, axis=1)
  if kind == "falling":       # the first tile holds the max
    return base - np.repeat(np.arange(TILES) * 5.0, BLOCK_K)[None, :]
  return base * 4.0


@pytest.mark.parametrize("kind", ["creeping", "jumps", "falling", "wide"])
def test_online_softmax_matches_float64_softmax(kind):
  rng = np.random.default_rng(7)
  scores = _scores(rng, kind)
  values = rng.normal(size=(TILES * BLOCK_K, D))
  valid = rng.random(scores.shape) < 0.8
  valid[0] = False                       # a row that sees no key at all
  valid[1, : 3 * BLOCK_K] = False        # a row whose first tiles are all masked
  valid[2, 2 * BLOCK_K:] = False         # a row masked from the third tile on
  out, lse = _run(scores, values, valid)
  want_out, want_lse = _oracle(scores, values, valid)
  seen = valid.any(axis=1)
  np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
  # Exact on purpose: a row that saw no key gets the sentinel log-sum-exp and a zero
  # output by selection (`jnp.where`) and by zero weights, not by arithmetic that
  # could round differently on another CPU.
  np.testing.assert_array_equal(lse[~seen], np.float32(MASK_VALUE))
  np.testing.assert_array_equal(out[~seen], 0.0)
