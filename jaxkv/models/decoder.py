"""Llama-style and Gemma-3-style decoders on jaxkv, in Flax NNX.

The Llama style also covers Mistral (every layer a sliding window), Qwen2/2.5
(q/k/v biases, optional sliding layers) and Qwen3 (per-head q/k RMSNorm):
`ModelConfig.attention_bias`, `qk_norm` and `layer_types` say which.

Both run one cache step at a time: `model(tokens, state)` takes the step's
`int32[W]` tokens and a `CacheState` whose step is prepared, runs every layer
(each a `jaxkv.nnx.CachedAttention` on its own cache layer) and returns
`(logits, new_state)`. Gemma 3's sliding-window layers are jaxkv ring layers and
its global layers flat layers, so `ModelConfig.cache_config` builds the matching
`jaxkv.CacheConfig`.

Weights are random unless loaded from a Hugging Face checkpoint directory with
`jaxkv.models.hf.load_model`.

Tensor parallelism: with `mesh=` (and `kv_axis`, default `"tp"`), every
attention layer splits its heads over `kv_axis` (see `jaxkv.nnx.CachedAttention`)
and every MLP its intermediate features (gate/up over their outputs, down over
its inputs); embeddings, norms and the LM head are replicated. The cache state
must be built with the same mesh: `jaxkv.init_state(cache_config, mesh=model.mesh,
kv_axis=model.kv_axis)` (`jaxkv.serve.Engine` does it). `shard_model` splits an
existing model (e.g. one loaded from Hugging Face) and `shard_params` places a
bare parameter tree on a mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxkv
from jaxkv._gemm import linear_dot_general, resolve_gemm
from jaxkv.models.config import GEMMA3, LLAMA, ModelConfig
from jaxkv.nnx import (CachedAttention, RMSNorm, bucketed, row_parallel_sharding,
                       sharded_init, validate_tp)

# Rows above which the MLP keeps its gate and up matmuls apart (see `MLP.__call__`).
_MERGE_ROWS = 256


class MLP(nnx.Module):
  """Gated MLP: `down(act(gate(x)) * up(x))`; SiLU (Llama) or tanh-GELU (Gemma)."""

  def __init__(self, config: ModelConfig, *, dtype, param_dtype, gemm: str = "xla", mesh=None,
               kv_axis="tp", rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    linear = lambda n_in, n_out, spec, choice="xla": nnx.Linear(
        n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
        kernel_init=sharded_init(init, mesh, spec), dot_general=linear_dot_general(choice),
        rngs=rngs)
    # Megatron: gate/up split over their outputs, down over its inputs. Only down's decode
    # GEMM may run the skinny kernel (`gemm`, resolved): XLA's merged gate+up GEMM already
    # streams its weights near the copy ceiling (docs/performance-history.md "Serving speed" §17).
    self.gate_proj = linear(config.hidden_size, config.intermediate_size, (None, kv_axis))
    self.up_proj = linear(config.hidden_size, config.intermediate_size, (None, kv_axis))
    self.down_proj = linear(config.intermediate_size, config.hidden_size, (kv_axis, None), gemm)
    self.is_gelu = config.arch == GEMMA3
    self.mesh = mesh

  def __call__(self, x):
    x_up = x
    if x.shape[0] > _MERGE_ROWS:
      # XLA merges the gate and up dots (they share `x`) into one gemm over the
      # concatenated weights; for wide steps that gemm goes to cuBLAS, which
      # needs the concatenation materialised: 16 copies of [hidden, 2 * inter]
      # per step (0.53 ms a prefill step of the e2e model on H200). Two
      # operands that XLA cannot prove equal keep the dots apart there; narrow
      # (decode) steps keep the merged gemm, whose fused operand costs nothing.
      x, x_up = jax.lax.optimization_barrier((x, x))
    gate = self.gate_proj(x)
    gate = jax.nn.gelu(gate, approximate=True) if self.is_gelu else jax.nn.silu(gate)
    return self.down_proj(gate * self.up_proj(x_up), out_sharding=row_parallel_sharding(self.mesh))


class DecoderLayer(nnx.Module):
  """One pre-norm decoder layer; Gemma 3 adds post-attention and post-MLP norms."""

  def __init__(self, config: ModelConfig, cache_config: jaxkv.CacheConfig, layer: int, *,
               dtype, param_dtype, implementation, bucket, gemm=None, mesh=None,
               kv_axis="tp", rngs: nnx.Rngs):
    is_gemma = config.arch == GEMMA3
    is_sliding = config.layer_types[layer] == "sliding"
    offset = 1.0 if is_gemma else 0.0
    norm = lambda: RMSNorm(config.hidden_size, eps=config.rms_eps, offset=offset,
                           param_dtype=param_dtype, mesh=mesh)
    scale = (None if config.query_pre_attn_scalar is None
             else 1.0 / math.sqrt(config.query_pre_attn_scalar))
    # Gemma 3's local layers have their own RoPE base and no scaling; Mistral's and Qwen's
    # sliding layers rotate exactly like their full ones.
    local_rope = is_gemma and is_sliding
    self.attn = CachedAttention(
        cache_config, layer, features=config.hidden_size, num_heads=config.num_heads,
        rope_theta=config.rope_local_theta if local_rope else config.rope_theta,
        rope_scaling=None if local_rope else config.rope_scaling,
        qk_norm=config.qk_norm, norm_eps=config.rms_eps, scale=scale,
        use_bias=config.attention_bias,
        dtype=dtype, param_dtype=param_dtype, implementation=implementation, bucket=bucket,
        gemm=gemm, mesh=mesh, kv_axis=kv_axis, rngs=rngs)
    self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, gemm=self.attn.gemm, mesh=mesh,
                   kv_axis=kv_axis, rngs=rngs)
    self.bucket = bucket
    self.input_layernorm = norm()
    self.post_attention_layernorm = norm()
    self.is_gemma = is_gemma
    if is_gemma:
      self.pre_feedforward_layernorm = norm()
      self.post_feedforward_layernorm = norm()

  def __call__(self, x, state):
    h, state = self.attn(self.input_layernorm(x), state)
    mlp = lambda y: bucketed(self.mlp, y, state.step.n_tokens, self.bucket)
    if self.is_gemma:
      x = x + self.post_attention_layernorm(h)
      return x + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x))), state
    x = x + h
    return x + mlp(self.post_attention_layernorm(x)), state


def _check_params_fit(config: ModelConfig, param_dtype, mesh, kv_axis: str) -> None:
  """Refuses, before building, a model whose weights cannot fit the device.

  An absurd config (a million layers) would otherwise spend many minutes
  initialising before the allocator fails. With a mesh the bound is the
  even split over `kv_axis`, a lower bound of what one device holds.
  """
  from jaxkv._memory import check_fits   # pylint: disable=g-import-not-at-top
  item = np.dtype(param_dtype).itemsize
  shards = 1 if mesh is None else int(mesh.shape[kv_axis])
  formula = f"{config.num_params:,} parameters (ModelConfig.num_params) x {item} bytes"
  if shards > 1:
    formula += f" / {shards} shards"
  check_fits(-(-config.num_params * item // shards), formula=formula,
             what=f"a {config.arch} model of {config.num_layers} layers, hidden "
                  f"{config.hidden_size}", device=None if mesh is None else mesh.devices.flat[0])


class Decoder(nnx.Module):
  """A Llama- or Gemma-3-style causal LM over a jaxkv cache.

  Args:
    config: the `ModelConfig`.
    cache_config: a `jaxkv.CacheConfig` with `config.num_layers` layers matching
      `config.cache_layers()` (any capacity, `max_seqs`, `max_write`).
    dtype: computation dtype (float32 by default).
    param_dtype: parameter dtype.
    implementation: attention implementation passed to every layer.
    bucket: optional row count for small steps: a step with at most `bucket`
      real tokens (a decode step) runs projections and MLPs on `bucket` rows
      instead of `W` (`jaxkv.nnx.bucketed`).
    gemm: the GEMM of every layer's output and down projections at decode widths (up to
      128 rows): None picks `"mosaic_gpu"` (`pallas_kernels.skinny_gemm`) on a Hopper GPU
      without a mesh, else `"xla"`; `"interpret"` runs it under the Mosaic GPU interpreter.
      The resolved choice is `model.gemm` (CONTRACT §10.8).
    mesh: optional `jax.sharding.Mesh` (auto or explicit axes) for tensor parallelism:
      attention heads and MLP features split over `kv_axis`, embeddings and
      norms replicated (module docstring).
    kv_axis: the mesh axis that splits heads and MLP features.
    rngs: `nnx.Rngs` for the random initial weights.

  Raises:
    ValueError: `num_heads`, `num_kv_heads` or `intermediate_size` is not
      divisible by the `kv_axis` axis size (named), the cache config does
      not match, or the weights cannot fit the device (checked before building).
  """

  def __init__(self, config: ModelConfig, cache_config: jaxkv.CacheConfig, *,
               dtype=jnp.float32, param_dtype=jnp.float32, implementation: str | None = None,
               bucket: int | None = None, gemm: str | None = None, mesh=None,
               kv_axis: str = "tp", rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"config={config!r} must be a ModelConfig")
    if tuple(cache_config.layers) != tuple(config.cache_layers()):
      raise ValueError(f"cache_config.layers={cache_config.layers} must equal "
                       f"config.cache_layers()={tuple(config.cache_layers())}")
    validate_tp(mesh, kv_axis, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                intermediate_size=config.intermediate_size)
    _check_params_fit(config, param_dtype, mesh, kv_axis)
    self.gemm = resolve_gemm(gemm, mesh)
    self.config, self.cache_config = config, cache_config
    self.mesh, self.kv_axis = mesh, kv_axis
    self.dtype = np.dtype(dtype)
    # Small init (std 0.02, like Hugging Face's initializer_range) keeps random logits tame.
    # With a mesh, embeddings, norms and the LM head are replicated on it.
    replicated = lambda init: sharded_init(init, mesh, (None, None))
    self.embed = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                           param_dtype=param_dtype,
                           embedding_init=replicated(nnx.initializers.normal(0.02)), rngs=rngs)
    self.layers = nnx.List([
        DecoderLayer(config, cache_config, l, dtype=dtype, param_dtype=param_dtype,
                     implementation=implementation, bucket=bucket, gemm=self.gemm, mesh=mesh,
                     kv_axis=kv_axis, rngs=rngs)
        for l in range(config.num_layers)])
    self.norm = RMSNorm(config.hidden_size, eps=config.rms_eps,
                        offset=1.0 if config.arch == GEMMA3 else 0.0, param_dtype=param_dtype,
                        mesh=mesh)
    self.lm_head = None if config.tie_embeddings else nnx.Linear(
        config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
        param_dtype=param_dtype, kernel_init=replicated(nnx.initializers.lecun_normal()),
        rngs=rngs)

  @property
  def vocab_size(self) -> int:
    """The token vocabulary size (the `jaxkv.serve.StepModel` protocol)."""
    return self.config.vocab_size

  def hidden(self, tokens, state):
    """Final-norm hidden states `[W, hidden]` of one step, and the new state."""
    # W, or less inside `jaxkv.pure.run_narrow` (the state's step says which).
    cols = getattr(getattr(state, "step", None), "seq_cols", None)
    width = self.cache_config.step_width if cols is None else cols.shape[0]
    if tokens.shape != (width,):
      raise ValueError(f"tokens must be int32[W={width}]; got tokens.shape={tokens.shape}")
    x = self.embed(tokens.astype(jnp.int32))
    if self.config.arch == GEMMA3:
      x = x * jnp.asarray(math.sqrt(self.config.hidden_size), self.dtype).astype(x.dtype)
    for layer in self.layers:
      x, state = layer(x, state)
    return self.norm(x), state

  def logits(self, h):
    """LM-head logits (float32) of hidden states `[..., hidden]`."""
    if self.lm_head is None:
      logits = self.embed.attend(h)
    else:
      logits = self.lm_head(h)
    logits = logits.astype(jnp.float32)
    cap = self.config.final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)

  def __call__(self, tokens, state, *, rows=None):
    """One cache step.

    Args:
      tokens: `int32[W]` step tokens (padding rows are ignored).
      state: `CacheState` with a prepared step; consumed.
      rows: optional `int32[R]` step-token indices; then only their logits are
        computed (a serving loop needs one row per sequence, not `W`).

    Returns:
      `(logits float32[W or R, vocab], new_state)`.
    """
    h, state = self.hidden(tokens, state)
    if rows is not None:
      h = h[rows]
    return self.logits(h), state


def build(config: ModelConfig, cache_config: jaxkv.CacheConfig, *, seed: int = 0,
          mesh=None, kv_axis: str = "tp", **kwargs) -> Decoder:
  """A `Decoder` with random weights drawn from `seed` (kwargs go to `Decoder`).

  With `mesh`, the weights are the unsharded model's, split over `kv_axis`.
  """
  return Decoder(config, cache_config, rngs=nnx.Rngs(seed), mesh=mesh, kv_axis=kv_axis, **kwargs)


# Parameter-path names split over `kv_axis` (Megatron): over outputs, over inputs.
_SPLIT_OUTPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_SPLIT_INPUTS = ("o_proj", "down_proj")


def param_spec(path, kv_axis: str = "tp") -> P:
  """The `PartitionSpec` of the parameter at `path` (a pytree key path or names).

  q/k/v/gate/up kernels `[in, out]` split over `out`, their biases too;
  o_proj/down kernels split over `in`; everything else (embeddings, norms,
  LM head) replicated.
  """
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  names = [n for n in names if n != "value"]
  if len(names) >= 2 and names[-2] in _SPLIT_OUTPUTS:
    return P(None, kv_axis) if names[-1] == "kernel" else P(kv_axis)
  if len(names) >= 2 and names[-2] in _SPLIT_INPUTS and names[-1] == "kernel":
    return P(kv_axis, None)
  return P()


def shard_params(params, mesh, kv_axis: str = "tp"):
  """An existing parameter tree placed on `mesh` as a sharded `Decoder` holds it.

  Works on any tree with the `Decoder`'s paths, e.g. `nnx.state(model)` of a
  model built without a mesh and loaded from Hugging Face; the values are kept,
  only their placement changes (`param_spec`).

  Args:
    params: an `nnx.State` (or nested dict) of a `Decoder`.
    mesh: the `jax.sharding.Mesh`.
    kv_axis: the mesh axis that splits heads and MLP features.

  Returns:
    The tree with every leaf a `jax.Array` of `NamedSharding(mesh, param_spec(path))`.
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jax.device_put(x, NamedSharding(mesh, param_spec(path, kv_axis))), params)


