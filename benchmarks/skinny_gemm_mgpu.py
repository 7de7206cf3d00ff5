"""A Mosaic GPU `x @ w` for few rows (decode GEMMs), to time against XLA's (issue 11).

The e2e model's decode step multiplies `[64, K]` activations by each layer's weights, and
XLA's Triton split-K GEMMs move those weights at 1.5-2.9 TB/s (q/k/v 7.3 us, o 5.8, gate+up
23.1, down 12.2, plus split-K reductions; docs/PERFORMANCE.md "Serving speed" §14), which
alone exceeds the decode-step target. A Pallas Triton GEMM (`skinny_gemm.py`) was 1.6-3x
slower. This is the Mosaic GPU form jax's own Hopper kernels take (`ragged_dot_mgpu`,
`hopper_matmul_mgpu`: TMA pipeline, wgmma into a register accumulator), cut for few rows:
one program per (`tile_n` columns, K split, 64-row block); each streams its `[K / splits,
tile_n]` slice of `w` and the matching `[64, K / splits]` slice of `x` through an
`emit_pipeline` of `stages` buffers (`tile_k` rows per step) and stores a float32
partial; with `splits > 1` XLA sums the partials (a fusion a model would fold into the
residual add, as it does for XLA's own split-K), or, with `tma_add=True`, each program adds
its partial into one zeroed float32 `[M, N]` by a TMA reduce-add store (no partials array,
no reduction kernel; the summation order then varies between runs).

On CPU, `PYTHONPATH=. python3 benchmarks/skinny_gemm_mgpu.py` runs small tilings under the
Mosaic GPU interpreter (races and out-of-bounds reads raise) against a float64 product
(`tma_add` only lowers: the interpreter has no TMA reductions) and lowers the e2e model's
shapes for CUDA. `benchmarks/gemm_options.py --mgpu` times it on the
GPU beside XLA's GEMMs, each result checked against a float32 product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat

BLOCK_M = 64   # one warpgroup's wgmma rows


def check(m: int, k: int, n: int, *, tile_n: int, tile_k: int, splits: int) -> None:
  """Raises ValueError unless the shapes split into whole tiles."""
  if (m % BLOCK_M or n % tile_n or tile_n % 64 or tile_k % 64 or k % (splits * tile_k)
      or k // (splits * tile_k) < 2):
    raise ValueError(f"M={m} must be a multiple of {BLOCK_M}, N={n} of tile_n={tile_n} "
                     f"(a multiple of 64), K={k} of splits * tile_k = {splits} * {tile_k} "
                     "(tile_k a multiple of 64) with at least two K steps per split (a stage "
                     "is refilled one step late)")


# Lane semantics (as jaxkv's own kernels, proven on jax 0.11.2) need the operands' shared
# memory tiled and swizzled explicitly; warpgroup semantics infer it.
_LANE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


DELAY_RELEASE = True   # False: await each step's wgmma (the path for a jax without it)


def _block_specs(*shapes_and_maps, **kwargs):
  """`(BlockSpecs, delayed)`: with `delay_release=1` where this jax has it and
  `DELAY_RELEASE` is on."""
  if DELAY_RELEASE:
    try:
      return [plgpu.BlockSpec(shape, index_map, delay_release=1, **kwargs)
              for shape, index_map in shapes_and_maps], True
    except TypeError:
      pass
  return [plgpu.BlockSpec(shape, index_map, **kwargs) for shape, index_map in shapes_and_maps], False


def _kernel(x_gmem, w_gmem, o_gmem, *, tile_n: int, tile_k: int, steps: int, stages: int,
            lane: bool):
  ni, si, mi = lax.axis_index("n"), lax.axis_index("split"), lax.axis_index("m")
  ks = pl.ds(si * (steps * tile_k), steps * tile_k)
  rows = pl.ds(mi * BLOCK_M, BLOCK_M)
  cols = pl.ds(ni * tile_n, tile_n)
  transforms = dict(transforms=_LANE_TRANSFORMS) if lane else {}

  def acc_scope(acc_ref):
    # delay_release=1: a stage is refilled one step after its wgmma was issued, so the
    # asynchronous wgmma never reads a buffer being overwritten. A jax without
    # `delay_release` gets a wgmma awaited in each step instead (slower, same result).
    specs, delayed = _block_specs(((BLOCK_M, tile_k), lambda s: (0, s)),
                                  ((tile_k, tile_n), lambda s: (s, 0)), **transforms)

    def step(_, x_smem, w_smem):
      plgpu.wgmma(acc_ref, x_smem, w_smem)
      if not delayed:
        plgpu.wgmma_wait(0)

    plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs,
                        max_concurrent_steps=stages)(x_gmem.at[rows, ks], w_gmem.at[ks, cols])
    return acc_ref[...]

  acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_M, tile_n), jnp.float32))

  # Lane semantics: the float32 staging tile in (8, 32)-tiled, 128-byte-swizzled rows, which
  # a WGMMA-layout store can fill without bank conflicts.
  o_transforms = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)) if lane else ()

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((BLOCK_M, tile_n), jnp.float32,
                                                      transforms=o_transforms))
  def _store(o_smem):
    o_smem[...] = acc
    plgpu.commit_smem()
    if o_gmem.ndim == 2:   # one float32 sum: TMA adds each split's partial in
      plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols], reduction_op="add")
    else:
      plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, rows, cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("tile_n", "tile_k", "splits", "stages",
                                             "tma_add", "lane", "interpret"))
def skinny_matmul_mgpu(x, w, *, tile_n: int = 64, tile_k: int = 64, splits: int = 4,
                       stages: int = 4, tma_add: bool = False, lane: bool = False,
                       interpret: bool = False):
  """`x @ w` in `x.dtype` (float32 accumulation and partials); bf16 or fp16 operands.
  `lane`: lane lowering semantics with explicit shared-memory transforms instead of
  warpgroup semantics."""
  m, k = x.shape
  if w.shape[0] != k or w.dtype != x.dtype:
    raise ValueError(f"x {x.shape} {x.dtype} and w {w.shape} {w.dtype} do not multiply")
  n = w.shape[1]
  check(m, k, n, tile_n=tile_n, tile_k=tile_k, splits=splits)
  steps = k // (splits * tile_k)
  kernel = plgpu.kernel(
      functools.partial(_kernel, tile_n=tile_n, tile_k=tile_k, steps=steps,
                        stages=max(2, min(stages, steps)), lane=lane),
      out_type=() if tma_add else jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
      grid=(n // tile_n, splits, m // BLOCK_M),
      grid_names=("n", "split", "m"),
      # Lane is the default semantics: named only for warpgroup, so the lane form needs
      # nothing a jax without `LoweringSemantics` lacks.
      compiler_params=plgpu.CompilerParams() if lane else plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_compat.resolve_interpret(interpret),
  )
  if tma_add:
    total = jax.new_ref(jnp.zeros((m, n), jnp.float32), memory_space=plgpu.GMEM)
    kernel(x, w, total)
    return jax.freeze(total).astype(x.dtype)
  return kernel(x, w).sum(axis=0).astype(x.dtype)


def lowered_custom_calls(m: int, k: int, n: int, **tiling) -> list[str]:
  """The custom calls of one `skinny_matmul_mgpu`, lowered for CUDA on any machine."""
  import re   # pylint: disable=g-import-not-at-top
  shapes = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
  text = skinny_matmul_mgpu.trace(*shapes, **tiling).lower(
      lowering_platforms=("cuda",)).as_text()
  return re.findall(r"custom_call @(\w+)", text)


def _check_interpreted(m: int, k: int, n: int, label: str = "", **tiling) -> None:
  """One tiling under the Mosaic GPU interpreter against a float64 product (CPU)."""
  import numpy as np   # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.key(m + k), (m, k), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(n), (k, n), jnp.bfloat16) * 0.05
  got = np.asarray(skinny_matmul_mgpu(x, w, **tiling, interpret=True), np.float64)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  print(f"interpreter{label} M={m} K={k} N={n} {tiling}: rel err {rel:.2e}")
  assert rel < 1e-2, rel


if __name__ == "__main__":
  for m, k, n, tiling in [(64, 512, 128, dict(tile_n=64, tile_k=64, splits=2, stages=3)),
                          (128, 256, 128, dict(tile_n=128, tile_k=128, splits=1)),
                          (64, 1024, 64, dict(tile_n=64, tile_k=128, splits=4, stages=2)),
                          (64, 512, 128, dict(tile_n=64, tile_k=128, splits=2, lane=True))]:
    _check_interpreted(m, k, n, **tiling)
  DELAY_RELEASE = False   # the path for a jax without delay_release, both semantics
  jax.clear_caches()      # the switch is read when traced
  for lane in (False, True):
    _check_interpreted(64, 512, 128, ", each wgmma awaited,", tile_n=64, tile_k=64, splits=2,
                       lane=lane)
  DELAY_RELEASE = True
  jax.clear_caches()
  for (k_in, n_out), tiling in [((2048, 3072), dict(tile_n=64, tile_k=64, splits=4)),
                                ((8192, 2048), dict(tile_n=128, tile_k=128, splits=8, stages=3)),
                                ((2048, 2048), dict(tile_n=64, tile_k=64, splits=8, tma_add=True)),
                                ((2048, 3072), dict(tile_n=64, tile_k=128, splits=4, lane=True)),
                                ((8192, 2048), dict(tile_n=128, tile_k=64, splits=8, lane=True,
                                                    tma_add=True))]:
    calls = lowered_custom_calls(64, k_in, n_out, **tiling)
    print(f"lowered for CUDA M=64 K={k_in} N={n_out} {tiling}: {calls}")
    assert len(calls) == 1 and calls[0].startswith("mosaic_gpu"), calls
