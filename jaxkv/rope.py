"""Rotary position embeddings: frequencies (with Llama-3 / linear scaling) and their application.

Pure NumPy/jnp math shared by `jaxkv.nnx.CachedAttention`, the models and the
benchmarks' padded baselines; `jaxkv.nnx` re-exports these names.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


class RopeScaling:
  """Frequency scaling of rotary embeddings, as in Hugging Face `rope_scaling`.

  Hashable and static. `kind` is `"default"`, `"linear"` (every frequency
  divided by `factor`) or `"llama3"` (Llama 3.1's wavelength-dependent scaling).

  Args:
    kind: the rope type.
    factor: scaling factor (`> 0`).
    low_freq_factor, high_freq_factor, original_max_position: Llama 3 settings.
  """

  __slots__ = ("kind", "factor", "low_freq_factor", "high_freq_factor", "original_max_position")

  def __init__(self, kind: str = "default", factor: float = 1.0, low_freq_factor: float = 1.0,
               high_freq_factor: float = 4.0, original_max_position: int = 8192):
    if kind not in ("default", "linear", "llama3"):
      raise ValueError(f"kind={kind!r} must be 'default', 'linear' or 'llama3'")
    if not factor > 0:
      raise ValueError(f"factor={factor} must be > 0")
    self.kind, self.factor = kind, float(factor)
    self.low_freq_factor, self.high_freq_factor = float(low_freq_factor), float(high_freq_factor)
    self.original_max_position = int(original_max_position)

  @classmethod
  def from_hf(cls, rope_scaling: dict | None) -> "RopeScaling":
    """Reads a Hugging Face `rope_scaling` dict (None means no scaling)."""
    if not rope_scaling:
      return cls()
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    return cls(kind, rope_scaling.get("factor", 1.0), rope_scaling.get("low_freq_factor", 1.0),
               rope_scaling.get("high_freq_factor", 4.0),
               rope_scaling.get("original_max_position_embeddings", 8192))

  def _key(self):
    return tuple(getattr(self, s) for s in self.__slots__)

  def __eq__(self, other):
    return isinstance(other, RopeScaling) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    return f"RopeScaling{self._key()}"


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
  """`float32[head_dim // 2]` inverse frequencies, computed on the host in float64."""
  if head_dim % 2:
    raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  scaling = scaling or RopeScaling()
  if scaling.kind == "linear":
    inv = inv / scaling.factor
  elif scaling.kind == "llama3":
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(is_medium, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
  return inv.astype(np.float32)


def apply_rope(x, positions, inv_freq):
  """Rotary embedding in Hugging Face's half-split layout, computed in float32.

  Args:
    x: `[T, H, D]`.
    positions: `int32[T]` per-token positions.
    inv_freq: `float32[D // 2]`.

  Returns:
    `[T, H, D]` in `x.dtype`.
  """
  freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
  angles = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]   # [T, 1, D]
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)
