"""What one launch costs inside the serving loop: an XLA fusion against a Mosaic GPU call.

An experiment for issue 11. A decode step of the e2e model is ~300 launches and
costs ~1.9 ms, the padded cuDNN step 207 launches and 1.35 ms: about 6.5 us per
launch either way, far above what those small kernels compute. Replacing five
XLA launches of the attention epilogue by one Mosaic GPU kernel (`combine_sm90`)
did not shorten the step, which would follow if a Mosaic GPU call cost several
XLA launches. This script measures it: a jitted `fori_loop` (known trip count:
no host sync per iteration) whose body is `n` tiny XLA fusions (kept apart by
`optimization_barrier`) or `n` tiny Mosaic GPU kernels (one TMA in, one add, one
TMA out, like the library's kernels), timed per iteration after a warm-up.
A second table prices a host round trip per iteration: the same loop with a
traced trip count (its condition is copied to the host every iteration, as in
the serving loop's `while_loop`s), and with a `lax.cond` in the body too.

Usage (GPU machine, repository root): PYTHONPATH=. python3 benchmarks/launch_cost.py
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

N = 256   # float32 elements each launch reads and writes (one TMA box)


def _mosaic_add_one(x):
  def kernel(x_ref, o_ref, smem, bar):
    plgpu.copy_gmem_to_smem(x_ref, smem, bar)
    plgpu.barrier_wait(bar)
    smem[...] = smem[...] + 1.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      scratch_types=[plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier()])(x)


def _xla_add_one(x):
  return jax.lax.optimization_barrier(x + 1.0)


@functools.partial(jax.jit, static_argnames=("kind", "n", "iters", "sync"))
def _loop(x, bound, *, kind, n, iters, sync="none"):
  """`iters` iterations of `n` launches; `sync` adds host round trips per iteration.

  sync: "none" (a static trip count: XLA launches iteration after iteration
  without reading anything back), "while" (the trip count is the traced
  `bound`, so every iteration's condition is copied to the host first: the
  serving loop's phase loops), or "while+cond" (also a `lax.cond` on a traced
  predicate in the body, whose predicate is another copy: the sampler's cond).
  """
  op = _mosaic_add_one if kind == "mosaic" else _xla_add_one

  def body(_, x):
    for _ in range(n):
      x = op(x)
    if sync == "while+cond":
      x = jax.lax.cond(x[0] >= 0, lambda x: x + 0.0, lambda x: x - 1.0, x)
    return x

  return jax.lax.fori_loop(0, iters if sync == "none" else bound, body, x)


def _us_per_iter(kind, n, iters, repeats=5, sync="none"):
  x = jnp.zeros((N,), jnp.float32)
  bound = jnp.int32(iters)
  run = lambda: _loop(x, bound, kind=kind, n=n, iters=iters, sync=sync)
  out = jax.block_until_ready(run())                                   # compile + warm-up
  assert float(out[0]) == n * iters, (kind, n, float(out[0]))          # every launch ran
  best = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    best.append(time.perf_counter() - start)
  return 1e6 * sum(best) / len(best) / iters


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--iters", type=int, default=2000)
  args = p.parse_args(argv)
  print(f"device {jax.devices()[0].device_kind}; {args.iters} loop iterations, mean of 5 runs")
  print("| body | us per iteration | us per launch (slope over n) |")
  print("|---|---|---|")
  for kind in ("xla", "mosaic"):
    times = {n: _us_per_iter(kind, n, args.iters) for n in (1, 4, 16)}
    slope = (times[16] - times[1]) / 15
    for n, t in times.items():
      print(f"| {n} x {kind} | {t:.2f} | {slope:.2f} |" if n == 16 else
            f"| {n} x {kind} | {t:.2f} | |")
  # What a host round trip per iteration costs: the same body with a traced trip
  # count (the condition read back every iteration), and with a lax.cond as well.
  print("\n| body (16 x xla) | us per iteration | extra over a static trip count |")
  print("|---|---|---|")
  base = _us_per_iter("xla", 16, args.iters)
  for sync in ("none", "while", "while+cond"):
    t = base if sync == "none" else _us_per_iter("xla", 16, args.iters, sync=sync)
    print(f"| {sync} | {t:.2f} | {t - base:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
