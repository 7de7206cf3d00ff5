"""The Mosaic GPU in-place write kernel against its reference (CONTRACT §10.6, §10.7)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drivers import has_hopper_gpu
from kernel_cases import Family
from kernel_cases import random_step
import pallas_kernels
from pallas_kernels import config as config_lib
from pallas_kernels import kv_write_sm90

# (family, new K/V dtype); each family runs `num_steps` random steps.
CASES = [
    (Family("bf16-ring5-k2-d64", jnp.bfloat16, 5, 8, 2, 64, width=6, max_seqs=3, capacity=40,
            num_steps=9), jnp.float32),
    (Family("fp16-flat-k2-d128", jnp.float16, None, 8, 2, 128, width=8, max_seqs=3,
            capacity=32, num_steps=9), jnp.float16),
    (Family("f32-ring3-k4-d64", jnp.float32, 3, 4, 4, 64, width=4, max_seqs=4, capacity=30,
            num_steps=9), jnp.bfloat16),
    (Family("bf16-flat-k1-d8", jnp.bfloat16, None, 2, 1, 8, width=5, max_seqs=2, capacity=16,
            num_steps=9), jnp.bfloat16),
]
IMPLEMENTATIONS = [
    "interpret",
    pytest.param("mosaic_gpu", marks=pytest.mark.skipif(
        not has_hopper_gpu(), reason="needs an NVIDIA Hopper GPU (compute capability >= "
        "9.0) to compile and run the Mosaic GPU kernel")),
]


@jax.jit
def _reference(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens):
  return pallas_kernels.kv_write_reference(k_cache, v_cache, k_new, v_new, seq_cols, rows,
                                           n_tokens)


def _poisoned_cache(rng, family):
  shape = (family.num_rows, family.max_seqs + 1, family.num_kv_heads, family.head_dim)
  cache = rng.standard_normal(shape).astype(np.float32)
  cache[rng.random(shape[:2]) < 0.3] = np.nan   # untouched cells must stay NaN bitwise
  return jnp.asarray(cache, family.dtype)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: str(case[0]))
def test_kernel_matches_reference(case, implementation, rng):
  family, new_dtype = case
  interpret = implementation == "interpret"
  for index in range(family.num_steps):
    step = random_step(rng, family, pad=index % 3 != 0, allow_blocks=index % 2 == 0)
    shape = (family.width, family.num_kv_heads, family.head_dim)
    new = rng.standard_normal((2,) + shape).astype(np.float32)
    new[:, step.n_tokens:] = np.nan   # padding tokens must never be written
    args = (_poisoned_cache(rng, family), _poisoned_cache(rng, family),
            jnp.asarray(new[0], new_dtype), jnp.asarray(new[1], new_dtype),
            jnp.asarray(step.seq_cols), jnp.asarray(step.rows), jnp.int32(step.n_tokens))
    want = _reference(*args)
    got = pallas_kernels.kv_write(*args, interpret=interpret)
    again = pallas_kernels.kv_write(*args, interpret=interpret)
    for g, a, w in zip(got, again, want):
      assert g.dtype == w.dtype and g.shape == w.shape
      # Storage equal bitwise, NaN included; the scratch column is unspecified.
      g, a, w = (np.asarray(x[:, :family.max_seqs], np.float32) for x in (g, a, w))
      np.testing.assert_array_equal(g, w, err_msg=step.description)
      np.testing.assert_array_equal(g, a, err_msg=step.description)


def _lowered_step(donate, rows=64):
  shapes = (jax.ShapeDtypeStruct((rows, 9, 8, 128), jnp.bfloat16),) * 2 + (
      jax.ShapeDtypeStruct((16, 8, 128), jnp.bfloat16),) * 2 + (
          jax.ShapeDtypeStruct((16,), jnp.int32),) * 2 + (jax.ShapeDtypeStruct((), jnp.int32),)
  step = jax.jit(pallas_kernels.kv_write, donate_argnums=(0, 1) if donate else ())
  return step.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_kernel_lowers_to_an_aliasing_mosaic_gpu_call():
  text = _lowered_step(donate=True)
  calls = re.findall(r"custom_call @(\w+)", text)
  assert calls == ["mosaic_gpu_v2"]
  call = next(line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line)
  assert "output_operand_aliases" in call
  entry = next(line for line in text.splitlines() if "func.func public @main" in line)
  # With the caches donated, both entry parameters alias the two results.
  assert re.findall(r"%arg(\d+): tensor<64x9x8x128xbf16> \{tf.aliasing_output = (\d+)", entry
                    ) == [("0", "0"), ("1", "1")]


@pytest.mark.parametrize("rows", [1, 5, 11, 575])
def test_kernel_lowers_for_unaligned_and_tiny_row_counts(rows):
  # A token's row is a squeezed index of an untiled TMA box: any row count works
  # (the CASES above run rings of 6 and 10 rows).
  text = _lowered_step(donate=True, rows=rows)
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]
  assert kv_write_sm90.static_check(jax.ShapeDtypeStruct((rows, 9, 8, 128), jnp.bfloat16),
                                    block_heads=8) is None


def test_undonated_caches_are_not_aliased_at_entry():
  entry = next(line for line in _lowered_step(donate=False).splitlines()
               if "func.func public @main" in line)
  assert "tf.aliasing_output" not in entry


@pytest.mark.parametrize("shape, dtype, block_heads, match", [
    ((8, 3, 2, 4), jnp.bfloat16, 2, "multiple of 16 bytes"),
    ((8, 3, 2, 512), jnp.bfloat16, 2, "at most 256"),
    ((8, 3, 4, 64), jnp.bfloat16, 3, "must divide num_kv_heads=4"),
    ((8, 3, 2, 64), jnp.int8, 2, "kv dtype int8"),
], ids=["d4", "d512", "heads", "int8"])
def test_kernel_refuses_what_tma_cannot_move(shape, dtype, block_heads, match):
  with pytest.raises(NotImplementedError, match=match):
    kv_write_sm90.static_check(jax.ShapeDtypeStruct(shape, dtype), block_heads=block_heads)


def test_config_validation():
  with pytest.raises(ValueError, match=re.escape("block_heads=-1 must be an int >= 0")):
    config_lib.KvWriteConfig(block_heads=-1)
  assert functools.reduce(lambda a, b: a and b, [
      config_lib.KvWriteConfig() == config_lib.KvWriteConfig(),
      hash(config_lib.KvWriteConfig(2)) == hash(config_lib.KvWriteConfig(2))])
