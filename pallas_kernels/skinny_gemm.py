"""A Mosaic GPU `x @ w` for few rows: the decode step's weight-streaming GEMMs (issue 11).

A decode step multiplies `[M, K]` activations (`M` = the step's tokens, 64 for 64 decoding
sequences) by each layer's weights; the step is weight reads. XLA's Triton split-K GEMMs move
the e2e model's o and down weights at 1.0-2.0 TB/s on H200 (8.7 and 16.6 us per layer); this
kernel moves them at 1.4-2.8 TB/s (5.9 and 12.0 us; docs/PERFORMANCE.md "Serving speed" §17).

The form is jax's own Hopper GEMMs' (`ragged_dot_mgpu`, `hopper_matmul_mgpu`: a TMA
pipeline, wgmma into a register accumulator), cut for few rows: one program per (`tile_n`
columns, K split, 64-row block); each streams its `[K / splits, tile_n]` slice of `w` and the
matching `[64, K / splits]` slice of `x` through an `emit_pipeline` of `stages` buffers
(`tile_k` rows per step) and stores a float32 partial; XLA sums the `splits` partials and
rounds once to `x.dtype` (as XLA's own split-K does). With `tma_add=True` each program adds its
partial into one zeroed float32 `[M, N]` by a TMA reduce-add store instead (no partials array;
the summation order then varies between runs; slower on H200, kept for the sweep).

`skinny_matmul(x, w)` is the entry a model uses: `M <= MAX_ROWS` (128) rows, padded to a
64- or 128-row block,
`default_tiling`'s tiling, `skinny_matmul_refusal` says why a shape is not served.
`skinny_matmul_mgpu` takes an explicit tiling (`benchmarks/gemm_options.py --mgpu` sweeps them).

`tests/pallas_kernels/test_skinny_gemm.py` runs it under the Mosaic GPU interpreter on CPU
and compiled on a Hopper GPU, against a float64 product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat

BLOCK_M = 64   # rows per program by default (one wgmma's M); `block_m=128` doubles it
# Rows `skinny_matmul` serves, padded to one row block: 64-row blocks up to 64 rows, 128-row
# blocks (each program streams its weight slice once for all rows) from 65 to 128. On H200
# the e2e model's o and down took 7.3 and 16.1 us at 128 rows against XLA's 11.8 and 18.5, the
# decode step of 128 sequences 2% less time (docs/PERFORMANCE.md "Serving speed" §18).
# Read at call time.
MAX_ROWS = 128
SMEM_BUDGET = 200 * 1024   # bytes of shared memory a tiling may stage
TILE_N = 64
TARGET_PROGRAMS = 128   # about one wave of the H200's 132 SMs
MAX_SPLITS = 16


def fits_smem(block_m: int, tile_n: int, tile_k: int, stages: int) -> bool:
  """Whether `stages` 16-bit `x`/`w` tiles and the float32 output staging tile fit in
  `SMEM_BUDGET`."""
  return (stages * (block_m * tile_k + tile_k * tile_n) * 2 + block_m * tile_n * 4
          <= SMEM_BUDGET)


def check(m: int, k: int, n: int, *, tile_n: int, tile_k: int, splits: int,
          block_m: int = BLOCK_M) -> None:
  """Raises ValueError unless the shapes split into whole tiles."""
  if (block_m not in (64, 128) or m % block_m or n % tile_n or tile_n % 64 or tile_k % 64
      or k % (splits * tile_k) or k // (splits * tile_k) < 2):
    raise ValueError(f"block_m={block_m} must be 64 or 128 and M={m} a multiple of it, "
                     f"N={n} of tile_n={tile_n} "
                     f"(a multiple of 64), K={k} of splits * tile_k = {splits} * {tile_k} "
                     "(tile_k a multiple of 64) with at least two K steps per split (a stage "
                     "is refilled one step late)")


# Lane semantics (as jaxkv's own kernels, proven on jax 0.11.2) need the operands' shared
# memory tiled and swizzled explicitly; warpgroup semantics infer it.
_LANE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _block_specs(*shapes_and_maps, delay_release: bool, **kwargs):
  """`(BlockSpecs, delayed)`: with `delay_release=1` where this jax has it and
  `delay_release` asks for it."""
  if delay_release:
    try:
      return [plgpu.BlockSpec(shape, index_map, delay_release=1, **kwargs)
              for shape, index_map in shapes_and_maps], True
    except TypeError:
      pass
  return [plgpu.BlockSpec(shape, index_map, **kwargs) for shape, index_map in shapes_and_maps], False


def _kernel(x_gmem, w_gmem, o_gmem, *, tile_n: int, tile_k: int, steps: int, stages: int,
            lane: bool, delay_release: bool, block_m: int):
  ni, si, mi = lax.axis_index("n"), lax.axis_index("split"), lax.axis_index("m")
  ks = pl.ds(si * (steps * tile_k), steps * tile_k)
  rows = pl.ds(mi * block_m, block_m)
  cols = pl.ds(ni * tile_n, tile_n)
  transforms = dict(transforms=_LANE_TRANSFORMS) if lane else {}

  def acc_scope(acc_ref):
    # delay_release=1: a stage is refilled one step after its wgmma was issued, so the
    # asynchronous wgmma never reads a buffer being overwritten. A jax without
    # `delay_release` gets a wgmma awaited in each step instead (slower, same result).
    specs, delayed = _block_specs(((block_m, tile_k), lambda s: (0, s)),
                                  ((tile_k, tile_n), lambda s: (s, 0)),
                                  delay_release=delay_release, **transforms)

    def step(_, x_smem, w_smem):
      plgpu.wgmma(acc_ref, x_smem, w_smem)
      if not delayed:
        plgpu.wgmma_wait(0)

    plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs,
                        max_concurrent_steps=stages)(x_gmem.at[rows, ks], w_gmem.at[ks, cols])
    return acc_ref[...]

  acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, tile_n), jnp.float32))

  # Lane semantics: the float32 staging tile in (8, 32)-tiled, 128-byte-swizzled rows, which
  # a WGMMA-layout store can fill without bank conflicts.
  o_transforms = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)) if lane else ()

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, tile_n), jnp.float32,
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
                                             "tma_add", "lane", "delay_release", "block_m",
                                             "interpret"))
def skinny_matmul_mgpu(x, w, *, tile_n: int = 64, tile_k: int = 64, splits: int = 4,
                       stages: int = 4, tma_add: bool = False, lane: bool = False,
                       delay_release: bool = True, block_m: int = BLOCK_M,
                       interpret: bool = False):
  """`x @ w` in `x.dtype` (float32 accumulation and partials); bf16 or fp16 operands.
  `lane`: lane lowering semantics with explicit shared-memory transforms instead of
  warpgroup semantics. `delay_release=False` awaits each step's wgmma (the path for a jax
  without `BlockSpec.delay_release`, taken there anyway)."""
  m, k = x.shape
  if w.shape[0] != k or w.dtype != x.dtype:
    raise ValueError(f"x {x.shape} {x.dtype} and w {w.shape} {w.dtype} do not multiply")
  n = w.shape[1]
  check(m, k, n, tile_n=tile_n, tile_k=tile_k, splits=splits, block_m=block_m)
  steps = k // (splits * tile_k)
  kernel = plgpu.kernel(
      functools.partial(_kernel, tile_n=tile_n, tile_k=tile_k, steps=steps,
                        stages=max(2, min(stages, steps)), lane=lane,
                        delay_release=delay_release, block_m=block_m),
      out_type=() if tma_add else jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
      grid=(n // tile_n, splits, m // block_m),
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


def default_tiling(k: int, n: int, m: int = BLOCK_M) -> dict | None:
  """The tiling `skinny_matmul` uses for `[m <= 128, K] @ [K, N]`, or None when none fits.

  One row block of 64 rows (`m <= 64`) or 128 (`m <= 128`); 64-column tiles; the K splits
  double until the programs fill about one wave of SMs (`TARGET_PROGRAMS`), each split
  keeping at least two `tile_k`-row steps; `tile_k` 128 where K allows, else 64; up to four
  stages within `SMEM_BUDGET`. On the e2e model's shapes at 64 rows this picks the sweep's
  fastest tilings for o (2048x2048: 4 splits of 4 x 128 rows) and down (8192x2048: 4 splits
  of 16 x 128).
  """
  if n % TILE_N:
    return None
  block_m = BLOCK_M if m <= BLOCK_M else 2 * BLOCK_M
  tiles = n // TILE_N
  for tile_k in (128, 64):
    fits = lambda s: k % (s * tile_k) == 0 and k // (s * tile_k) >= 2
    if not fits(1):
      continue
    splits = 1
    while tiles * splits < TARGET_PROGRAMS and splits < MAX_SPLITS and fits(2 * splits):
      splits *= 2
    stages = next(st for st in (4, 3, 2) if fits_smem(block_m, TILE_N, tile_k, st))
    tiling = dict(tile_n=TILE_N, tile_k=tile_k, splits=splits, stages=stages)
    return tiling if block_m == BLOCK_M else dict(tiling, block_m=block_m)
  return None


def skinny_matmul_refusal(m: int, k: int, n: int, dtype) -> str | None:
  """Why `skinny_matmul` does not serve `[m, k] @ [k, n]` in `dtype`, or None."""
  if not 1 <= m <= MAX_ROWS:
    return f"M={m} rows is outside 1..{MAX_ROWS}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
  if default_tiling(k, n, m) is None:
    return (f"N={n} is not a multiple of {TILE_N}, or K={k} does not split into two steps "
            "of 64 rows")
  return None


def skinny_matmul(x, w, *, interpret=False):
  """`x @ w` for `x [M <= MAX_ROWS, K]`, `w [K, N]` of one 16-bit dtype, in `x.dtype`
  (float32 accumulation), with `default_tiling`; rows are padded to the row block (64 or
  128) inside.

  Raises:
    ValueError: the operands do not multiply, or `skinny_matmul_refusal` names a reason.
  """
  if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1] or w.dtype != x.dtype:
    raise ValueError(f"x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must be [M, K] and "
                     "[K, N] of one dtype")
  (m, k), n = x.shape, w.shape[1]
  reason = skinny_matmul_refusal(m, k, n, x.dtype)
  if reason is not None:
    raise ValueError(f"skinny_matmul does not serve x {x.shape} @ w {w.shape}: {reason}")
  tiling = default_tiling(k, n, m)
  rows = tiling.get("block_m", BLOCK_M)
  padded = jnp.pad(x, ((0, rows - m), (0, 0))) if m < rows else x
  out = skinny_matmul_mgpu(padded, w, **tiling, interpret=interpret)
  return out[:m] if m < rows else out


def lowered_custom_calls(m: int, k: int, n: int, **tiling) -> list[str]:
  """The custom calls of one `skinny_matmul_mgpu`, lowered for CUDA on any machine."""
  import re   # pylint: disable=g-import-not-at-top
  shapes = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
  text = skinny_matmul_mgpu.trace(*shapes, **tiling).lower(
      lowering_platforms=("cuda",)).as_text()
  return re.findall(r"custom_call @(\w+)", text)
