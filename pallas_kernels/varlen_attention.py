"""Varlen attention over a step's segment table (CONTRACT §7.2, §8, §10.7).

`varlen_attention_reference` is the pure-jnp definition of the semantics and the
XLA path; `varlen_attention` runs the Pallas Mosaic GPU kernel of
`varlen_attention_sm90.py` behind the same signature (plus `config`/`interpret`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp8
from pallas_kernels import indexing
from pallas_kernels.common import MASK_VALUE
from pallas_kernels.common import token_segments


def static_validate_varlen_attention(q, k_cache, v_cache, seq_info, n_segments, *,
                                     window, scale):
  """Checks shapes, dtypes and static parameters at trace time; raises ValueError."""
  if q.ndim != 3:
    raise ValueError(f"q must be [T, H_q, D]; got {q.shape=}")
  if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
    raise ValueError(f"k_cache and v_cache must share one [R, C, K, D] shape; got "
                     f"{k_cache.shape=}, {v_cache.shape=}")
  if k_cache.dtype != v_cache.dtype:
    raise ValueError(f"{k_cache.dtype=} and {v_cache.dtype=} must agree")
  num_tokens, num_q_heads, head_dim = q.shape
  _, _, num_kv_heads, cache_head_dim = k_cache.shape
  if head_dim != cache_head_dim:
    raise ValueError(f"q head dim {head_dim} != cache head dim {cache_head_dim}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
  if (seq_info.ndim != 2 or seq_info.shape[1] != indexing.NUM_SEG_FIELDS
      or seq_info.shape[0] < 1):
    raise ValueError(f"seq_info must be [S, {indexing.NUM_SEG_FIELDS}] with S >= 1 rows (a "
                     f"step passes one per token, S = {num_tokens}); got {seq_info.shape=}")
  if seq_info.dtype != jnp.int32 or jnp.asarray(n_segments).dtype != jnp.int32:
    raise ValueError(f"seq_info and n_segments must be int32; got {seq_info.dtype=}, "
                     f"{jnp.asarray(n_segments).dtype=}")
  if jnp.ndim(n_segments) != 0:
    raise ValueError(f"n_segments must be a scalar; got shape {jnp.shape(n_segments)}")
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"{window=} must be None (flat) or an int >= 1")
  if not isinstance(scale, (int, float, np.floating)):   # NumPy floats are fine too
    raise ValueError(f"{scale=} must be a Python or NumPy float")


# Rows per block of the reference's key loop: bounds its gathered K/V to about
# this many float32 elements per operand, whatever the cache size.
_REFERENCE_BLOCK_ELEMENTS = 1 << 24


def varlen_attention_reference(q, k_cache, v_cache, seq_info, n_segments, *, window,
                               scale, k_scale=None, v_scale=None):
  """Attention of every step token over its own column's visible keys.

  Each token streams its column's rows in blocks with an online float32 softmax,
  so memory stays bounded (`_REFERENCE_BLOCK_ELEMENTS`) for any cache size.

  Args:
    q: `[T, H_q, D]` queries in step-token order.
    k_cache, v_cache: `[R, C, K, D]` storage of one layer, already holding this
      step's K/V. Only rows of a real segment's read range are read (others may
      hold NaN).
    seq_info: `[S, 5]` int32 segment table; rows `[0, n_segments)` are real.
      A cache step passes one row per token (`S = T`, CONTRACT §7.1); a caller
      that knows a smaller bound on its segments (a batch of `B` prefills) may
      pass `S = B` rows: the compiled kernel sizes its plan by `min(T, S)`.
    n_segments: int32 scalar, at most `S`.
    window: None for a flat layer, else the ring window (`R` is the ring size).
    scale: softmax scale.
    k_scale, v_scale: fp8 caches only (else None): `[K]` float32 per-head scales;
      each key and value read is dequantised (`fp8.dequantize`: stored value
      times its head's scale, in float32).

  Returns:
    `[T, H_q, D]` in `q.dtype`. Rows of tokens outside every real segment are
    unspecified (finite here).
  """
  static_validate_varlen_attention(q, k_cache, v_cache, seq_info, n_segments,
                                   window=window, scale=scale)
  fp8.static_validate_scales(k_cache.dtype, k_scale, v_scale, k_cache.shape[2])
  # Row `r` of token `t`'s column: `cache[r, col[t]]`.
  gather = lambda cache, rows, col: cache[rows.T, col[None, :]].swapaxes(0, 1)
  return blocked_attention(q, k_cache, v_cache, gather, k_cache.shape[0], seq_info,
                           n_segments, window=window, scale=scale, k_scale=k_scale,
                           v_scale=v_scale)


def blocked_attention(q, k_cache, v_cache, gather, num_rows: int, seq_info, n_segments, *,
                      window, scale, k_scale=None, v_scale=None):
  """The reference's loop over blocks of rows, for any storage layout.

  Args:
    gather: `(cache, rows [1, S], col [T]) -> [T, S, K, D]`, the K or V each
      token's column holds at rows `rows` (any value where the row is not in the
      token's read range: it is selected away, never multiplied).
    num_rows: rows per column (`R`); rows `[0, R)` are streamed.
    The other arguments are `varlen_attention_reference`'s.
  """
  def read(cache, rows, col, cache_scale):
    """Float32 K or V of the rows; an fp8 cache's dequantised (None: a plain cast)."""
    x = gather(cache, rows, col)
    return x.astype(jnp.float32) if cache_scale is None else fp8.dequantize(x, cache_scale)

  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[2]
  group = num_q_heads // num_kv_heads
  has_segment, q_start, q_len, col, pos0, kind = token_segments(
      seq_info, n_segments, num_tokens)
  query_pos = (pos0 + jnp.arange(num_tokens, dtype=jnp.int32) - q_start)[:, None]
  lo = indexing.read_start(pos0, window=window)[:, None]
  end = (pos0 + q_len)[:, None]
  queries = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
  block = max(1, min(num_rows, _REFERENCE_BLOCK_ELEMENTS // (num_tokens * num_kv_heads
                                                             * head_dim)))
  num_blocks = -(-num_rows // block)

  def attend_block(b, carry):
    m_i, l_i, acc = carry                        # [T, K, G], [T, K, G], [T, K, G, D]
    rows = b * block + jnp.arange(block, dtype=jnp.int32)
    safe_rows = jnp.minimum(rows, num_rows - 1)[None, :]
    key_pos = indexing.key_positions(safe_rows, lo, end, num_rows=num_rows, window=window)
    visible = (indexing.is_visible(key_pos, query_pos, lo, end, kind[:, None], window=window)
               & has_segment[:, None] & (rows < num_rows)[None, :])       # [T, S]
    # Select, never multiply: a masked row may hold NaN, and 0 * NaN is NaN.
    keys = jnp.where(visible[:, :, None, None], read(k_cache, safe_rows, col, k_scale), 0.0)
    values = jnp.where(visible[:, :, None, None], read(v_cache, safe_rows, col, v_scale), 0.0)
    scores = jnp.einsum("TKGD,TSKD->TKGS", queries, keys,
                        precision=jax.lax.Precision.HIGHEST) * scale
    scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
    m_new = jnp.maximum(m_i, scores.max(axis=-1))
    probs = jnp.where(visible[:, None, None, :], jnp.exp(scores - m_new[..., None]), 0.0)
    alpha = jnp.exp(m_i - m_new)
    acc = acc * alpha[..., None] + jnp.einsum("TKGS,TSKD->TKGD", probs, values,
                                              precision=jax.lax.Precision.HIGHEST)
    return m_new, l_i * alpha + probs.sum(axis=-1), acc

  shape = (num_tokens, num_kv_heads, group)
  init = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape + (head_dim,), jnp.float32))
  _, denom, out = jax.lax.fori_loop(0, num_blocks, attend_block, init)
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]   # guarded: padded rows see nothing
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def varlen_attention(q, k_cache, v_cache, seq_info, n_segments, *, window, scale,
                     k_scale=None, v_scale=None, config=None, interpret=False):
  """The Mosaic GPU kernel; same arguments and result as the reference.

  Raises:
    NotImplementedError: for a valid request the kernel cannot serve (dtype,
      head dim, device); the dispatcher then falls back to the reference.
  """
  static_validate_varlen_attention(q, k_cache, v_cache, seq_info, n_segments,
                                   window=window, scale=scale)
  fp8.static_validate_scales(k_cache.dtype, k_scale, v_scale, k_cache.shape[2])
  from pallas_kernels import varlen_attention_sm90   # pylint: disable=g-import-not-at-top
  return varlen_attention_sm90.varlen_attention_sm90(
      q, k_cache, v_cache, seq_info, n_segments, window=window, scale=scale,
      k_scale=k_scale, v_scale=v_scale, config=config, interpret=interpret)


def check_varlen_attention(q, k_cache, *, config=None, interpret=False) -> None:
  """Raises NotImplementedError iff `varlen_attention` would refuse these shapes.

  `q` and `k_cache` may be `jax.ShapeDtypeStruct`s: the kernel's own static
  checks run on shapes, dtypes and the (default) config only, so dispatchers
  and planners share them instead of re-deriving the rules.
  """
  from pallas_kernels import varlen_attention_sm90   # pylint: disable=g-import-not-at-top
  varlen_attention_sm90.check_request(q, k_cache, config=config, interpret=interpret)
