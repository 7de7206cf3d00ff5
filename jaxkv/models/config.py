"""`ModelConfig`: the architecture of a Llama- or Gemma-3-style decoder, and its cache layout.

`ModelConfig.llama(...)` / `.gemma3(...)` build one, `num_params` counts its
weights and `cache_config(...)` gives the `jaxkv.CacheConfig` it runs on (sliding
layers are ring layers, global layers flat).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import jaxkv
from jaxkv.rope import RopeScaling

LLAMA = "llama"
GEMMA3 = "gemma3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Llama- or Gemma-3-style decoder (hashable, static).

  Attributes:
    arch: `"llama"` or `"gemma3"`.
    vocab_size, hidden_size, intermediate_size, num_layers: sizes.
    num_heads, num_kv_heads, head_dim: attention geometry (GQA when
      `num_kv_heads < num_heads`).
    rope_theta: RoPE base of the global (flat) layers.
    rope_scaling: `RopeScaling` of the global layers.
    rope_local_theta: RoPE base of sliding layers (Gemma 3 only; the sliding
      layers of Llama-style models (Mistral, Qwen) use `rope_theta` and
      `rope_scaling` like their full layers).
    rms_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reuses the embedding matrix.
    sliding_window: window of sliding layers (None: no sliding layer).
    layer_types: per layer `"full"` or `"sliding"`.
    query_pre_attn_scalar: Gemma 3's softmax scale is its inverse square root;
      None means `1/sqrt(head_dim)`.
    final_logit_softcap: None, or `cap * tanh(logits / cap)`.
    attention_bias: biases on the q/k/v projections (Qwen2; o_proj has none).
    qk_norm: None, `"llama"` (Qwen3: `weight * x̂` per head) or `"gemma"`
      (`(1 + weight) * x̂`); Gemma 3 always has `"gemma"` (set when None).
    bos_token_id, eos_token_ids: special tokens (eos ids end a request).
    max_position_embeddings: the checkpoint's context length (None: not
      given); the default `max_len` of `jaxkv.serve.sizing.plan_serving`. The math
      does not read it.
  """

  arch: str = LLAMA
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rope_local_theta: float = 10000.0
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  query_pre_attn_scalar: float | None = None
  final_logit_softcap: float | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  attention_bias: bool = False
  qk_norm: str | None = None
  max_position_embeddings: int | None = None

  def __post_init__(self):
    if self.arch not in (LLAMA, GEMMA3):
      raise ValueError(f"arch={self.arch!r} must be 'llama' or 'gemma3'")
    if self.arch == GEMMA3 and self.qk_norm is None:
      object.__setattr__(self, "qk_norm", "gemma")
    allowed = ("gemma",) if self.arch == GEMMA3 else (None, "llama")
    if self.qk_norm not in allowed:
      raise ValueError(f"qk_norm={self.qk_norm!r} must be one of {allowed} for arch={self.arch!r}")
    if self.max_position_embeddings is not None and (
        isinstance(self.max_position_embeddings, bool)
        or not isinstance(self.max_position_embeddings, int) or self.max_position_embeddings < 1):
      raise ValueError(f"max_position_embeddings={self.max_position_embeddings!r} must be an "
                       "int >= 1 or None")
    if not isinstance(self.attention_bias, bool):
      raise TypeError(f"attention_bias={self.attention_bias!r} must be a bool")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    types = self.layer_types or ("full",) * self.num_layers
    object.__setattr__(self, "layer_types", tuple(types))
    object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
    if len(self.layer_types) != self.num_layers:
      raise ValueError(f"layer_types has {len(self.layer_types)} entries; "
                       f"num_layers={self.num_layers}")
    for t in self.layer_types:
      if t not in ("full", "sliding"):
        raise ValueError(f"layer_types entry {t!r} must be 'full' or 'sliding'")
    if "sliding" in self.layer_types and not (self.sliding_window or 0) >= 1:
      raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 with sliding layers")

  @classmethod
  def llama(cls, **kwargs) -> "ModelConfig":
    """A small random-weights Llama-style config (override any field)."""
    return cls(arch=LLAMA, **kwargs)

  @classmethod
  def gemma3(cls, **kwargs) -> "ModelConfig":
    """A small Gemma-3-style config: 5 sliding layers then 1 global, window 8."""
    defaults = dict(arch=GEMMA3, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=32,
                    sliding_window=8, layer_types=("sliding",) * 5 + ("full",),
                    rope_theta=1_000_000.0, query_pre_attn_scalar=32.0, tie_embeddings=True)
    defaults.update(kwargs)
    return cls(**defaults)

  @property
  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.attention_bias:
      attn += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    if self.qk_norm is not None:
      attn += 2 * self.head_dim
    mlp = 3 * self.hidden_size * self.intermediate_size
    norms = (4 if self.arch == GEMMA3 else 2) * self.hidden_size
    embed = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
    return self.num_layers * (attn + mlp + norms) + embed + self.hidden_size

  def cache_layers(self) -> list[jaxkv.LayerConfig]:
    """One `jaxkv.LayerConfig` per layer: sliding -> ring(window), full -> flat."""
    layers = []
    for t in self.layer_types:
      policy = (jaxkv.LayerPolicy.ring(self.sliding_window) if t == "sliding"
                else jaxkv.LayerPolicy.flat())
      layers.append(jaxkv.LayerConfig(policy, self.num_kv_heads, self.head_dim))
    return layers

  def cache_config(self, *, capacity: int, max_seqs: int, max_write: int,
                   kv_dtype=jnp.float32, initial_capacity: int | None = None,
                   max_seq_len: int | None = None, page_size: int | None = None
                   ) -> jaxkv.CacheConfig:
    """The `jaxkv.CacheConfig` this model runs on (initial capacity = capacity by default)."""
    return jaxkv.CacheConfig(
        self.cache_layers(), capacity=capacity, max_seqs=max_seqs, max_write=max_write,
        kv_dtype=kv_dtype,
        initial_capacity=capacity if initial_capacity is None else initial_capacity,
        max_seq_len=max_seq_len, page_size=page_size)
