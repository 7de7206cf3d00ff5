"""In-place K/V write of a step's real tokens (CONTRACT §10.7).

`kv_write_reference` is the XLA scatter; `kv_write` runs the Pallas Mosaic GPU
kernel of `kv_write_sm90.py`, which writes through a mutable array reference so
the custom call aliases the cache buffer (in place when the caller donates it).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import fp8


def static_validate_kv_pair(k, v, *, names=("k_cache", "v_cache"), layout="[R, C, K, D]"):
  """A K and a V store of one 4-d shape and one dtype; raises ValueError naming them."""
  a, b = names
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"{a} and {b} must share one {layout} shape; got "
                     f"{a}.shape={k.shape}, {b}.shape={v.shape}")
  if k.dtype != v.dtype:
    raise ValueError(f"{a}.dtype={k.dtype!r} and {b}.dtype={v.dtype!r} must agree")


def static_validate_kv_write(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens, *,
                            names=("k_cache", "v_cache"), layout="[R, C, K, D]"):
  """Checks shapes and dtypes at trace time; raises ValueError.

  `names` and `layout` name the stores in messages (a paged pool is
  `[pages, page_size, K, D]`: the same checks apply to its last two axes).
  """
  static_validate_kv_pair(k_cache, v_cache, names=names, layout=layout)
  if k_new.ndim != 3 or k_new.shape != v_new.shape:
    raise ValueError(f"k_new and v_new must share one [T, K, D] shape; got "
                     f"{k_new.shape=}, {v_new.shape=}")
  if k_new.shape[1:] != k_cache.shape[2:]:
    raise ValueError(f"new K/V heads and dim {k_new.shape[1:]} != cache's "
                     f"{k_cache.shape[2:]}")
  num_tokens = k_new.shape[0]
  if seq_cols.shape != (num_tokens,) or rows.shape != (num_tokens,):
    raise ValueError(f"seq_cols and rows must be [{num_tokens}]; got {seq_cols.shape=}, "
                     f"{rows.shape=}")
  if seq_cols.dtype != jnp.int32 or rows.dtype != jnp.int32:
    raise ValueError(f"seq_cols and rows must be int32; got {seq_cols.dtype=}, "
                     f"{rows.dtype=}")
  if jnp.ndim(n_tokens) != 0:
    raise ValueError(f"n_tokens must be a scalar; got shape {jnp.shape(n_tokens)}")


def kv_write_reference(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens, *,
                       k_scale=None, v_scale=None):
  """Sets `cache[rows[t], seq_cols[t]] = new[t]` (cast) for `t < n_tokens`.

  Args:
    k_cache, v_cache: `[R, C, K, D]`; donate them for an in-place update.
    k_new, v_new: `[T, K, D]` new K/V of the step's tokens (any float dtype).
    seq_cols, rows: `[T]` int32 column and row of each token.
    n_tokens: int32 scalar; tokens `n_tokens..T-1` are padding and not written.
    k_scale, v_scale: fp8 caches only (else None): `[K]` float32 per-head scales
      the new K/V are quantised with (`fp8.quantize`; the caller chooses them,
      `fp8.update_scale`).

  Returns:
    `(k_cache, v_cache)` updated.
  """
  static_validate_kv_write(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens)
  fp8.static_validate_scales(k_cache.dtype, k_scale, v_scale, k_cache.shape[2])
  is_real = jnp.arange(k_new.shape[0], dtype=jnp.int32) < n_tokens
  # Padded tokens get an out-of-range row and are dropped: nothing is written.
  rows = jnp.where(is_real, rows, k_cache.shape[0])
  k_cache = k_cache.at[rows, seq_cols].set(fp8.store_as(k_new, k_cache.dtype, k_scale), mode="drop")
  v_cache = v_cache.at[rows, seq_cols].set(fp8.store_as(v_new, v_cache.dtype, v_scale), mode="drop")
  return k_cache, v_cache


def kv_write(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens, *, k_scale=None,
             v_scale=None, config=None, interpret=False):
  """The Mosaic GPU write kernel; same arguments and result as the reference.

  Raises:
    NotImplementedError: for a valid request the kernel cannot serve.
  """
  static_validate_kv_write(k_cache, v_cache, k_new, v_new, seq_cols, rows, n_tokens)
  fp8.static_validate_scales(k_cache.dtype, k_scale, v_scale, k_cache.shape[2])
  from pallas_kernels import kv_write_sm90   # pylint: disable=g-import-not-at-top
  return kv_write_sm90.kv_write_sm90(k_cache, v_cache, k_new, v_new, seq_cols, rows,
                                     n_tokens, k_scale=k_scale, v_scale=v_scale,
                                     config=config, interpret=interpret)


def check_kv_write(k_cache, *, config=None) -> None:
  """Raises NotImplementedError iff `kv_write` would refuse this cache (shape/dtype only)."""
  from pallas_kernels import kv_write_sm90   # pylint: disable=g-import-not-at-top
  kv_write_sm90.check_request(k_cache, config=config)
