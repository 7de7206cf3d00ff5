"""A minimal reproduction of the square-tile miscompute outside jaxkv (issue 12 item 5).

jaxkv's attention kernel computed wrong results with K/V tiles of `head_dim` rows
until it reloaded q into registers for every tile (`varlen_kernel_sm90._stream_tiles`).
This script asks whether plain Mosaic GPU does the same, with none of jaxkv's code: one
warpgroup, q `[64, D]` loaded into registers once, a loop over `n` K/V tiles of `T` rows
(each brought in by TMA), `S = q K_t^T` by wgmma with q from registers, then
`acc += bf16(S) V_t` by wgmma with the bf16 scores from registers (no softmax: the
products alone). When `T == D` the scores have q's shape, dtype and register layout.
Each case runs with q held in registers across the loop and with q reloaded per tile,
against a float64 oracle of the same bf16-rounded products.

Usage (GPU machine): `PYTHONPATH=. python3 benchmarks/square_repro.py`
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

BLOCK_Q = 64


def _transforms(head_dim):
  swizzle = min(128, head_dim * 2)
  return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def products(q, k, v, *, tile, reload):
  """`sum_t bf16(q K_t^T) V_t` over the `k.shape[0] // tile` tiles, in one Mosaic GPU kernel."""
  head_dim = q.shape[1]
  num_tiles = k.shape[0] // tile
  transforms = _transforms(head_dim)

  def kernel(q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, o_smem, q_bar, k_bar, v_bar):
    plgpu.copy_gmem_to_smem(q_ref, q_smem, q_bar)
    plgpu.barrier_wait(q_bar)
    q_held = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA)

    def body(t, acc):
      rows = pl.ds(t * tile, tile)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem, k_bar)
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem, v_bar)
      plgpu.barrier_wait(k_bar)
      q_now = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA) if reload else q_held

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_now, k_smem.transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, tile), jnp.float32))
      plgpu.barrier_wait(v_bar)
      acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, s.astype(q_ref.dtype), v_smem))(
          plgpu.ACC.init(acc))
      plgpu.commit_smem()   # the tiles were read; the next TMA may overwrite them
      return acc

    acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, num_tiles, body, acc)
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((BLOCK_Q, head_dim), jnp.float32),
      scratch_types=[plgpu.SMEM((BLOCK_Q, head_dim), q.dtype),
                     plgpu.SMEM((tile, head_dim), q.dtype, transforms=transforms),
                     plgpu.SMEM((tile, head_dim), q.dtype, transforms=transforms),
                     plgpu.SMEM((BLOCK_Q, head_dim), jnp.float32),
                     plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier()],
  )(q, k, v)


def oracle(q, k, v, *, tile):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros((q.shape[0], v.shape[1]))
  for t in range(k.shape[0] // tile):
    rows = slice(t * tile, (t + 1) * tile)
    s = np.asarray(jnp.asarray(q @ k[rows].T, jnp.float32).astype(jnp.bfloat16), np.float64)
    out += s @ v[rows]
  return out


def main():
  print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}")
  print(f"{'D':>4} {'T':>4} {'tiles':>5}  {'q held':>12}  {'q reloaded':>12}")
  key = jax.random.key(0)
  for head_dim, tile, tiles in ((64, 64, 1), (64, 64, 3), (128, 128, 1), (128, 128, 3),
                                (64, 128, 3), (128, 64, 3)):
    kq, kk, kv = jax.random.split(jax.random.fold_in(key, head_dim * 1000 + tile + tiles), 3)
    scale = head_dim ** -0.5
    q = (jax.random.normal(kq, (BLOCK_Q, head_dim)) * scale).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (tile * tiles, head_dim)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (tile * tiles, head_dim)).astype(jnp.bfloat16)
    want = oracle(q, k, v, tile=tile)
    errs = []
    for reload in (False, True):
      try:
        got = jax.jit(functools.partial(products, tile=tile, reload=reload))(q, k, v)
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        errs.append(f"{err:12.2e}")
      except Exception as e:  # pylint: disable=broad-except
        errs.append(f"{type(e).__name__:>12}")
    print(f"{head_dim:>4} {tile:>4} {tiles:>5}  {errs[0]}  {errs[1]}   (relative max error)")


if __name__ == "__main__":
  main()