def shard_model(model: Decoder, mesh, kv_axis: str = "tp") -> Decoder:
  """A sharded copy of `model` (built without a mesh, e.g. Hugging Face-loaded) on `mesh`.

  Builds the same architecture with `mesh` (which validates the head and MLP
  sizes and makes every attention layer run per shard) and moves `model`'s
  weights into it with `shard_params`. `model` itself is left as it is.
  """
  abstract = nnx.eval_shape(lambda: Decoder(
      model.config, model.cache_config, dtype=model.dtype, param_dtype=jnp.float32,
      implementation=model.layers[0].attn.implementation, bucket=model.layers[0].bucket,
      mesh=mesh, kv_axis=kv_axis, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  values = jax.tree.leaves(shard_params(nnx.state(model), mesh, kv_axis))
  structure = jax.tree.structure(abstract_state)   # keeps the sharding metadata
  if structure.num_leaves != len(values):
    raise ValueError(f"model has {len(values)} parameters; its sharded twin has "
                     f"{structure.num_leaves}")
  return nnx.merge(graphdef, jax.tree.unflatten(structure, values))


def Llama(config: ModelConfig, cache_config: jaxkv.CacheConfig, **kwargs) -> Decoder:
  """A Llama-style `Decoder` (checks `config.arch`)."""
  if config.arch != LLAMA:
    raise ValueError(f"config.arch={config.arch!r} must be 'llama'")
  return Decoder(config, cache_config, **kwargs)


def Gemma3(config: ModelConfig, cache_config: jaxkv.CacheConfig, **kwargs) -> Decoder:
  """A Gemma-3-style `Decoder` (checks `config.arch`)."""
  if config.arch != GEMMA3:
    raise ValueError(f"config.arch={config.arch!r} must be 'gemma3'")
  return Decoder(config, cache_config, **kwargs)
