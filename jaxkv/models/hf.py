"""Loading Hugging Face checkpoints (Llama and Gemma 3 text) into `jaxkv.models`.

A checkpoint directory holds `config.json` and one or more `*.safetensors`
files, read with the `safetensors` package (NumPy, no torch). A tokenizer comes
from `tokenizer.json` through the optional `tokenizers` package.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import numpy as np

from jaxkv.models.decoder import GEMMA3, LLAMA, Decoder, ModelConfig, shard_model
from jaxkv.nnx import RopeScaling

_LLAMA_TYPES = ("llama", "mistral")
_GEMMA3_TYPES = ("gemma3_text", "gemma3")


def _rope(params: dict | None, fallback_theta: float, scaling: dict | None):
  """`(theta, RopeScaling)` from transformers-5 `rope_parameters` or older keys."""
  if params:
    return float(params.get("rope_theta", fallback_theta)), RopeScaling.from_hf(params)
  return fallback_theta, RopeScaling.from_hf(scaling)


def read_config(checkpoint: str) -> ModelConfig:
  """The `ModelConfig` of a checkpoint directory's `config.json`.

  Raises:
    ValueError: the directory has no config.json, or an unsupported `model_type`.
  """
  path = os.path.join(checkpoint, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"checkpoint={checkpoint!r} has no config.json")
  with open(path) as f:
    cfg = json.load(f)
  if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
    cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
  model_type = cfg.get("model_type")
  if model_type not in _LLAMA_TYPES + _GEMMA3_TYPES:
    raise ValueError(f"model_type={model_type!r} in {path} is not supported "
                     "(Llama or Gemma 3 text)")

  def need(key):
    if key not in cfg:
      raise ValueError(f"{path} has no {key!r}")
    return cfg[key]

  eos = cfg.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  heads = need("num_attention_heads")
  common = dict(
      vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
      intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
      num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
      head_dim=cfg.get("head_dim") or need("hidden_size") // heads,
      rms_eps=cfg.get("rms_norm_eps", 1e-6), bos_token_id=cfg.get("bos_token_id"),
      eos_token_ids=eos)
  if model_type in _LLAMA_TYPES:
    theta, scaling = _rope(cfg.get("rope_parameters"), cfg.get("rope_theta", 10000.0),
                           cfg.get("rope_scaling"))
    return ModelConfig(arch=LLAMA, rope_theta=theta, rope_scaling=scaling,
                       tie_embeddings=cfg.get("tie_word_embeddings", False), **common)
  params = cfg.get("rope_parameters") or {}
  theta, scaling = _rope(params.get("full_attention"), cfg.get("rope_theta", 1_000_000.0),
                         cfg.get("rope_scaling"))
  local_theta, _ = _rope(params.get("sliding_attention"),
                         cfg.get("rope_local_base_freq", 10000.0), None)
  types = cfg.get("layer_types")
  if types is None:
    pattern = cfg.get("sliding_window_pattern", 6)
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
             for i in range(cfg["num_hidden_layers"])]
  return ModelConfig(
      arch=GEMMA3, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
      tie_embeddings=cfg.get("tie_word_embeddings", True),
      sliding_window=cfg.get("sliding_window"),
      layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
      query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
      final_logit_softcap=cfg.get("final_logit_softcapping"), **common)


def read_tensors(checkpoint: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint's `*.safetensors` files, as float32 NumPy arrays.

  Raises:
    ValueError: no safetensors file in the directory.
  """
  from safetensors.numpy import load_file   # pylint: disable=g-import-not-at-top
  files = sorted(glob.glob(os.path.join(checkpoint, "*.safetensors")))
  if not files:
    raise ValueError(f"checkpoint={checkpoint!r} holds no *.safetensors file")
  tensors = {}
  for file in files:
    try:
      loaded = load_file(file)
    except TypeError:   # bfloat16 has no NumPy dtype in safetensors.numpy
      loaded = _load_via_flax(file)
    for name, array in loaded.items():
      for prefix in ("language_model.", "model.language_model.", "model.text_model."):
        if name.startswith(prefix):
          name = "model." + name[len(prefix):].removeprefix("model.")
      tensors[name] = np.asarray(array, np.float32)
  return tensors


def _load_via_flax(file: str) -> dict:
  from safetensors.flax import load_file   # pylint: disable=g-import-not-at-top
  return {k: np.asarray(v.astype(jnp.float32)) for k, v in load_file(file).items()}


def _assign(param, array: np.ndarray, name: str) -> None:
  expected = param[...].shape
  if array.shape != expected:
    raise ValueError(f"checkpoint tensor {name} has shape {array.shape}; the model expects "
                     f"{expected}")
  param[...] = jnp.asarray(array, param[...].dtype)


def load_weights(model: Decoder, tensors: dict[str, np.ndarray]) -> None:
  """Copies Hugging Face tensors into `model` in place (linear weights transposed).

  Raises:
    ValueError: a tensor is missing or has the wrong shape.
  """
  def take(name):
    if name not in tensors:
      raise ValueError(f"checkpoint has no tensor {name!r}")
    return tensors[name]

  _assign(model.embed.embedding, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
  _assign(model.norm.weight, take("model.norm.weight"), "model.norm.weight")
  if model.lm_head is not None:
    head = tensors.get("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    _assign(model.lm_head.kernel, head.T, "lm_head.weight")
  for l, layer in enumerate(model.layers):
    p = f"model.layers.{l}."
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      name = f"{p}self_attn.{proj}.weight"
      _assign(getattr(layer.attn, proj).kernel, take(name).T, name)
    if layer.attn.q_norm is not None:
      for norm in ("q_norm", "k_norm"):
        name = f"{p}self_attn.{norm}.weight"
        _assign(getattr(layer.attn, norm).weight, take(name), name)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      name = f"{p}mlp.{proj}.weight"
      _assign(getattr(layer.mlp, proj).kernel, take(name).T, name)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if layer.is_gemma:
      norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for norm in norms:
      _assign(getattr(layer, norm).weight, take(p + norm + ".weight"), p + norm + ".weight")


def load_model(checkpoint: str, *, capacity: int, max_seqs: int, max_write: int,
               kv_dtype=jnp.float32, dtype=jnp.float32, param_dtype=jnp.float32,
               implementation: str | None = None, initial_capacity: int | None = None,
               mesh=None, kv_axis: str = "tp"):
  """Builds the checkpoint's model on a fresh cache config and loads its weights.

  With `mesh`, the loaded model is then split over `kv_axis`
  (`jaxkv.models.shard_model`: heads and MLP features split, the rest
  replicated).

  Returns:
    `(model, model_config, cache_config)`.
  """
  from flax import nnx   # pylint: disable=g-import-not-at-top
  config = read_config(checkpoint)
  cache_config = config.cache_config(capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                                     kv_dtype=kv_dtype, initial_capacity=initial_capacity)
  model = Decoder(config, cache_config, dtype=dtype, param_dtype=param_dtype,
                  implementation=implementation, rngs=nnx.Rngs(0))
  load_weights(model, read_tensors(checkpoint))
  if mesh is not None:
    model = shard_model(model, mesh, kv_axis)
  return model, config, cache_config


def load_tokenizer(checkpoint: str):
  """A `tokenizers.Tokenizer` from `tokenizer.json`, or None (no file or no package)."""
  path = os.path.join(checkpoint, "tokenizer.json")
  if not os.path.isfile(path):
    return None
  try:
    import tokenizers   # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tokenizers.Tokenizer.from_file(path)


__all__ = ["load_model", "load_tokenizer", "load_weights", "read_config", "read_tensors"]
