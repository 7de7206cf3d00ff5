"""Reading a Hugging Face `config.json` strictly (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3).

Every key is either understood (parsed, type- and range-checked), known to be
harmless (metadata, training or generation settings that never change a forward
pass), neutral only at its default value (e.g. `attention_bias: false` for
Llama), or refused: an unknown key may change the model's math, and a loader
that ignores it would serve a different model without a word. Every error is a
`ValueError` (a bad value) or `TypeError` (a value of the wrong JSON type) that
names the file and the key.
"""

from __future__ import annotations

import json
import math
import os

from jaxkv.models.config import GEMMA3, LLAMA, ModelConfig
import numpy as np

from jaxkv.nnx import RopeScaling, rope_inv_freq

# model_type -> family. "gemma3" is the multimodal wrapper whose `text_config` is read.
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3", "gemma3": "gemma3"}

# Metadata, training-only and generation settings: none changes the logits of a forward pass.
HARMLESS = frozenset({
    "_name_or_path", "name_or_path", "architectures", "model_type", "transformers_version",
    "torch_dtype", "dtype", "use_cache", "initializer_range",
    "attention_dropout", "hidden_dropout", "pad_token_id", "sep_token_id",
    "decoder_start_token_id", "output_attentions", "output_hidden_states", "return_dict",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "id2label", "label2id",
    "problem_type", "finetuning_task", "task_specific_params", "prefix", "tokenizer_class",
    "chunk_size_feed_forward", "is_decoder", "is_encoder_decoder", "add_cross_attention",
    "tie_encoder_decoder", "cross_attention_hidden_size", "cache_implementation",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "pretraining_tp",
})
# The multimodal Gemma 3 wrapper: its vision parts do not touch the text model's math.
WRAPPER_HARMLESS = HARMLESS | {"text_config", "vision_config", "boi_token_index",
                               "eoi_token_index", "image_token_index", "mm_tokens_per_image",
                               "bos_token_id", "eos_token_id", "tie_word_embeddings"}

_COMMON = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
           "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
           "bos_token_id", "eos_token_id", "max_position_embeddings"}
