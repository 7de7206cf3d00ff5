"""In-place K/V write of a step's real tokens: the Mosaic GPU kernel (sm90).

One program per (token, block of KV heads). A real token's new K and V rows are
brought into shared memory by TMA and stored by TMA at `(rows[t], seq_cols[t])`
of the caches; padding tokens (`t >= n_tokens`) exit at once, so the scratch
column is never touched. K and V enter as one `[T, 2, K, D]` operand: stacking
them is one XLA fusion with the producers of K and V, where two operands cost a
second fusion (the copy of V out of the fused q/k/v projection). The caches
enter the kernel as mutable array refs (`jax.new_ref`, then `jax.freeze`), so
the Mosaic GPU custom call aliases each cache operand to its result and, when
the caller donates the caches, XLA updates them in place with no cache-sized copy.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels import _compat
from pallas_kernels import config as config_lib
from pallas_kernels import fp8
from pallas_kernels.common import SUPPORTED_KV_DTYPES

_TMA_MAX_BOX = 256


def _kv_write_kernel(seq_cols_ref, rows_ref, n_tokens_ref, kv_new_ref,  # Inputs
                     k_cache_ref, v_cache_ref,   # Inputs, written in place (Refs)
                     k_smem, v_smem, k_bar, v_bar,   # Scratch
                     *, block_heads, address=None):
  """Grid axes "token" and "heads" (blocks of `block_heads` KV heads).

  `kv_new_ref` is `[T, 2, K, D]`: each token's new K (index 0) and V (index 1).

  `address(token) -> (row, col)` gives a real token's cache row and column from
  scalar reads; the default reads `rows_ref` and `seq_cols_ref`. The paged write
  (`paged_sm90`) passes one that looks the row up in the page table instead,
  so both layouts share this body.
  """
  if address is None:
    address = lambda token: (rows_ref[token], seq_cols_ref[token])
  token = lax.axis_index("token")
  heads = pl.ds(lax.axis_index("heads") * block_heads, block_heads)

  @pl.when(token < n_tokens_ref[0])
  def _write():
    row, col = address(token)
    plgpu.copy_gmem_to_smem(kv_new_ref.at[token, 0, heads], k_smem, k_bar)
    plgpu.copy_gmem_to_smem(kv_new_ref.at[token, 1, heads], v_smem, v_bar)
    plgpu.barrier_wait(k_bar)
    plgpu.copy_smem_to_gmem(k_smem, k_cache_ref.at[row, col, heads])
    plgpu.barrier_wait(v_bar)
    plgpu.copy_smem_to_gmem(v_smem, v_cache_ref.at[row, col, heads])
    plgpu.wait_smem_to_gmem(0)


def static_check(k_cache, *, block_heads):
  """Raises NotImplementedError for valid requests this kernel cannot serve."""
  _, _, num_kv_heads, head_dim = k_cache.shape
  dtype = np.dtype(k_cache.dtype)
  # fp8 rows are quantised by XLA before the kernel (`fp8.store_as`): it moves bytes only.
  if dtype not in SUPPORTED_KV_DTYPES and not fp8.is_fp8(dtype):
    raise NotImplementedError(f"kv dtype {dtype} is not supported")
  if (head_dim * dtype.itemsize) % 16 or head_dim > _TMA_MAX_BOX:
    raise NotImplementedError(f"{head_dim=} rows of {dtype} must be a multiple of 16 "
                              f"bytes and at most {_TMA_MAX_BOX} elements for TMA")
  if num_kv_heads % block_heads or block_heads > _TMA_MAX_BOX:
    raise NotImplementedError(f"{block_heads=} must divide {num_kv_heads=} and be at "
                              f"most {_TMA_MAX_BOX}")


def check_request(k_cache, *, config=None) -> int:
  """Raises NotImplementedError if this write cannot be served; returns `block_heads`.

  Needs only the cache's shape and dtype; `kv_write_sm90` runs the same check.
  """
  config = config_lib.KvWriteConfig() if config is None else config
  block_heads = config.block_heads or k_cache.shape[2]
  static_check(k_cache, block_heads=block_heads)
  return block_heads


def run_write(kernel, k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens, extra=(), *,
              block_heads, interpret, k_scale=None, v_scale=None):
  """Runs a write kernel with this file's anatomy; call it under `jax.jit`.

  `kernel` takes `_kv_write_kernel`'s refs with the `extra` int32 inputs between
  `kv_new_ref` and the caches (`block_heads` is bound here). `k_scale`, `v_scale`:
  an fp8 cache's per-head scales (`fp8.quantize`), else None.
  """
  num_tokens, num_kv_heads, head_dim = k_new.shape
  dtype = k_cache.dtype
  # The cast (round to nearest even, like the reference's astype; for fp8 the
  # reference's quantisation) and the stack are one XLA fusion with whatever
  # produced K and V (RoPE, the projection's slices); the kernel then moves bytes only.
  kv_new = jnp.stack([fp8.store_as(k_new, dtype, k_scale), fp8.store_as(v_new, dtype, v_scale)],
                     axis=1)
  k_ref = jax.new_ref(k_cache, memory_space=plgpu.GMEM)
  v_ref = jax.new_ref(v_cache, memory_space=plgpu.GMEM)
  plgpu.kernel(
      functools.partial(kernel, block_heads=block_heads),
      out_type=(),
      scratch_types=[plgpu.SMEM((block_heads, head_dim), dtype),
                     plgpu.SMEM((block_heads, head_dim), dtype),
                     plgpu.Barrier(), plgpu.Barrier()],
      grid=(num_tokens, num_kv_heads // block_heads),
      grid_names=("token", "heads"),
      interpret=interpret,
  )(seq_cols, rows, jnp.reshape(n_tokens, (1,)).astype(jnp.int32), kv_new, *extra, k_ref, v_ref)
  return jax.freeze(k_ref), jax.freeze(v_ref)


@functools.partial(jax.jit, static_argnames=("block_heads", "interpret"))
def _kv_write(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens, k_scale=None,
              v_scale=None, *, block_heads, interpret):
  return run_write(_kv_write_kernel, k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens,
                   block_heads=block_heads, interpret=interpret, k_scale=k_scale,
                   v_scale=v_scale)


def kv_write_sm90(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens, *,
                  k_scale=None, v_scale=None, config=None, interpret=False):
  """Sets `cache[rows[t], seq_cols[t]] = new[t]` (cast) for `t < n_tokens`, in place.

  Args:
    k_cache, v_cache: `[R, C, K, D]` caches (bf16, fp16, fp32, or fp8 with
      `k_scale`/`v_scale`); donate them at the enclosing jit boundary for a true
      in-place update.
    k_new, v_new: `[T, K, D]` new K/V (any float dtype; cast to the cache's).
    seq_cols, rows: `[T]` int32 column and row of each token.
    n_tokens: int32 scalar; tokens `n_tokens..T-1` are padding and not written.
    config: a `KvWriteConfig`; None picks the default.
    interpret: False compiles for the GPU; True (or `InterpretGPUParams`) runs
      the Mosaic GPU interpreter.

  Returns:
    `(k_cache, v_cache)` updated.

  Raises:
    NotImplementedError: for a dtype or head geometry TMA cannot move.
  """
  block_heads = check_request(k_cache, config=config)
  return _kv_write(k_cache, v_cache, k_new, v_new, seq_cols, rows,
                   jnp.asarray(n_tokens, jnp.int32), k_scale, v_scale, block_heads=block_heads,
                   interpret=_compat.resolve_interpret(interpret))
