"""The e2e model's decode GEMMs under XLA compiler options (issue 11: the decode step's matmuls).

A decode step of the e2e model (Llama-3.2-1B shapes: hidden 2,048, q/k/v 3,072 outputs,
MLP 8,192) multiplies `[M, 2048]` activations (`M` = the step's tokens, 64 in decode) by
each layer's weights. The device trace of that step (docs/performance-history.md, "Serving speed")
shows the q/k/v and output projections far below the copy ceiling (12.6 MB in 7.3 us and
8.4 MB in 6.8 us: 1.2-1.7 TB/s), while the MLP's larger GEMMs reach ~3 TB/s. This script
times the same GEMMs (each layer its own weights, so they stream from HBM, not L2: 16
layers of one shape per call) compiled with different XLA options (`jax.jit(...,
compiler_options=...)`, per compilation; `Engine(compiler_options=...)` passes them to its
loop), by GPU time per kernel from a device trace, with the copy ceiling measured in the
same process. Outputs are compared with the default compilation's (bf16 tolerance).

Isolated GEMMs are not the model: on H200 cuBLAS ran these GEMMs 11-30% faster than XLA's
Triton split-K GEMMs, yet the whole e2e step was 31% slower with Triton GEMMs off (the
GEMM fusions' fused producers and consumers became kernels of their own;
docs/performance-history.md, "Serving speed" §10). Check an option end to end
(`benchmarks/e2e.py --also-compiler-options`) before adopting it.

Usage (GPU machine): PYTHONPATH=. python3 benchmarks/gemm_options.py [--rows 64,128]
[--pallas] [--mgpu]
"""

from __future__ import annotations

import argparse
import sys
import os

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import decode as bench_decode   # pylint: disable=wrong-import-position
import kernel_trace   # pylint: disable=wrong-import-position
from skinny_gemm import skinny_matmul   # pylint: disable=wrong-import-position
from pallas_kernels import skinny_gemm   # pylint: disable=wrong-import-position
from pallas_kernels.skinny_gemm import default_tiling, skinny_matmul_mgpu   # pylint: disable=wrong-import-position
from pallas_kernels.skinny_gemm import skinny_matmul as mgpu_entry   # pylint: disable=wrong-import-position

LAYERS = 16
HIDDEN = 2048
SHAPES = {   # name: (in, out) of the e2e model's per-layer matmuls
    "q/k/v 2048x3072": (HIDDEN, 3072),
    "o 2048x2048": (HIDDEN, HIDDEN),
    "gate+up 2048x16384": (HIDDEN, 16384),
    "down 8192x2048": (8192, HIDDEN),
}
OPTIONS = {
    "default": {},
    "no triton gemm (cuBLAS)": {"xla_gpu_enable_triton_gemm": False},
    "cuBLASLt": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True},
    "exhaustive tiling search": {"xla_gpu_exhaustive_tiling_search": True},
}


def pallas_configs(k_in: int, n_out: int):
  """`skinny_gemm.skinny_matmul` tilings to time for one GEMM: 96..600 programs, whole tiles."""
  out = []
  for bn in (64, 128):
    for splits in (1, 2, 4, 8):
      if n_out % bn or not 96 <= n_out // bn * splits <= 600:
        continue
      for bk in (128, 256):
        if k_in % (splits * bk) == 0:
          out.extend(dict(bn=bn, bk=bk, splits=splits, num_stages=st) for st in (3, 5))
  return out


