"""`pallas_kernels.skinny_gemm`: the decode GEMM against a float64 product.

Under the Mosaic GPU interpreter on CPU (races and out-of-bounds reads raise, fresh shared
memory is NaN, so a partial read before it is written poisons the result), lowered for CUDA
on CPU, and compiled on a Hopper GPU (skipped elsewhere). The oracle is NumPy's float64
product; each output may differ from it by the float32 accumulation (tiny) plus one
rounding to the 16-bit output dtype.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import skinny_gemm
from pallas_kernels.skinny_gemm import (default_tiling, lowered_custom_calls, skinny_matmul,
                                        skinny_matmul_mgpu, skinny_matmul_refusal)

from attention_checks import requires_hopper


def _operands(m, k, n, dtype, seed=0):
  x = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(jax.random.key(seed + 1), (k, n), jnp.float32) * 0.05).astype(dtype)
  return x, w


def _assert_product(got, x, w):
  """`got` equals float64 `x @ w` up to one rounding to `got.dtype` (plus float32 sums)."""
  assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[1])
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all()
  eps = float(ml_dtypes.finfo(x.dtype).eps)
  # One rounding (eps / 2 relative) plus float32 accumulation over K terms of |x||w|.
  bound = eps / 2 * np.abs(ref) + 1e-6 * (np.abs(np.asarray(x, np.float64))
                                          @ np.abs(np.asarray(w, np.float64)))
  worst = float(np.max(np.abs(got - ref) - bound))
  assert worst <= 0, f"max excess over the rounding bound {worst:.3g}"


# (m, k, n, tiling): split-K 1/2/4, both tile_k, both lowering semantics, a 3-stage ring
# shorter than the K steps (stages refilled), two 64-row blocks, the awaited-wgmma path, and
# 128-row blocks (one and two).
TILINGS = [
    (64, 512, 128, dict(tile_n=64, tile_k=64, splits=2, stages=3)),
    (128, 256, 128, dict(tile_n=128, tile_k=128, splits=1)),
    (64, 1024, 64, dict(tile_n=64, tile_k=128, splits=4, stages=2)),
    (64, 512, 128, dict(tile_n=64, tile_k=128, splits=2, lane=True)),
    (64, 512, 128, dict(tile_n=64, tile_k=64, splits=2, delay_release=False)),
    (64, 512, 128, dict(tile_n=64, tile_k=64, splits=2, lane=True, delay_release=False)),
    (128, 512, 128, dict(tile_n=64, tile_k=128, splits=2, stages=3, block_m=128)),
    (256, 512, 64, dict(tile_n=64, tile_k=64, splits=2, block_m=128, lane=True)),
]


@pytest.mark.parametrize("m,k,n,tiling", TILINGS, ids=lambda v: str(v))
def test_interpreted_tilings_match_float64(m, k, n, tiling):
  x, w = _operands(m, k, n, jnp.bfloat16, seed=m + k + n)
  _assert_product(skinny_matmul_mgpu(x, w, **tiling, interpret=True), x, w)


@pytest.mark.parametrize("m", [1, 17, 64, 65, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpreted_entry_pads_rows_and_matches_float64(m, dtype):
  x, w = _operands(m, 512, 192, dtype, seed=m)
  _assert_product(skinny_matmul(x, w, interpret=True), x, w)


def test_default_tiling_fits_every_shape_it_accepts():
  for k, n, m in itertools.product([64, 128, 192, 256, 512, 2048, 3072, 8192, 14336],
                                   [32, 64, 128, 192, 2048, 3072, 4096], [1, 64, 65, 128]):
    tiling = default_tiling(k, n, m)
    if n % 64 or k < 128:
      assert tiling is None, (k, n)
      continue
    assert tiling is not None, (k, n)
    block_m = tiling.get("block_m", 64)
    assert block_m == (64 if m <= 64 else 128)
    skinny_gemm.check(block_m, k, n, tile_n=tiling["tile_n"], tile_k=tiling["tile_k"],
                      splits=tiling["splits"], block_m=block_m)
    staged = (tiling["stages"] * (block_m + tiling["tile_n"]) * tiling["tile_k"] * 2
              + block_m * tiling["tile_n"] * 4)
    assert 2 <= tiling["stages"] <= 4 and staged <= skinny_gemm.SMEM_BUDGET, (k, n, m, tiling)
    programs = n // tiling["tile_n"] * tiling["splits"]
    # Splits double to about one wave of SMs unless K runs out of two-step splits first.
    can_double = (tiling["splits"] < skinny_gemm.MAX_SPLITS
                  and k % (2 * tiling["splits"] * tiling["tile_k"]) == 0
                  and k // (2 * tiling["splits"] * tiling["tile_k"]) >= 2)
    assert programs >= skinny_gemm.TARGET_PROGRAMS or not can_double, (k, n, tiling)
    assert programs < 2 * skinny_gemm.TARGET_PROGRAMS or tiling["splits"] == 1, (k, n, tiling)


def test_default_tiling_picks_the_swept_fastest_for_the_e2e_model():
  # `gemm_options.py --rows 64 --mgpu` on H200 (docs/PERFORMANCE.md "Serving speed" §17).
  assert default_tiling(2048, 2048) == dict(tile_n=64, tile_k=128, splits=4, stages=4)
  assert default_tiling(8192, 2048) == dict(tile_n=64, tile_k=128, splits=4, stages=4)


@pytest.mark.parametrize("m,k,n,dtype,word", [
    (0, 512, 128, jnp.bfloat16, "M=0"),
    (129, 512, 128, jnp.bfloat16, "M=129"),
    (64, 512, 128, jnp.float32, "float32"),
    (64, 512, 96, jnp.bfloat16, "N=96"),
    (64, 64, 128, jnp.bfloat16, "K=64"),
])
def test_refuses_shapes_it_does_not_serve_by_name(m, k, n, dtype, word):
  reason = skinny_matmul_refusal(m, k, n, dtype)
  assert reason is not None and word in reason
  x = jnp.zeros((m, k), dtype)
  w = jnp.zeros((k, n), dtype)
  with pytest.raises(ValueError, match=word):
    skinny_matmul(x, w, interpret=True)


def test_refuses_operands_that_do_not_multiply():
  with pytest.raises(ValueError, match="must be"):
    skinny_matmul(jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((128, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match="must be"):
    skinny_matmul(jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((256, 64), jnp.float16))


@pytest.mark.parametrize("m", [64, 128])
@pytest.mark.parametrize("k,n", [(2048, 2048), (8192, 2048), (4096, 4096), (14336, 4096)])
def test_default_tilings_lower_for_cuda(k, n, m):
  calls = lowered_custom_calls(m, k, n, **default_tiling(k, n, m))
  assert len(calls) == 1 and calls[0].startswith("mosaic_gpu"), calls


@requires_hopper
@pytest.mark.parametrize("m", [1, 17, 64, 100, 128])
@pytest.mark.parametrize("k,n", [(2048, 2048), (8192, 2048), (4096, 4096), (14336, 4096)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_compiled_entry_matches_float64(m, k, n, dtype):
  x, w = _operands(m, k, n, dtype, seed=k + n + m)
  _assert_product(jax.jit(skinny_matmul)(x, w), x, w)
