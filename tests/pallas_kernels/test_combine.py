"""The one-kernel attention epilogue (`pallas_kernels.combine`) against a NumPy merge.

The oracle merges each token's split partials from the definition (weights
`2 ** lse`), in float64, sharing no code with the kernel or its XLA twin.
Partial rows no token owns are NaN (the attention kernel leaves them unwritten).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import combine


def _case(rng, *, group, head_dim, num_kv_heads=2, block_q=8):
  """Segments `(q_start, q_len, splits)` in token order, then padding tokens."""
  tile_tokens = block_q // group
  segments = [(0, 1, 3), (1, 2 * tile_tokens + 1, 1), (2 * tile_tokens + 2, 1, 1),
              (2 * tile_tokens + 3, 1, 2)]
  num_tokens = 2 * tile_tokens + 7
  table = np.zeros((num_tokens, 3), np.int32)
  table[:, combine.TOK_ITEM] = -1
  owned = []   # (item, token-local row block) of every real token's partials
  item = 0
  for q_start, q_len, splits in segments:
    tiles = -(-q_len // tile_tokens)
    for local in range(q_len):
      base = item + (local // tile_tokens) * splits
      table[q_start + local] = (base, splits, (local % tile_tokens) * group)
      owned += [(base + j, local % tile_tokens) for j in range(splits)]
    item += tiles * splits
  num_items = item + 2
  o = np.full((num_items, num_kv_heads, block_q, head_dim), np.nan, np.float32)
  lse = np.full((num_items, num_kv_heads, block_q), np.nan, np.float32)
  for it, block in owned:
    rows = slice(block * group, (block + 1) * group)
    o[it, :, rows] = rng.standard_normal((num_kv_heads, group, head_dim))
    lse[it, :, rows] = rng.uniform(-30, 30, (num_kv_heads, group))
  return table, o, lse


def _oracle(table, o, lse, group):
  num_tokens = table.shape[0]
  num_kv_heads, head_dim = o.shape[1], o.shape[3]
  out = np.zeros((num_tokens, num_kv_heads * group, head_dim))
  for t, (item, splits, row0) in enumerate(table):
    if item < 0:
      continue
    for h in range(num_kv_heads):
      for g in range(group):
        ls = lse[item:item + splits, h, row0 + g].astype(np.float64)
        w = 2.0 ** (ls - ls.max())
        out[t, h * group + g] = (w[:, None] * o[item:item + splits, h, row0 + g]).sum(0) / w.sum()
  return out


@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (4, 64), (8, 64)])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_combine_kernel_merges_partials_and_zeroes_padding(group, head_dim, out_dtype):
  rng = np.random.default_rng(group * 1000 + head_dim)
  table, o, lse = _case(rng, group=group, head_dim=head_dim)
  got = combine.combine(jnp.asarray(table), jnp.asarray(o), jnp.asarray(lse), group=group,
                        max_splits=4, out_dtype=out_dtype, interpret=True)
  assert got.shape == (table.shape[0], o.shape[1] * group, head_dim) and got.dtype == out_dtype
  want = _oracle(table, o, lse, group)
  atol = 1e-5 if out_dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=0)
  padding = table[:, combine.TOK_ITEM] < 0
  assert padding.any()
  np.testing.assert_array_equal(np.asarray(got, np.float32)[padding], 0.0)


def test_combine_kernel_refuses_layouts_it_does_not_serve():
  assert combine.serves(4, 64, interpret=True) and combine.serves(1, 128, interpret=True)
  assert not combine.serves(3, 64, interpret=True) and not combine.serves(4, 80, interpret=True)
  table, o, lse = _case(np.random.default_rng(0), group=2, head_dim=64)
  with pytest.raises(NotImplementedError, match="power-of-two"):
    combine.combine(jnp.asarray(table), jnp.asarray(o[..., :48]), jnp.asarray(lse), group=2,
                    max_splits=4, out_dtype=jnp.float32, interpret=True)
