"""Varlen attention over a step's segment table (SPEC §7.2, §8, §10.7).

`varlen_attention_reference` is the pure-jnp definition of the semantics and the
XLA path; `varlen_attention` runs the Pallas Mosaic GPU kernel of
`varlen_attention_sm90.py` behind the same signature (plus `config`/`interpret`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import indexing

# A finite mask value, not -inf: a fully masked row (a padded token) would give
# exp(-inf - -inf) = NaN; with a finite value it gives finite garbage instead.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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
  if seq_info.shape != (num_tokens, indexing.NUM_SEG_FIELDS):
    raise ValueError(f"seq_info must be [{num_tokens}, {indexing.NUM_SEG_FIELDS}]; got "
                     f"{seq_info.shape=}")
  if seq_info.dtype != jnp.int32 or jnp.asarray(n_segments).dtype != jnp.int32:
    raise ValueError(f"seq_info and n_segments must be int32; got {seq_info.dtype=}, "
                     f"{jnp.asarray(n_segments).dtype=}")
  if jnp.ndim(n_segments) != 0:
    raise ValueError(f"n_segments must be a scalar; got shape {jnp.shape(n_segments)}")
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"{window=} must be None (flat) or an int >= 1")
  if not isinstance(scale, (int, float, np.floating)):   # NumPy floats are fine too
    raise ValueError(f"{scale=} must be a Python or NumPy float")


def token_segments(seq_info, n_segments, num_tokens: int):
  """Per-token segment fields: `(has_segment, q_start, q_len, col, pos0, kind)`.

  Each is `[num_tokens]` int32 (bool for `has_segment`); tokens covered by no real
  segment (padding) get `has_segment = False` and zeros elsewhere.
  """
  tokens = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
  q_start = seq_info[:, indexing.SEG_Q_START][None, :]
  q_end = q_start + seq_info[:, indexing.SEG_Q_LEN][None, :]
  is_real = (jnp.arange(seq_info.shape[0], dtype=jnp.int32) < n_segments)[None, :]
  in_segment = (tokens >= q_start) & (tokens < q_end) & is_real   # [T, segments]
  has_segment = jnp.any(in_segment, axis=1)
  fields = jnp.where(in_segment[:, :, None], seq_info[None, :, :], 0).sum(axis=1)
  return (has_segment, fields[:, indexing.SEG_Q_START], fields[:, indexing.SEG_Q_LEN],
          fields[:, indexing.SEG_COL], fields[:, indexing.SEG_POS0],
          fields[:, indexing.SEG_KIND])


def varlen_attention_reference(q, k_cache, v_cache, seq_info, n_segments, *, window,
                               scale):
  """Attention of every step token over its own column's visible keys.

  Args:
    q: `[T, H_q, D]` queries in step-token order.
    k_cache, v_cache: `[R, C, K, D]` storage of one layer, already holding this
      step's K/V. Only rows of a real segment's read range are read (others may
      hold NaN).
    seq_info: `[T, 5]` int32 segment table; rows `[0, n_segments)` are real.
    n_segments: int32 scalar.
    window: None for a flat layer, else the ring window (`R` is the ring size).
    scale: softmax scale.

  Returns:
    `[T, H_q, D]` in `q.dtype`. Rows of tokens outside every real segment are
    unspecified (finite here).
  """
  static_validate_varlen_attention(q, k_cache, v_cache, seq_info, n_segments,
                                   window=window, scale=scale)
  num_tokens, num_q_heads, head_dim = q.shape
  num_rows, _, num_kv_heads, _ = k_cache.shape
  group = num_q_heads // num_kv_heads
  has_segment, q_start, q_len, col, pos0, kind = token_segments(
      seq_info, n_segments, num_tokens)
  query_pos = pos0 + jnp.arange(num_tokens, dtype=jnp.int32) - q_start
  lo = indexing.read_start(pos0, window=window)[:, None]
  end = (pos0 + q_len)[:, None]
  rows = jnp.arange(num_rows, dtype=jnp.int32)[None, :]
  key_pos = indexing.key_positions(rows, lo, end, num_rows=num_rows, window=window)
  visible = indexing.is_visible(key_pos, query_pos[:, None], lo, end, kind[:, None],
                                window=window) & has_segment[:, None]   # [T, S]
  keys = jnp.swapaxes(k_cache[:, col], 0, 1).astype(jnp.float32)       # [T, S, K, D]
  values = jnp.swapaxes(v_cache[:, col], 0, 1).astype(jnp.float32)
  # Select, never multiply: a masked row may hold NaN, and 0 * NaN is NaN.
  keys = jnp.where(visible[:, :, None, None], keys, 0.0)
  values = jnp.where(visible[:, :, None, None], values, 0.0)
  queries = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
  scores = jnp.einsum("TKGD,TSKD->TKGS", queries, keys,
                      precision=jax.lax.Precision.HIGHEST) * scale
  scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
  probs = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
  probs = jnp.where(visible[:, None, None, :], probs, 0.0)
  denom = probs.sum(axis=-1, keepdims=True)
  out = jnp.einsum("TKGS,TSKD->TKGD", probs, values,
                   precision=jax.lax.Precision.HIGHEST)
  out = out / jnp.where(denom > 0, denom, 1.0)   # guarded: padded rows see nothing
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def varlen_attention(q, k_cache, v_cache, seq_info, n_segments, *, window, scale,
                     config=None, interpret=False):
  """The Mosaic GPU kernel; same arguments and result as the reference.

  Raises:
    NotImplementedError: for a valid request the kernel cannot serve (dtype,
      head dim, device); the dispatcher then falls back to the reference.
  """
  static_validate_varlen_attention(q, k_cache, v_cache, seq_info, n_segments,
                                   window=window, scale=scale)
  from pallas_kernels import varlen_attention_sm90   # pylint: disable=g-import-not-at-top
  return varlen_attention_sm90.varlen_attention_sm90(
      q, k_cache, v_cache, seq_info, n_segments, window=window, scale=scale,
      config=config, interpret=interpret)