def mgpu_configs(k_in: int, n_out: int, quick: bool = False):
  """`pallas_kernels.skinny_gemm.skinny_matmul_mgpu` tilings to time for one GEMM: whole tiles, 128..600
  programs (1-4.5 waves of 132 SMs), a 4-deep pipeline within ~200 KB of shared memory, split-K
  partials summed by XLA or added in by TMA. `quick`: 64 x 128 tiles over 128..256 programs
  only, each in both lowering semantics (warpgroup and lane)."""
  out = []
  for tile_n in (64,) if quick else (64, 128):
    for tile_k in (128,) if quick else (64, 128):
      for splits in (1, 2, 4, 8, 16):
        programs = n_out // tile_n * splits
        if n_out % tile_n or k_in % (splits * tile_k) or not 128 <= programs <= (
            256 if quick else 600):
          continue
        stages = min(4, k_in // (splits * tile_k))
        if stages < 2 or not skinny_gemm.fits_smem(64, tile_n, tile_k, stages):
          continue
        for tma_add in (False, True) if splits > 1 else (False,):
          for lane in (False, True) if quick else (False,):
            out.append(dict(tile_n=tile_n, tile_k=tile_k, splits=splits, stages=stages,
                            tma_add=tma_add, lane=lane))
  return out


def _copy_ceiling() -> str:
  """The copy ceiling: a device-to-device copy (torch's) where torch has CUDA, else a traced JAX
  elementwise pass; a trace that caught no kernel (another process profiling) is said, not divided by."""
  d2d = bench_decode.torch_d2d_copy_bytes_per_s(1 << 30)   # 2 GiB, far above L2
  if d2d is not None:
    return f"{d2d / 1e12:.2f} TB/s (torch d2d, read + write)"
  x = jnp.ones((1 << 28,), jnp.bfloat16)
  busy, _ = kernel_trace.trace_kernels(jax.jit(lambda a: a + jnp.bfloat16(1)), (x,), 10)
  if not busy:
    return "unknown (the trace caught no kernel)"
  return f"{2 * x.size * 2 / (busy * 1e-6) / 1e12:.2f} TB/s (jax elementwise, read + write)"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", default="64,128", help="comma-separated M (tokens per step)")
  p.add_argument("--calls", type=int, default=10)
  p.add_argument("--pallas", action="store_true",
                 help="also time benchmarks/skinny_gemm.py's Pallas (Triton) GEMM over a sweep "
                 "of tilings (checked against a float32 product)")
  p.add_argument("--default-only", action="store_true",
                 help="time XLA's default compilation only (no other compiler options)")
  p.add_argument("--quick", action="store_true",
                 help="with --mgpu: 64 x 128 tiles over 128-256 programs only, in both "
                 "lowering semantics (warpgroup and lane)")
  p.add_argument("--shapes", default=None,
                 help="comma-separated GEMM names to time (the first word of each: q/k/v, o, "
                 "gate+up, down; default all)")
  p.add_argument("--mgpu-entry", action="store_true",
                 help="also time pallas_kernels.skinny_matmul, the models' decode GEMM, with its "
                 "default tiling at each row count it serves (<= skinny_gemm.MAX_ROWS; rows padded to the "
                 "row block)")
  p.add_argument("--mgpu", action="store_true",
                 help="also time pallas_kernels/skinny_gemm.py's Mosaic GPU GEMM over a sweep "
                 "of tilings (checked against a float32 product)")
  p.add_argument("--small", action="store_true",
                 help="one GEMM (o) at 8 rows, XLA's default compilation, one traced call: a "
                 "smoke test of the script, not a measurement")
  args = p.parse_args(argv)
  if args.small:
    args.rows, args.shapes, args.default_only, args.calls = "8", "o", True, 1
  print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; copy ceiling "
        f"{_copy_ceiling()}")
  key = jax.random.key(0)
  wanted = None if args.shapes is None else set(args.shapes.split(","))
  for name, (k_in, n_out) in SHAPES.items():
    if wanted is not None and name.split()[0] not in wanted:
      continue
    ws = jax.random.normal(key, (LAYERS, k_in, n_out), jnp.bfloat16) * 0.02
    for m in (int(r) for r in args.rows.split(",")):
      # One dot per layer, each with its own weights and activations (a Python loop: 16
      # GEMM launches; dots sharing an operand would be merged into one by XLA).
      x = jax.random.normal(jax.random.key(m), (LAYERS, m, k_in), jnp.bfloat16)
      fn = lambda x, ws: [x[i] @ ws[i] for i in range(LAYERS)]
      want = None
      for oname, options in list(OPTIONS.items())[:1 if args.default_only else None]:
        try:
          jitted = jax.jit(fn, compiler_options=options or None)
          out = jitted(x, ws)
          busy, kernels = kernel_trace.trace_kernels(jitted, (x, ws), args.calls)
          got = np.asarray(jnp.stack(out).astype(jnp.float32))
          if want is None:
            want = got
          err = float(np.max(np.abs(got - want)))
          per = busy / LAYERS
          tbs = k_in * n_out * 2 / (per * 1e-6) / 1e12
          top = ", ".join(f"{k[:40]} {us / LAYERS:.2f}us" for k, (us, _) in
                          list(kernels.items())[:2])
          print(f"{name:20} M={m:<5} {oname:26} {per:7.2f} us/GEMM  {tbs:5.2f} TB/s weights  "
                f"max|diff| {err:.3g}  [{top}]")
        except Exception as e:  # pylint: disable=broad-except
          print(f"{name:20} M={m:<5} {oname:26} {type(e).__name__}: {str(e)[:160]}")
      if args.pallas:
        _time_pallas(name, m, k_in, n_out, x, ws, args.calls, skinny_matmul,
                     pallas_configs(k_in, n_out), "pallas bn{bn} bk{bk} s{splits} st{num_stages}")
      if args.mgpu_entry and m <= skinny_gemm.MAX_ROWS:
        _time_pallas(name, m, k_in, n_out, x, ws, args.calls, mgpu_entry, [{}],
                     "mgpu entry " + _braces(default_tiling(k_in, n_out, m)))
      if args.mgpu and m % 64 == 0:
        _time_pallas(name, m, k_in, n_out, x, ws, args.calls, skinny_matmul_mgpu,
                     mgpu_configs(k_in, n_out, quick=args.quick),
                     "mgpu n{tile_n} k{tile_k} s{splits} st{stages} tma_add={tma_add} lane={lane}")
  return 0