_QWEN_WINDOWS = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
UNDERSTOOD = {
    "llama": _COMMON,
    "mistral": _COMMON | {"sliding_window"},
    "qwen2": _COMMON | _QWEN_WINDOWS,
    "qwen3": _COMMON | _QWEN_WINDOWS,
    "gemma3": _COMMON | {"sliding_window", "layer_types", "sliding_window_pattern",
                         "_sliding_window_pattern", "query_pre_attn_scalar",
                         "final_logit_softcapping", "rope_local_base_freq"},
}
# Keys accepted only at these values (any other value changes the math and is refused).
_SILU = {"hidden_act": ("silu",)}
NEUTRAL = {
    "llama": {**_SILU, "attention_bias": (False,), "mlp_bias": (False,)},
    "mistral": {**_SILU},
    "qwen2": {**_SILU, "use_mrope": (False,)},
    "qwen3": {**_SILU, "attention_bias": (False,)},
    "gemma3": {"hidden_activation": ("gelu_pytorch_tanh",), "attention_bias": (False,),
               "attn_logit_softcapping": (None,), "use_bidirectional_attention": (False,)},
}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "float64": "float32"}   # float64 checkpoints serve in float32 (no x64 on devices)
_MAX_INT = 2**31 - 1
MAX_HEAD_DIM = 1 << 12   # released models use <= 256
MAX_LAYERS = 1 << 14     # far above any released model (~100 layers); keeps per-layer lists small
MAX_WINDOW = 1 << 30     # a ring of window + max_write rows must stay below 2**31
_ROPE_KEYS = {"default": {"rope_type", "type", "rope_theta"},
              "linear": {"rope_type", "type", "rope_theta", "factor"},
              "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                         "high_freq_factor", "original_max_position_embeddings"}}
_MISSING = object()


class _Reader:
  """Typed, range-checked access to one config dict; every error names `path` and the key."""

  def __init__(self, cfg: dict, path: str, prefix: str = ""):
    self.cfg, self.path, self.prefix = cfg, path, prefix

  def where(self, key: str) -> str:
    return f"{self.path}: {self.prefix}{key}"

  def _get(self, key, default):
    if key in self.cfg:
      return self.cfg[key]
    if default is _MISSING:
      raise ValueError(f"{self.where(key)} is missing (required)")
    return default

  def int(self, key, default=_MISSING, lo=1, hi=_MAX_INT, allow_none=False):
    value = self._get(key, default)
    if value is None and allow_none:
      return None
    return check_int(value, self.where(key), lo, hi)

  def float(self, key, default=_MISSING, allow_none=False):
    """A finite float > 0 (every float the math divides by or exponentiates is one)."""
    value = self._get(key, default)
    if value is None and allow_none:
      return None
    return check_positive(value, self.where(key))

  def bool(self, key, default=_MISSING):
    value = self._get(key, default)
    if not isinstance(value, bool):
      raise TypeError(f"{self.where(key)}={value!r} must be true or false")
    return value


def check_int(value, where: str, lo: int = 1, hi: int = _MAX_INT) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{where}={value!r} must be an integer")
  if not lo <= value <= hi:
    raise ValueError(f"{where}={value} must be in [{lo}, {hi}]")
  return value


# Positive floats (eps, RoPE bases and factors, scales, caps) stay well inside float32's range,
# so nothing derived from them (inverse frequencies, 1/sqrt(scale)) overflows to inf.
POSITIVE_RANGE = (1e-30, 1e30)


def check_positive(value, where: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(f"{where}={value!r} must be a number")
  lo, hi = POSITIVE_RANGE
  if not (isinstance(value, int) or math.isfinite(value)) or not lo <= value <= hi:
    raise ValueError(f"{where}={value} must be a finite number in [{lo}, {hi}]")
  return float(value)


def load_json(path: str, what: str = "config") -> dict:
  """A JSON object from `path`; ValueError naming the file when it is not one."""
  try:
    with open(path, "rb") as f:
      data = json.loads(f.read().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise ValueError(f"{path}: not a valid JSON {what} ({e})") from None
  except OSError as e:
    raise ValueError(f"{path}: cannot be read ({e})") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path}: must hold a JSON object, not {type(data).__name__}")
  return data


def _check_keys(r: _Reader, family: str) -> None:
  for key, value in r.cfg.items():
    if key in HARMLESS or key in UNDERSTOOD[family]:
      continue
    allowed = NEUTRAL[family].get(key)
    if allowed is None:
      raise ValueError(f"{r.where(key)} is not understood by the jaxkv loader for "
                       f"{family}; it may change the model's math, so the checkpoint is refused")
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
      raise ValueError(f"{r.where(key)}={value!r} is not supported (only "
                       f"{' or '.join(json.dumps(a) for a in allowed)})")


def _rope(r: _Reader, params, key: str, theta_key: str | None, default_theta: float,
          scaling_key: str | None):
  """`(theta, RopeScaling)` from a `rope_parameters` dict, or the legacy top-level keys."""
  legacy_scaling = r.cfg.get(scaling_key) if scaling_key else None
  if params is not None:
    if legacy_scaling is not None:
      raise ValueError(f"{r.where(scaling_key)} and {r.prefix}{key} are both set; "
                       "which one applies is ambiguous")
    theta, scaling = _rope_dict(r, params, key)
    if theta is None:
      theta = r.float(theta_key, default_theta) if theta_key else default_theta
    elif theta_key and theta_key in r.cfg and r.float(theta_key) != theta:
      raise ValueError(f"{r.where(theta_key)}={r.cfg[theta_key]} disagrees with "
                       f"{r.prefix}{key}.rope_theta={theta}")
    return theta, scaling
  theta = r.float(theta_key, default_theta) if theta_key else default_theta
  if legacy_scaling is None:
    return theta, RopeScaling()
  if "rope_theta" in legacy_scaling:
    raise ValueError(f"{r.where(scaling_key)} must not carry rope_theta")
  return theta, _rope_dict(r, legacy_scaling, scaling_key)[1]


def _check_rope(r: _Reader, key: str, head_dim: int, theta: float, scaling: RopeScaling):
  """Refuses a RoPE whose float32 inverse frequencies are not finite (they would give NaN)."""
  try:
    with np.errstate(all="raise"):
      rope_inv_freq(head_dim, theta, scaling)
  except FloatingPointError:
    raise ValueError(f"{r.where(key)}: rope_theta={theta} with {scaling} gives non-finite "
                     f"rotary frequencies for head_dim={head_dim}") from None


def _rope_dict(r: _Reader, params, key: str):
  """`(theta or None, RopeScaling)` of one rope dict; unknown keys and types are refused."""
  where = r.where(key)
  if not isinstance(params, dict):
    raise TypeError(f"{where}={params!r} must be an object")
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in _ROPE_KEYS:
    raise ValueError(f"{where}.rope_type={kind!r} is not supported "
                     f"(only {', '.join(sorted(_ROPE_KEYS))})")
  extra = sorted(set(params) - _ROPE_KEYS[kind])
  if extra:
    raise ValueError(f"{where}.{extra[0]} is not understood for rope_type={kind!r}; it may "
                     "change the model's math, so the checkpoint is refused")
  sub = _Reader(params, r.path, f"{r.prefix}{key}.")
  theta = sub.float("rope_theta") if "rope_theta" in params else None
  if kind == "default":
    return theta, RopeScaling()
  factor = sub.float("factor")
  if kind == "linear":
    return theta, RopeScaling("linear", factor)
  low, high = sub.float("low_freq_factor"), sub.float("high_freq_factor")
  if not high > low:
    raise ValueError(f"{where}.high_freq_factor={high} must exceed low_freq_factor={low}")
  original = sub.int("original_max_position_embeddings")
  return theta, RopeScaling("llama3", factor, low, high, original)


def _layer_types(r: _Reader, num_layers: int):
  types = r.cfg["layer_types"]
  where = r.where("layer_types")
  if not isinstance(types, list):
    raise TypeError(f"{where}={types!r} must be a list")
  if len(types) != num_layers:
    raise ValueError(f"{where} has {len(types)} entries; num_hidden_layers={num_layers}")
  names = {"full_attention": "full", "sliding_attention": "sliding"}
  for i, t in enumerate(types):
    if t not in names:
      raise ValueError(f"{where}[{i}]={t!r} must be 'full_attention' or 'sliding_attention'")
  return tuple(names[t] for t in types)


def _token_ids(r: _Reader, vocab: int):
  bos = r.int("bos_token_id", None, lo=0, hi=vocab - 1, allow_none=True)
  eos = r.cfg.get("eos_token_id")
  eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
  eos = tuple(check_int(e, f"{r.where('eos_token_id')}", 0, vocab - 1) for e in eos)
  return bos, eos


def _windows(r: _Reader, family: str, num_layers: int):
  """`(sliding_window, layer_types)` of a Llama-style family, as transformers decides them."""
  if family == "llama":
    return None, None
  if family == "mistral":   # one window for every layer, or none
    window = r.int("sliding_window", None, hi=MAX_WINDOW, allow_none=True)
    return window, None if window is None else ("sliding",) * num_layers
  # Qwen: the window applies only with use_sliding_window, to layers >= max_window_layers.
  use = r.bool("use_sliding_window", False)
  window = r.int("sliding_window", None, hi=MAX_WINDOW, allow_none=True) if use else None
  if use and window is None:
    raise ValueError(f"{r.where('sliding_window')} must be an integer >= 1 when "
                     "use_sliding_window is true")
  if "layer_types" in r.cfg:
    types = _layer_types(r, num_layers)
    if "sliding" in types and window is None:
      raise ValueError(f"{r.where('layer_types')} has sliding layers but use_sliding_window "
                       "is false (transformers would attend over the full history)")
    return window, types
  first = r.int("max_window_layers", num_layers, lo=0)
  if window is None:
    return None, None
  return window, tuple("sliding" if i >= first else "full" for i in range(num_layers))


def parse(cfg: dict, path: str) -> tuple[ModelConfig, dict]:
  """`(ModelConfig, meta)` of a parsed config dict.

  `meta` has `dtype` (the checkpoint's dtype name or None), `multimodal` (a
  Gemma 3 wrapper whose vision tensors are not the text model's) and `family`.
  """
  try:
    return _parse(cfg, path)
  except (ValueError, TypeError) as e:
    if path in str(e):
      raise
    # ModelConfig's own checks name the field but not the file.
    raise type(e)(f"{path}: {e}") from None


def _parse(cfg: dict, path: str) -> tuple[ModelConfig, dict]:
  meta = {"multimodal": False, "family": None}
  prefix = ""
  model_type = cfg.get("model_type")
  if model_type == "gemma3" and "text_config" in cfg:
    for key in cfg:
      if key not in WRAPPER_HARMLESS:
        raise ValueError(f"{path}: {key} is not understood by the jaxkv loader for the "
                         "Gemma 3 wrapper; it may change the model's math, so it is refused")
    if not isinstance(cfg["text_config"], dict):
      raise TypeError(f"{path}: text_config must be an object")
    outer = cfg
    cfg = dict(cfg["text_config"])
    for key in ("torch_dtype", "dtype"):   # the dtype is often only on the wrapper
      if key in outer and key not in cfg:
        cfg[key] = outer[key]
    cfg.setdefault("model_type", "gemma3_text")
    model_type, prefix, meta["multimodal"] = cfg["model_type"], "text_config.", True
  if not isinstance(model_type, str) or model_type not in FAMILIES:
    raise ValueError(f"{path}: model_type={model_type!r} is not supported "
                     f"(one of {', '.join(sorted(FAMILIES))})")
  family = meta["family"] = FAMILIES[model_type]
  r = _Reader(cfg, path, prefix)
  _check_keys(r, family)
  for key in ("torch_dtype", "dtype"):
    if cfg.get(key) is not None:
      if cfg[key] not in DTYPES:
        raise ValueError(f"{r.where(key)}={cfg[key]!r} is not one of {sorted(DTYPES)}")
      meta["dtype"] = DTYPES[cfg[key]]
  meta.setdefault("dtype", None)

  vocab = r.int("vocab_size")
  hidden = r.int("hidden_size")
  heads = r.int("num_attention_heads")
  kv_heads = r.int("num_key_value_heads", None, allow_none=True) or heads
  if heads % kv_heads:
    raise ValueError(f"{r.where('num_attention_heads')}={heads} must be a multiple of "
                     f"num_key_value_heads={kv_heads}")
  head_dim = r.int("head_dim", None, allow_none=True)
  if head_dim is None:
    if hidden % heads:
      raise ValueError(f"{r.where('hidden_size')}={hidden} must be a multiple of "
                       f"num_attention_heads={heads} when head_dim is not given")
    head_dim = hidden // heads
  if head_dim > MAX_HEAD_DIM:   # before the rotary check allocates head_dim/2 frequencies
    raise ValueError(f"{r.where('head_dim')}={head_dim} must be <= {MAX_HEAD_DIM}")
  if head_dim % 2:
    raise ValueError(f"{r.where('head_dim')}={head_dim} must be even (rotary embeddings)")
  # Bounded before anything per layer is built (the checkpoint's tensors decide the exact count).
  num_layers = r.int("num_hidden_layers", hi=MAX_LAYERS)
  bos, eos = _token_ids(r, vocab)
  common = dict(vocab_size=vocab, hidden_size=hidden,
                intermediate_size=r.int("intermediate_size"), num_layers=num_layers,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                rms_eps=r.float("rms_norm_eps", 1e-6), bos_token_id=bos, eos_token_ids=eos,
                max_position_embeddings=r.int("max_position_embeddings", None, allow_none=True))
  if family != "gemma3":
    theta, scaling = _rope(r, cfg.get("rope_parameters"), "rope_parameters", "rope_theta",
                           10000.0, "rope_scaling")
    _check_rope(r, "rope_parameters" if "rope_parameters" in cfg else "rope_theta", head_dim,
                theta, scaling)
    window, types = _windows(r, family, num_layers)
    config = ModelConfig(
        arch=LLAMA, rope_theta=theta, rope_scaling=scaling, sliding_window=window,
        layer_types=types, tie_embeddings=r.bool("tie_word_embeddings", False),
        attention_bias=family == "qwen2", qk_norm="llama" if family == "qwen3" else None,
        **common)
    return config, meta

  params = cfg.get("rope_parameters")
  if params is not None and not isinstance(params, dict):
    raise TypeError(f"{r.where('rope_parameters')}={params!r} must be an object")
  if params is not None:
    extra = sorted(set(params) - {"full_attention", "sliding_attention"})
    if extra:
      raise ValueError(f"{r.where('rope_parameters')}.{extra[0]} is not understood "
                       "(Gemma 3 has full_attention and sliding_attention)")
    params = {k: {} if params.get(k) is None else params[k]
              for k in ("full_attention", "sliding_attention")}
  theta, scaling = _rope(r, None if params is None else params["full_attention"],
                         "rope_parameters.full_attention", "rope_theta", 1_000_000.0,
                         "rope_scaling")
  local_theta, local_scaling = _rope(
      r, None if params is None else params["sliding_attention"],
      "rope_parameters.sliding_attention", "rope_local_base_freq", 10000.0, None)
  _check_rope(r, "rope_parameters.full_attention" if params else "rope_theta", head_dim, theta,
              scaling)
  _check_rope(r, "rope_parameters.sliding_attention" if params else "rope_local_base_freq",
              head_dim, local_theta, local_scaling)
  if local_scaling != RopeScaling():
    raise ValueError(f"{r.where('rope_parameters.sliding_attention')} must not scale "
                     "(Gemma 3's local layers are unscaled)")
  if "layer_types" in cfg:
    types = _layer_types(r, num_layers)
  else:
    key = "sliding_window_pattern" if "sliding_window_pattern" in cfg else "_sliding_window_pattern"
    pattern = r.int(key, 6)
    types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))
  window = r.int("sliding_window", None, hi=MAX_WINDOW, allow_none=True)
  if "sliding" in types and window is None:
    raise ValueError(f"{r.where('sliding_window')} must be an integer >= 1 (sliding layers)")
  config = ModelConfig(
      arch=GEMMA3, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
      tie_embeddings=r.bool("tie_word_embeddings", True), sliding_window=window,
      layer_types=types, query_pre_attn_scalar=r.float("query_pre_attn_scalar", 256),
      final_logit_softcap=r.float("final_logit_softcapping", None, allow_none=True), **common)
  return config, meta


def read(checkpoint: str) -> tuple[ModelConfig, dict]:
  """`(ModelConfig, meta)` of `checkpoint/config.json` (see `parse`)."""
  if not isinstance(checkpoint, (str, os.PathLike)):
    raise TypeError(f"checkpoint={checkpoint!r} must be a directory path")
  path = os.path.join(os.fspath(checkpoint), "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"checkpoint={os.fspath(checkpoint)!r} has no config.json")
  return parse(load_json(path), path)
