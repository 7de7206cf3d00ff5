"""A Pallas (Triton) `x @ w` for few rows, kept to reproduce a measured dead end (issue 11).

Each program streams a `[K / splits, bn]` slice of `w` in `bk`-row tiles (Triton pipelines the
loads `num_stages` deep) and keeps the `[M, bn]` float32 product in registers; with
`splits > 1`, float32 partials are summed by one XLA reduction, as split-K GEMMs do. On
H200 (jax 0.11.2; `benchmarks/gemm_options.py --pallas`, docs/performance-history.md, "Serving
speed" §14) its best tilings ran the e2e model's decode GEMMs 1.6-3x slower than XLA's own
Triton GEMMs, so the model does not use it. Only for GPU; `interpret=True` runs it anywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(x_ref, w_ref, o_ref, *, bk: int, steps: int):
  m, bn = x_ref.shape[0], w_ref.shape[1]
  base = pl.program_id(1) * (steps * bk)

  def body(i, acc):
    start = pl.multiple_of(base + i * bk, bk)
    return acc + jnp.dot(x_ref[:, pl.ds(start, bk)], w_ref[pl.ds(start, bk), :],
                         preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((m, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)[None]


@functools.partial(jax.jit, static_argnames=("bn", "bk", "splits", "num_warps", "num_stages",
                                             "interpret"))
def skinny_matmul(x, w, *, bn: int = 64, bk: int = 256, splits: int = 1, num_warps: int = 4,
                  num_stages: int = 4, interpret: bool = False):
  """`x @ w` in `x.dtype` (float32 accumulation); `M` a multiple of 16, `N` of `bn`, `K` of
  `splits * bk`."""
  m, k = x.shape
  if w.shape[0] != k:
    raise ValueError(f"x {x.shape} and w {w.shape} do not multiply")
  n = w.shape[1]
  if m % 16 or n % bn or k % (splits * bk):
    raise ValueError(f"M={m} must be a multiple of 16, N={n} of bn={bn}, K={k} of "
                     f"splits * bk = {splits * bk}")
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton   # pylint: disable=g-import-not-at-top
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  out = pl.pallas_call(
      functools.partial(_kernel, bk=bk, steps=k // (splits * bk)),
      out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
      grid=(n // bn, splits),
      in_specs=[pl.BlockSpec((m, k), lambda j, s: (0, 0)),
                pl.BlockSpec((k, bn), lambda j, s: (0, j))],
      out_specs=pl.BlockSpec((1, m, bn), lambda j, s: (s, 0, j)),
      compiler_params=params, interpret=interpret,
  )(x, w)
  return out[0] if splits == 1 else out.sum(axis=0).astype(x.dtype)


if __name__ == "__main__":   # a CPU check of the function (interpreter) against float64
  import numpy as np
  for m, k, n, bn, bk, splits in [(64, 512, 256, 64, 128, 1), (32, 1024, 128, 32, 256, 2)]:
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16) * 0.05
    got = np.asarray(skinny_matmul(x, w, bn=bn, bk=bk, splits=splits, interpret=True), np.float64)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    print(f"M={m} K={k} N={n} splits={splits}: rel err "
          f"{np.linalg.norm(got - ref) / np.linalg.norm(ref):.2e}")
