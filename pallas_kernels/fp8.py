"""fp8 K/V storage: the formats, the scale rule, quantisation and dequantisation (CONTRACT §3.2).

An fp8 layer stores `K / k_scale` and `V / v_scale` with one float32 scale per
KV head (a vector `[K]` per layer, per K and per V), so attention reads half
the bytes of bfloat16. The write quantises (`quantize`: times `1 / scale`,
clip to the format's largest finite value, round to nearest even); attention
dequantises (`dequantize`: cast, times `scale`).

Scales are powers of two, so `x * (1 / scale)` and `y * scale` are exact in
float32 (no rounding beyond the fp8 cast itself) and multiplying by a scale
commutes exactly with the kernels' float32 arithmetic: the kernels fold the K
scale into q and apply the V scale to the output, the reference dequantises
each key and value; the two differ only by rounding of other terms.

The scale rule (`update_scale`): a scale of 0 means unset (a fresh state); the
first write whose real tokens have, for that head, a largest finite magnitude
`amax >= 2**-126` sets it to the smallest power of two `2**e` with
`amax / 2**e <= fp8_max / 2` (e clamped to `[-126, e_max]` so that
`fp8_max * scale` stays finite), so that write lands in `(fp8_max / 4,
fp8_max / 2]` and later values up to 2x (at least) its amax keep their
precision. Later writes never change it; beyond `fp8_max * scale` a value
saturates (clips) to it, and no value or scale is ever inf or NaN unless the
input was NaN (which stays NaN, as in a 16-bit cache). While a scale is unset
every finite value written for that head is 0 (below 2**-126), and it is
stored as is (zero, since the cast flushes it).

This module sees raw arrays only (no jaxkv), like every kernel module.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))

HEADROOM = 2           # the first write's amax lands at or below fp8_max / HEADROOM
MIN_EXPONENT = -126    # 2**-126, the smallest normal float32: 1 / scale stays finite
MIN_AMAX = 2.0**MIN_EXPONENT   # a write below it (all zeros, denormals) leaves a scale unset


def is_fp8(dtype) -> bool:
  """Whether `dtype` is an fp8 storage format served here (e4m3fn or e5m2)."""
  return np.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
  """The format's largest finite value: 448 (e4m3fn), 57344 (e5m2)."""
  return float(jnp.finfo(dtype).max)


def _exponent_bounds(dtype) -> tuple[int, int, float]:
  """`(e_shift, e_max, mantissa_limit)` of the scale rule for `dtype`, from frexp of
  the target `fp8_max / HEADROOM = m_t * 2**e_t` (`m_t` in `[0.5, 1)`)."""
  target = fp8_max(dtype) / HEADROOM
  m_t, e_t = np.frexp(np.float64(target))
  # fp8_max * 2**e is finite in float32 while fp8_max < 2**(128 - e).
  e_max = 127 - int(np.floor(np.log2(fp8_max(dtype))))
  return int(e_t), e_max, float(m_t)


def scale_for(amax, dtype):
  """The scale the first write of largest finite magnitude `amax` sets (0 below `MIN_AMAX`).

  Integer logic on `frexp(amax) = (m, e)`: `amax / 2**s <= m_t * 2**e_t` holds
  for `s = e - e_t` when `m <= m_t`, else for `s = e - e_t + 1`, and for no
  smaller `s`. No float rounding decides it.
  """
  e_t, e_max, m_t = _exponent_bounds(dtype)
  amax = jnp.asarray(amax, jnp.float32)
  m, e = jnp.frexp(amax)
  s = jnp.where(m <= m_t, e - e_t, e - e_t + 1)
  s = jnp.clip(s, MIN_EXPONENT, e_max)
  return jnp.where(amax >= MIN_AMAX, jnp.ldexp(jnp.float32(1.0), s), jnp.float32(0.0))


def write_amax(new, n_tokens):
  """`[K]` float32: per KV head, the largest finite magnitude of the real tokens of `new`
  `[T, K, D]` (tokens `n_tokens..T-1` are padding and do not count; non-finite values
  do not count, so a scale never becomes inf or NaN)."""
  is_real = (jnp.arange(new.shape[0], dtype=jnp.int32) < n_tokens)[:, None, None]
  mag = jnp.abs(new.astype(jnp.float32))
  mag = jnp.where(is_real & jnp.isfinite(mag), mag, 0.0)
  return mag.max(axis=(0, 2))


def update_scale(scale, new, n_tokens, dtype):
  """The scale `[K]` after writing `new` `[T, K, D]` (first `n_tokens` real): a set scale
  (> 0) is kept; an unset one (0) takes `scale_for` of this write's amax."""
  return jnp.where(scale > 0, scale, scale_for(write_amax(new, n_tokens), dtype))


def per_head(scale, ndim: int):
  """`scale` `[K]` as float32 shaped to multiply a `[..., K, D]` array of `ndim` axes."""
  return scale.astype(jnp.float32).reshape((1,) * (ndim - 2) + (scale.shape[0], 1))


def quantize(x, scale, dtype):
  """`x` `[..., K, D]` stored in fp8 `dtype` with per-head `scale` `[K]`.

  `x * (1 / scale)` (exact: a power of two; 1 where the scale is unset),
  clipped to `[-fp8_max, fp8_max]` (saturation, never inf), rounded to nearest
  even by the cast. NaN stays NaN.
  """
  limit = fp8_max(dtype)
  inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 1.0)
  y = x.astype(jnp.float32) * per_head(inv, x.ndim)
  return jnp.clip(y, -limit, limit).astype(dtype)


def store_as(new, cache_dtype, scale=None):
  """`new` `[T, K, D]` as a cache of `cache_dtype` stores it: cast (round to nearest
  even), or for fp8 `quantize`d with the per-head `scale`. The static dtype decides, so
  16- and 32-bit caches run exactly the cast they always did."""
  if is_fp8(cache_dtype):
    return quantize(new, scale, cache_dtype)
  return new.astype(cache_dtype)


def dequantize(x, scale, dtype=jnp.float32):
  """fp8 `x` `[..., K, D]` as `dtype`: `x * scale` per head, in float32 (exact), then cast."""
  return (x.astype(jnp.float32) * per_head(scale, x.ndim)).astype(dtype)


def static_validate_scales(cache_dtype, k_scale, v_scale, num_kv_heads: int,
                           *, what: str = "k_cache") -> None:
  """fp8 storage needs both `[K]` float32 scales; other storage takes none. ValueError."""
  if is_fp8(cache_dtype):
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
      if s is None:
        raise ValueError(f"{what}.dtype={np.dtype(cache_dtype)} is fp8: {name} ([K] float32 "
                         "per KV head) is required")
      if s.shape != (num_kv_heads,) or s.dtype != jnp.float32:
        raise ValueError(f"{name} must be float32[{num_kv_heads}] (one per KV head); got "
                         f"{s.dtype}{list(s.shape)}")
  elif k_scale is not None or v_scale is not None:
    raise ValueError(f"{what}.dtype={np.dtype(cache_dtype)} is not fp8: k_scale and v_scale "
                     "must be None")
