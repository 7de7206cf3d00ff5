"""Paged storage: the write and the attention through a page table, references and kernels.

A paged flat layer stores K (and V) in a pool `[num_pages, page_size, K, D]`;
column `c`'s logical row (position) `p` lives at
`pool[page_table[c, p // page_size], p % page_size]`. These references take the
arguments of `kv_write_reference` / `varlen_attention_reference` with the
pool in place of the `[R, C, K, D]` cache, plus the `page_table`; the logical
rows per column are `page_table.shape[1] * page_size`. Only flat layers are
paged (`window=None`). No whole cache is gathered: the write scatters the
step's tokens, and the attention streams its key blocks through the table
inside the reference's own loop.

`paged_kv_write` and `paged_varlen_attention` run the Mosaic GPU kernels of
`paged_sm90.py` behind the same signatures (plus `config`/`interpret`);
`check_paged` is their shape-only refusal check for dispatchers.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import fp8
from pallas_kernels.indexing import page_address
from pallas_kernels.kv_write import static_validate_kv_pair, static_validate_kv_write
from pallas_kernels.varlen_attention import blocked_attention
from pallas_kernels.varlen_attention import static_validate_varlen_attention


def static_validate_paged(k_pool, v_pool, page_table) -> None:
  """Checks the pool and table shapes and dtypes at trace time; raises ValueError."""
  static_validate_kv_pair(k_pool, v_pool, names=("k_pool", "v_pool"),
                          layout="[pages, page_size, K, D]")
  if page_table.ndim != 2 or page_table.dtype != jnp.int32:
    raise ValueError(f"page_table must be int32 [columns, pages per column]; got "
                     f"{page_table.dtype}{list(page_table.shape)}")


def paged_kv_write_reference(k_pool, v_pool, k_new, v_new, seq_cols, rows, n_tokens,
                             page_table, *, k_scale=None, v_scale=None):
  """Sets `pool[page_table[seq_cols[t], rows[t] // P], rows[t] % P] = new[t]` for `t < n_tokens`.

  Args:
    k_pool, v_pool: `[num_pages, P, K, D]`; donate them for an in-place update.
    k_new, v_new: `[T, K, D]`.
    seq_cols, rows: `[T]` int32 column and logical row (position) of each token.
    n_tokens: int32 scalar; later tokens are padding and not written.
    page_table: `[C, pages per column]` int32; the caller has given every written
      row a page the column owns alone (copy on write happens before).
    k_scale, v_scale: fp8 pools only: `[K]` float32 per-head scales (as
      `kv_write_reference`'s).

  Returns:
    `(k_pool, v_pool)` updated.
  """
  static_validate_paged(k_pool, v_pool, page_table)
  static_validate_kv_write(k_pool, v_pool, k_new, v_new, seq_cols, rows, n_tokens,
                           names=("k_pool", "v_pool"), layout="[pages, page_size, K, D]")
  fp8.static_validate_scales(k_pool.dtype, k_scale, v_scale, k_pool.shape[2], what="k_pool")
  num_tokens = k_new.shape[0]
  page, offset = page_address(page_table, seq_cols, rows, k_pool.shape[1])
  is_real = jnp.arange(num_tokens, dtype=jnp.int32) < n_tokens
  # Padded tokens get an out-of-range page and are dropped: nothing is written.
  page = jnp.where(is_real, page, k_pool.shape[0])
  k_pool = k_pool.at[page, offset].set(fp8.store_as(k_new, k_pool.dtype, k_scale), mode="drop")
  v_pool = v_pool.at[page, offset].set(fp8.store_as(v_new, v_pool.dtype, v_scale), mode="drop")
  return k_pool, v_pool


def paged_varlen_attention_reference(q, k_pool, v_pool, page_table, seq_info, n_segments, *,
                                     window, scale, k_scale=None, v_scale=None):
  """`varlen_attention_reference` over paged storage (flat layers only).

  Each token streams its column's logical rows in blocks; a block's keys are
  looked up through `page_table` inside the loop. Only rows of a real
  segment's read range are read; every other page may hold NaN.

  Raises:
    ValueError: a ring `window` (rings are not paged), or bad shapes.
  """
  static_validate_paged(k_pool, v_pool, page_table)
  if window is not None:
    raise ValueError(f"{window=}: paged storage serves flat layers only (window=None)")
  static_validate_varlen_attention(q, k_pool, v_pool, seq_info, n_segments, window=None,
                                   scale=scale)
  fp8.static_validate_scales(k_pool.dtype, k_scale, v_scale, k_pool.shape[2], what="k_pool")
  page_size = k_pool.shape[1]

  def gather(pool, rows, col):
    page, offset = page_address(page_table, col[:, None], rows, page_size)   # [T, S]
    return pool[page, offset]                                                 # [T, S, K, D]

  return blocked_attention(q, k_pool, v_pool, gather, page_table.shape[1] * page_size,
                           seq_info, n_segments, window=None, scale=scale, k_scale=k_scale,
                           v_scale=v_scale)


def paged_kv_write(k_pool, v_pool, k_new, v_new, seq_cols, rows, n_tokens, page_table, *,
                   k_scale=None, v_scale=None, config=None, interpret=False):
  """The Mosaic GPU write kernel through the page table; the reference's arguments and result.

  Raises:
    NotImplementedError: for a valid request the kernel cannot serve.
  """
  static_validate_paged(k_pool, v_pool, page_table)
  static_validate_kv_write(k_pool, v_pool, k_new, v_new, seq_cols, rows, n_tokens,
                           names=("k_pool", "v_pool"), layout="[pages, page_size, K, D]")
  fp8.static_validate_scales(k_pool.dtype, k_scale, v_scale, k_pool.shape[2], what="k_pool")
  from pallas_kernels import paged_sm90   # pylint: disable=g-import-not-at-top
  return paged_sm90.paged_kv_write_sm90(k_pool, v_pool, k_new, v_new, seq_cols, rows, n_tokens,
                                        page_table, k_scale=k_scale, v_scale=v_scale,
                                        config=config, interpret=interpret)


def paged_varlen_attention(q, k_pool, v_pool, page_table, seq_info, n_segments, *, window,
                           scale, k_scale=None, v_scale=None, config=None, interpret=False):
  """The Mosaic GPU attention kernel through the page table; the reference's arguments and result.

  `config.block_k` must serve the page size: divide it, or be a multiple of a page
  size that is a multiple of 8 (`paged_sm90.serves`; None picks such a config).

  Raises:
    ValueError: a ring `window`, or bad shapes (as the reference).
    NotImplementedError: for a valid request the kernel cannot serve.
  """
  static_validate_paged(k_pool, v_pool, page_table)
  if window is not None:
    raise ValueError(f"{window=}: paged storage serves flat layers only (window=None)")
  static_validate_varlen_attention(q, k_pool, v_pool, seq_info, n_segments, window=None,
                                   scale=scale)
  fp8.static_validate_scales(k_pool.dtype, k_scale, v_scale, k_pool.shape[2], what="k_pool")
  from pallas_kernels import paged_sm90   # pylint: disable=g-import-not-at-top
  return paged_sm90.paged_varlen_attention_sm90(q, k_pool, v_pool, page_table, seq_info,
                                                n_segments, scale=scale, k_scale=k_scale,
                                                v_scale=v_scale, config=config,
                                                interpret=interpret)


def check_paged(q, k_pool, *, config=None, interpret=False) -> None:
  """Raises NotImplementedError iff the paged kernels would refuse this layer.

  Shapes and dtypes only (`q` `[T, H_q, D]`, `k_pool` `[pages, P, K, D]`, arrays or
  `jax.ShapeDtypeStruct`s), so dispatchers and planners share the kernels' checks.
  """
  from pallas_kernels import paged_sm90   # pylint: disable=g-import-not-at-top
  paged_sm90.check_write_request(k_pool)
  paged_sm90.check_request(q, k_pool, config=config, interpret=interpret)