def _braces(value) -> str:
  """`str(value)` safe as a `str.format` template (its braces doubled)."""
  return str(value).replace("{", "{{").replace("}", "}}")


def _time_pallas(name, m, k_in, n_out, x, ws, calls, matmul, configs, label_format):
  """Each tiling of one GEMM by a Pallas `matmul`: GPU time per layer (the split-K
  partials' sum included), error against a float32 product, the best one."""
  ref = np.einsum("lmk,lkn->lmn", np.asarray(x, np.float32), np.asarray(ws, np.float32))
  best = None
  for cfg in configs:
    label = label_format.format(**cfg)
    try:
      jitted = jax.jit(lambda x, ws, cfg=cfg: [matmul(x[i], ws[i], **cfg)
                                                for i in range(LAYERS)])
      got = np.asarray(jnp.stack(jitted(x, ws)).astype(jnp.float32))
      rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
      busy, _ = kernel_trace.trace_kernels(jitted, (x, ws), calls)
      per = busy / LAYERS
      tbs = k_in * n_out * 2 / (per * 1e-6) / 1e12
      print(f"{name:20} M={m:<5} {label:26} {per:7.2f} us/GEMM  {tbs:5.2f} TB/s weights  "
            f"rel err {rel:.2e}{'' if rel < 1e-2 else '  WRONG'}")
      if rel < 1e-2 and (best is None or per < best[0]):
        best = (per, label)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name:20} M={m:<5} {label:26} {type(e).__name__}: {str(e)[:160]}")
  if best:
    print(f"{name:20} M={m:<5} best: {best[1]} {best[0]:.2f} us/GEMM")


if __name__ == "__main__":
  sys.exit(main())
