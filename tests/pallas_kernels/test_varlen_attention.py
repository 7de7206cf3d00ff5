"""The Mosaic GPU varlen attention kernel against its reference (SPEC §10.7, scenario 49)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import has_hopper_gpu
from conftest import tol
from kernel_cases import Family
from kernel_cases import queries
from kernel_cases import random_step
from kernel_cases import resident_storage
import pallas_kernels
from pallas_kernels import _compat
from pallas_kernels import config as config_lib
from pallas_kernels import varlen_attention_sm90

# Interpreter families: small enough for two CPU cores, 52 random Steps in all.
INTERPRET_FAMILIES = [
    Family("bf16-flat-gqa8x2-d64", jnp.bfloat16, None, 8, 2, 64, width=8, max_seqs=3,
           capacity=40, num_steps=9),
    Family("fp16-ring5-gqa8x2-d128", jnp.float16, 5, 8, 2, 128, width=6, max_seqs=3,
           capacity=48, num_steps=9),
    Family("f32-ring7-mha-d64", jnp.float32, 7, 2, 2, 64, width=5, max_seqs=4, capacity=40,
           num_steps=9),
    Family("bf16-ring3-mha-d128-f32q", jnp.bfloat16, 3, 2, 2, 128, width=4, max_seqs=3,
           capacity=30, num_steps=9, q_dtype=jnp.float32),
    Family("f32-flat-gqa8x2-d128", jnp.float32, None, 8, 2, 128, width=6, max_seqs=3,
           capacity=24, num_steps=8),
    Family("fp16-flat-mha-d64", jnp.float16, None, 2, 2, 64, width=8, max_seqs=4, capacity=32,
           num_steps=8),
]

# Compiled families: rows a multiple of 8 and >= 64, head dims of 64 or 128; the
# widths make multi-q-tile prefills and the small split length forces splits.
GPU_FAMILIES = [
    Family("bf16-flat-gqa8x2-d128", jnp.bfloat16, None, 8, 2, 128, width=40, max_seqs=5,
           capacity=512, num_steps=9),
    Family("fp16-ring113-gqa8x2-d64", jnp.float16, 113, 8, 2, 64, width=16, max_seqs=4,
           capacity=600, num_steps=9),
    Family("bf16-ring57-mha-d128-f32q", jnp.bfloat16, 57, 4, 4, 128, width=8, max_seqs=4,
           capacity=300, num_steps=9, q_dtype=jnp.float32),
    Family("fp16-flat-mha-d64", jnp.float16, None, 2, 2, 64, width=32, max_seqs=4,
           capacity=256, num_steps=9),
    Family("bf16-ring93-gqa8x2-d64-padded", jnp.bfloat16, 93, 8, 2, 64, width=36, max_seqs=3,
           capacity=400, num_steps=9),
]
# block_k differs from head_dim: square K/V tiles are refused (see static_check).
SPLIT_CONFIGS = {
    64: config_lib.VarlenAttentionConfig(block_k=128, split_len=128, split_budget=16,
                                         max_splits=4),
    128: config_lib.VarlenAttentionConfig(block_k=64, split_len=64, split_budget=16,
                                          max_splits=4),
}
INTERPRET_SPLIT_CONFIG = config_lib.VarlenAttentionConfig(
    block_q=8, block_k=8, num_stages=3, split_len=8, split_budget=2, max_splits=3,
    max_split_tokens=3,
    sort_items=False, use_wgmma=False)

requires_hopper = pytest.mark.skipif(
    not has_hopper_gpu(), reason="needs an NVIDIA Hopper GPU (compute capability >= 9.0) "
    "to compile and run the Mosaic GPU kernel")


@functools.partial(jax.jit, static_argnames=("window", "scale"))
def _reference(q, k, v, seq_info, n_segments, *, window, scale):
  return pallas_kernels.varlen_attention_reference(q, k, v, seq_info, n_segments,
                                                   window=window, scale=scale)


def _check_family(family, rng, *, config, interpret):
  scale = 1.0 / np.sqrt(family.head_dim)
  for index in range(family.num_steps):
    step = random_step(rng, family, pad=index % 3 != 0, allow_blocks=index % 2 == 0)
    k, v = resident_storage(rng, family, step)
    q = queries(rng, family, step)
    args = (q, k, v, jnp.asarray(step.seq_info), jnp.int32(step.n_segments))
    kwargs = dict(window=family.window, scale=scale)
    out = pallas_kernels.varlen_attention(*args, **kwargs, config=config, interpret=interpret)
    again = pallas_kernels.varlen_attention(*args, **kwargs, config=config,
                                            interpret=interpret)
    expected = _reference(*args, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    # Each kernel runs twice and must match bitwise (padding rows included).
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32),
                                  err_msg=step.description)
    real = slice(0, step.n_tokens)
    got = np.asarray(out[real], np.float32)
    want = np.asarray(expected[real], np.float32)
    assert np.isfinite(got).all(), step.description
    np.testing.assert_allclose(got, want, atol=tol(family.dtype), rtol=0,
                               err_msg=step.description)


@pytest.mark.parametrize("family", INTERPRET_FAMILIES, ids=str)
def test_interpreted_kernel_matches_reference(family, rng):
  _check_family(family, rng, config=None, interpret=True)


@pytest.mark.parametrize("family", INTERPRET_FAMILIES[:2], ids=str)
def test_interpreted_kernel_with_splits_matches_reference(family, rng):
  _check_family(family, rng, config=INTERPRET_SPLIT_CONFIG, interpret=True)


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", GPU_FAMILIES, ids=str)
def test_compiled_kernel_matches_reference(family, splits, rng):
  config = SPLIT_CONFIGS[family.head_dim] if splits else None
  _check_family(family, rng, config=config, interpret=False)


@requires_hopper
def test_compiled_kernel_refuses_float32_storage(rng):
  family = INTERPRET_FAMILIES[2]
  step = random_step(rng, family, pad=True, allow_blocks=True)
  k, v = resident_storage(rng, family, step)
  with pytest.raises(NotImplementedError, match="float32 storage"):
    pallas_kernels.varlen_attention(queries(rng, family, step), k, v,
                                    jnp.asarray(step.seq_info), jnp.int32(step.n_segments),
                                    window=family.window, scale=0.125)


def _shapes(num_tokens, num_q_heads, num_rows, num_kv_heads, head_dim, dtype):
  return (jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
          jax.ShapeDtypeStruct((num_rows, 5, num_kv_heads, head_dim), dtype),
          jax.ShapeDtypeStruct((num_rows, 5, num_kv_heads, head_dim), dtype),
          jax.ShapeDtypeStruct((num_tokens, 5), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32))


@pytest.mark.parametrize("window", [None, 61], ids=["flat", "ring61"])
def test_production_kernel_lowers_to_one_mosaic_gpu_call(window):
  attend = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=window,
                                     scale=0.1, config=config_lib.VarlenAttentionConfig()))
  lowered = attend.trace(*_shapes(16, 8, 128, 2, 128, jnp.bfloat16)).lower(
      lowering_platforms=("cuda",))
  calls = re.findall(r"custom_call @(\w+)", lowered.as_text())
  assert calls == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("shapes, config, match", [
    ((8, 8, 64, 2, 128, jnp.float32), None, "float32 storage"),
    ((8, 8, 64, 2, 32, jnp.bfloat16), None, "multiple of 64 for wgmma"),
    ((8, 8, 60, 2, 128, jnp.bfloat16), None, "must be a multiple of 8"),
    ((8, 6, 64, 2, 64, jnp.bfloat16), None, "GQA group 3"),
    ((8, 8, 64, 2, 64, jnp.int8), None, "kv dtype int8"),
    ((8, 8, 64, 2, 64, jnp.bfloat16), None, "square K/V tiles"),
], ids=["f32", "d32", "rows60", "group3", "int8", "square"])
def test_production_kernel_refuses_what_it_cannot_serve(shapes, config, match):
  q, k, _, _, _ = _shapes(*shapes)
  with pytest.raises(NotImplementedError, match=match):
    varlen_attention_sm90.static_check(q, k, config=config or
                                       config_lib.VarlenAttentionConfig())


def test_interpreter_refuses_wgmma():
  family = INTERPRET_FAMILIES[0]
  q, k, v, _, _ = _shapes(8, 8, 64, 2, 64, family.dtype)
  args = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
          jnp.zeros((8, 5), jnp.int32), jnp.int32(0))
  with pytest.raises(NotImplementedError, match="interpreter cannot run wgmma"):
    pallas_kernels.varlen_attention(*args, window=None, scale=0.1,
                                    config=config_lib.VarlenAttentionConfig(), interpret=True)
  _compat.reset_interpreter()


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_q=32), "block_q=32 must be a multiple of 64"),
    (dict(block_k=96), "block_k=96 must be a multiple of 64"),
    (dict(num_stages=0), "num_stages=0 must be an int >= 1"),
    (dict(split_budget=-1), "split_budget=-1 must be an int >= 0"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=re.escape(match)):
    config_lib.VarlenAttentionConfig(**kwargs)


def test_configs_are_hashable_static_arguments():
  a = config_lib.VarlenAttentionConfig(block_k=128)
  assert a == config_lib.VarlenAttentionConfig(block_k=128) and hash(a) == hash(
      config_lib.VarlenAttentionConfig(block_k=128))
  assert config_lib.default_varlen_attention_config(group=4, head_dim=128,
                                                    interpret=False).use_wgmma
  assert not config_lib.default_varlen_attention_config(group=4, head_dim=128,
                                                        interpret=True).use_wgmma
