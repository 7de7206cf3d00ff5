"""Every head layout the attention kernel serves (issue 12): GQA groups 1..16, head dims
64/80/96/128/256, bfloat16 and float16, against the reference.

The interpreter runs the kernel's shared index math (q tiles of whole tokens,
`q_tile_rows`) on CPU with small tiles; the compiled tests (Hopper only) run the
same layouts with 64-row wgmma tiles, where G = 3, 5, 6, 7 leave idle rows and
head dims 80/96 take 32/64-byte swizzles. Each family draws rings before, at and
after wrap, owner blocks and padded steps (`kernel_cases.random_step`).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from attention_checks import check_family
from attention_checks import attention_calls
from attention_checks import requires_hopper
from kernel_cases import Family
import pallas_kernels
from pallas_kernels import config as config_lib
from pallas_kernels import varlen_attention_sm90
from pallas_kernels import varlen_kernel_sm90


def _family(group, head_dim, dtype, window, num_kv_heads, *, width, capacity, max_seqs,
            num_steps):
  layout = "flat" if window is None else f"ring{window}"
  # bf16 queries on small rings get float32 queries (and outputs): a bf16 output
  # near |2| is one ulp (1/64) away from the reference, outside the 1e-2 tolerance.
  q_dtype = jnp.float32 if dtype == jnp.bfloat16 and window is not None else None
  name = (f"{jnp.dtype(dtype).name}-{layout}-g{group}x{num_kv_heads}-d{head_dim}"
          + ("-f32q" if q_dtype else ""))
  return Family(name, dtype, window, group * num_kv_heads, num_kv_heads, head_dim,
                width=width, max_seqs=max_seqs, capacity=capacity, num_steps=num_steps,
                q_dtype=q_dtype)


# (G, head_dim, dtype, window, KV heads): every group 1..8 and 16, every head dim,
# both 16-bit dtypes, flat and wrapping rings.
LAYOUTS = [
    (1, 80, jnp.bfloat16, 5, 2),
    (2, 96, jnp.float16, None, 2),
    (3, 64, jnp.bfloat16, 4, 1),
    (4, 256, jnp.float16, 6, 1),
    (5, 80, jnp.float16, None, 1),
    (6, 96, jnp.bfloat16, 3, 1),
    (7, 128, jnp.float16, 5, 1),
    (8, 80, jnp.bfloat16, None, 1),
    (16, 96, jnp.float16, 4, 1),
    (3, 256, jnp.bfloat16, None, 1),
    (5, 128, jnp.bfloat16, 7, 2),
    (4, 112, jnp.bfloat16, 5, 1),   # three column parts: 64 + 32 + 16
]
INTERPRET_LAYOUT_FAMILIES = [
    _family(*layout, width=4, capacity=40, max_seqs=3, num_steps=2) for layout in LAYOUTS]
# Tiles of 8 rows: G = 3, 5, 7 pack 2, 1 and 1 tokens per tile, with splits.
INTERPRET_SPLIT_CONFIG = config_lib.VarlenAttentionConfig(
    block_q=8, block_k=8, num_stages=3, split_len=8, split_budget=2, max_splits=3,
    max_split_tokens=3, sort_items=False, use_wgmma=False)

# Compiled: widths of several 64-row q tiles for every group, rings that wrap.
GPU_LAYOUT_FAMILIES = [
    _family(*layout, width=40, capacity=400, max_seqs=4, num_steps=6) for layout in LAYOUTS]


def _gpu_split_config(head_dim):
  # block_k != head_dim (the defaults never pick square tiles); two stages keep head dim 256
  # within shared memory (`_smem_bytes`).
  return config_lib.VarlenAttentionConfig(
      block_k=128 if head_dim == 64 else 64, num_stages=2, split_len=64, split_budget=16,
      max_splits=4)


@pytest.mark.parametrize("family", INTERPRET_LAYOUT_FAMILIES, ids=str)
def test_interpreted_kernel_serves_head_layout(family, rng):
  check_family(family, rng, config=None, interpret=True)


@pytest.mark.parametrize("family", [f for f in INTERPRET_LAYOUT_FAMILIES
                                    if f.num_q_heads // f.num_kv_heads in (3, 5, 7)], ids=str)
def test_interpreted_kernel_serves_head_layout_with_splits(family, rng):
  check_family(family, rng, config=INTERPRET_SPLIT_CONFIG, interpret=True)


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", GPU_LAYOUT_FAMILIES, ids=str)
def test_compiled_kernel_serves_head_layout(family, splits, rng):
  config = _gpu_split_config(family.head_dim) if splits else None
  check_family(family, rng, config=config, interpret=False)


@pytest.mark.parametrize("head_dim", [144, 192, 240])
def test_compiled_kernel_refuses_wide_head_dims_not_in_128_column_parts(head_dim):
  """Above 128 columns the q tile loads in 128-column parts (`q_column_parts`); other wide head
  dims are refused by a shape check, before anything is traced, needing no GPU."""
  q = jax.ShapeDtypeStruct((40, 4, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((64, 5, 1, head_dim), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=f"head_dim={head_dim}.*multiple of 128"):
    varlen_attention_sm90.check_request(q, k)
  for served in (128, 256):
    varlen_attention_sm90.check_request(
        jax.ShapeDtypeStruct((40, 4, served), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, 5, 1, served), jnp.bfloat16))


@pytest.mark.parametrize("block_q, group, want", [
    (64, 1, 64), (64, 3, 63), (64, 5, 60), (64, 6, 60), (64, 7, 63), (64, 16, 64),
    (8, 3, 6), (8, 5, 5), (8, 8, 8), (16, 7, 14)])
def test_q_tiles_hold_whole_tokens(block_q, group, want):
  assert varlen_attention_sm90.q_tile_rows(block_q, group) == want


@pytest.mark.parametrize("head_dim, want", [
    (80, ((0, 64), (64, 16))), (112, ((0, 64), (64, 32), (96, 16))),
    (96, ((0, 96),)), (64, ((0, 64),)), (128, ((0, 128),)), (256, ((0, 256),)),
    (48, ((0, 48),)), (16, ((0, 16),)), (72, ((0, 72),))])   # 72: the interpreter's
def test_column_parts_are_whole_swizzle_atoms(head_dim, want):
  """K/V tiles whose 16-bit rows take only the 32-byte swizzle as a whole (80, 112) sit in
  shared memory as parts of 64, 32 and 16 columns, each row one 128-, 64- or 32-byte
  swizzle atom; 96 (64-byte atoms) and multiples of 64 stay whole. q splits the same way
  (wider than 128 columns on the wgmma path: 128-column parts)."""
  parts = varlen_kernel_sm90.column_parts(head_dim)
  assert parts == want
  assert sum(width for _, width in parts) == head_dim
  if len(parts) > 1:
    for _, width in parts:
      assert varlen_kernel_sm90.swizzle_bytes(width, jnp.bfloat16) == 2 * width
  assert varlen_kernel_sm90.q_column_parts(False, head_dim) == parts
  assert varlen_kernel_sm90.q_column_parts(True, head_dim) == (
      ((0, 128), (128, 128)) if head_dim == 256 else parts)


@pytest.mark.parametrize("head_dim, dtype, want", [
    (64, jnp.bfloat16, 128), (128, jnp.float16, 128), (256, jnp.bfloat16, 128),
    (96, jnp.float16, 64), (80, jnp.bfloat16, 32), (48, jnp.bfloat16, 32)])
def test_swizzle_fits_the_row(head_dim, dtype, want):
  assert varlen_kernel_sm90.swizzle_bytes(head_dim, dtype) == want


def _shapes(num_tokens, group, num_kv_heads, num_rows, head_dim, dtype):
  cache = jax.ShapeDtypeStruct((num_rows, 5, num_kv_heads, head_dim), dtype)
  return (jax.ShapeDtypeStruct((num_tokens, group * num_kv_heads, head_dim), dtype), cache,
          cache, jax.ShapeDtypeStruct((num_tokens, 5), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32))


# Head dim 256 is lowered by its own test below (q in column parts).
@pytest.mark.parametrize("group, head_dim, dtype, window", [
    (3, 64, jnp.bfloat16, None), (5, 80, jnp.float16, 61), (6, 96, jnp.bfloat16, None),
    (7, 128, jnp.float16, 61), (16, 80, jnp.bfloat16, None), (1, 96, jnp.float16, 61),
    (4, 112, jnp.bfloat16, 61)],
    ids=lambda x: getattr(x, "__name__", str(x)))
def test_production_kernel_lowers_for_head_layout(group, head_dim, dtype, window):
  # Mosaic GPU checks wgmma's operand tiling, swizzle and shapes while lowering.
  attend = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=window,
                                     scale=0.1))
  lowered = attend.trace(*_shapes(16, group, 2, 128, head_dim, dtype)).lower(
      lowering_platforms=("cuda",))
  assert re.findall(r"custom_call @(\w+)", lowered.as_text()) == attention_calls(group,
                                                                                 head_dim)


@pytest.mark.parametrize("group, window", [(2, None), (4, 61), (8, None)])
def test_head_dim_256_kernel_lowers_with_q_in_column_parts(group, window):
  """Mosaic GPU loads a (64, 256) q tile into the WGMMA layout only from (8, 64)-tiled
  shared memory, which the q copy cannot use (items start at `token * G` rows): layout
  inference searched for minutes and then gave up. With q in two (64, 128) column
  parts and QK^T as one wgmma per part, the production geometry (compiled default
  config, two stages, 64-row K/V tiles) lowers like head dim 128 (its results are
  checked against the reference by `test_compiled_kernel_serves_head_layout` on a GPU)."""
  head_dim, dtype = 256, jnp.bfloat16
  config = config_lib.default_varlen_attention_config(group=group, head_dim=head_dim,
                                                      interpret=False)
  assert config.use_wgmma
  assert varlen_kernel_sm90.q_column_parts(True, head_dim) == ((0, 128), (128, 128))
  assert varlen_kernel_sm90.q_column_parts(True, 128) == ((0, 128),)
  assert varlen_kernel_sm90.q_column_parts(False, 256) == ((0, 256),)
  attend = jax.jit(functools.partial(varlen_attention_sm90._varlen_attention,  # pylint: disable=protected-access
                                     window=window, scale=0.1, config=config, interpret=None))
  lowered = attend.trace(*_shapes(16, group, 2, 128, head_dim, dtype)).lower(
      lowering_platforms=("cuda",))
  assert re.findall(r"custom_call @(\w+)", lowered.as_text()) == attention_calls(group, head_dim)
