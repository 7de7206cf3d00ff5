"""Loading Hugging Face checkpoints into `jaxkv.models` (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3).

A checkpoint directory holds `config.json` and one or more `*.safetensors`
files (with `model.safetensors.index.json` when sharded), read with the
`safetensors` package (NumPy, no torch). A tokenizer comes from
`tokenizer.json` through the optional `tokenizers` package.

Strict: `config.json` is validated key by key (`jaxkv.models.hf_config`: keys
that may change the math and are not understood are refused), and the
checkpoint must hold exactly the tensors the config implies, each with the
implied shape, float and finite. Errors are `ValueError`/`TypeError` naming the
file and the key or tensor.

Scalable: `load_model` builds the model abstractly (`nnx.eval_shape`, no
weights allocated), then reads each parameter lazily from its memory-mapped
file (`safetensors.safe_open`), one device shard at a time, casts it on the host
to the parameter dtype and puts it straight onto its device. No device ever
holds more of a split weight than its shard, and the host holds about one
shard at a time.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _optional
from jaxkv._gemm import resolve_gemm
from jaxkv._sharding import first_device
from jaxkv.models import hf_config
from jaxkv.models.decoder import GEMMA3, Decoder, ModelConfig, param_spec
from jaxkv.models.safetensors_io import FLOAT_DTYPES, Checkpoint

# Derived buffers some exporters save; the config determines them.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# A multimodal Gemma 3 checkpoint's vision tower is not part of the text model.
_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                    "model.multi_modal_projector.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def read_config(checkpoint: str) -> ModelConfig:
  """The `ModelConfig` of a checkpoint's `config.json` (validated strictly; no sizes needed).

  `checkpoint` is a directory or a Hugging Face model id (`resolve_checkpoint`).

  Raises:
    ValueError, TypeError: no config.json, an unsupported `model_type`, a
      missing, mistyped or out-of-range field, or a key that may change the
      math and is not understood (each naming the file and key).
  """
  return hf_config.read(resolve_checkpoint(checkpoint))[0]


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every Hugging Face tensor name the config implies, with its shape (`[out, in]` linears)."""
  h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
  if not config.tie_embeddings:
    out["lm_head.weight"] = (v, h)
  norms = ["input_layernorm", "post_attention_layernorm"]
  if config.arch == GEMMA3:
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
  for l in range(config.num_layers):
    p = f"model.layers.{l}."
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    for proj, shape in shapes.items():
      out[f"{p}self_attn.{proj}.weight"] = shape
      if config.attention_bias and proj != "o_proj":
        out[f"{p}self_attn.{proj}.bias"] = (shape[0],)
    if config.qk_norm is not None:
      out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (
          config.head_dim,)
    out.update({f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h),
                f"{p}mlp.down_proj.weight": (h, i)})
    out.update({f"{p}{n}.weight": (h,) for n in norms})
  return out


def _names(path) -> list[str]:
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  return [n for n in names if n != "value"]


def hf_name(path) -> tuple[str, bool]:
  """`(Hugging Face tensor name, transposed)` of a `Decoder` parameter path."""
  n = _names(path)
  if n == ["embed", "embedding"]:
    return "model.embed_tokens.weight", False
  if n == ["norm", "weight"]:
    return "model.norm.weight", False
  if n == ["lm_head", "kernel"]:
    return "lm_head.weight", True
  if len(n) >= 4 and n[0] == "layers":
    prefix = f"model.layers.{n[1]}."
    if n[2] in ("attn", "mlp") and len(n) == 5:
      module = "self_attn" if n[2] == "attn" else "mlp"
      kind = {"kernel": "weight", "bias": "bias", "weight": "weight"}[n[4]]
      return f"{prefix}{module}.{n[3]}.{kind}", n[4] == "kernel"
    if len(n) == 4 and n[3] == "weight":
      return f"{prefix}{n[2]}.weight", False
  raise RuntimeError(f"no Hugging Face name for the Decoder parameter {'.'.join(n)}")


def check_tensors(ckpt: Checkpoint, config: ModelConfig, *, config_path: str,
                  multimodal: bool = False) -> None:
  """Refuses a checkpoint whose tensors are not exactly those `config` implies.

  Raises:
    ValueError: a tensor missing, of the wrong shape, or left over (naming the
      tensor, its file and the config field that disagrees).
  """
  layers_held = 1 + max((int(m.group(1)) for m in map(_LAYER.match, ckpt.shapes) if m),
                        default=-1)
  if layers_held != config.num_layers:   # before listing a million expected names
    raise ValueError(f"{config_path}: num_hidden_layers={config.num_layers}, but the checkpoint "
                     f"holds {layers_held} layers (model.layers.0-{layers_held - 1})")
  expected = expected_tensors(config)
  for name, shape in expected.items():
    if name not in ckpt.shapes:
      if name == "lm_head.weight":
        raise ValueError(f"{config_path}: tie_word_embeddings is false but the checkpoint has "
                         "no lm_head.weight (transformers would not use the embedding)")
      hint = ""
      if _LAYER.match(name) and layers_held < config.num_layers:
        hint = (f" ({config_path}: num_hidden_layers={config.num_layers}, the checkpoint holds "
                f"{layers_held} layers)")
      raise ValueError(f"checkpoint has no tensor {name!r}, which {config_path} implies{hint}")
    if ckpt.shapes[name] != shape:
      raise ValueError(f"{ckpt.where(name)} has shape {list(ckpt.shapes[name])}; "
                       f"{config_path} implies {list(shape)}")
  for name in ckpt.shapes:
    if name in expected or _DERIVED.fullmatch(name):
      continue
    if multimodal and name.startswith(_VISION_PREFIXES):
      continue
    if name == "lm_head.weight":
      raise ValueError(f"{ckpt.where(name)} is present but {config_path} ties the embeddings "
                       "(tie_word_embeddings); transformers would ignore it")
    hint = ""
    if _LAYER.match(name):
      hint = (f" ({config_path}: num_hidden_layers={config.num_layers}, the checkpoint holds "
              f"{layers_held} layers)")
    raise ValueError(f"{ckpt.where(name)} is not part of the model {config_path} describes"
                     f"{hint}; the checkpoint is refused rather than loaded partially")


# vLLM's `--kv-cache-dtype` spellings of the fp8 K/V formats (CONTRACT §3.2).
FP8_KV_NAMES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
                "fp8_e5m2": jnp.float8_e5m2}


def _dtype(name: str, value, auto, *, fp8: bool = False):
  """A NumPy dtype from `value` ("auto": `auto`); `fp8` also allows the fp8 K/V formats,
  by dtype or by vLLM's names (`FP8_KV_NAMES`)."""
  if isinstance(value, str) and value == "auto":
    return np.dtype(auto)
  if fp8 and isinstance(value, str) and value in FP8_KV_NAMES:
    return np.dtype(FP8_KV_NAMES[value])
  try:
    dtype = np.dtype(value)
  except TypeError:
    raise TypeError(f"{name}={value!r} must be a dtype or 'auto'") from None
  allowed = [np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)]
  if fp8:
    allowed += [np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)]
  if dtype not in allowed:
    extra = ", float8_e4m3fn, float8_e5m2 ('fp8', 'fp8_e4m3', 'fp8_e5m2')" if fp8 else ""
    raise ValueError(f"{name}={value!r} must be float32, bfloat16, float16{extra} or 'auto'")
  return dtype


def _place(ckpt: Checkpoint, name: str, transpose: bool, shape, dtype, sharding):
  """One parameter as a `jax.Array` on `sharding`, read shard by shard from the checkpoint."""
  groups = {}   # devices holding the same slice (replicas) share one host read
  for device, index in sharding.devices_indices_map(tuple(shape)).items():
    key = tuple((s.start, s.stop, s.step) for s in index)
    groups.setdefault(key, (index, []))[1].append(device)
  arrays = []
  for index, devices in groups.values():
    host = ckpt.read(name, tuple(reversed(index)) if transpose else tuple(index), dtype)
    if transpose:
      host = np.ascontiguousarray(host.T)
    arrays += [jax.device_put(host, device) for device in devices]
    del host
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def resolve_dtypes(ckpt: Checkpoint, meta: dict, dtype, param_dtype, kv_dtype):
  """`(dtype, param_dtype, kv_dtype)` as NumPy dtypes, `"auto"` resolved against the checkpoint."""
  auto = meta["dtype"] or FLOAT_DTYPES[ckpt.dtypes["model.embed_tokens.weight"]]
  dtype = _dtype("dtype", dtype, auto)
  param_dtype = dtype if param_dtype is None else _dtype("param_dtype", param_dtype, dtype)
  return dtype, param_dtype, _dtype("kv_dtype", kv_dtype, dtype, fp8=True)


def _cache_config(config: ModelConfig, *, capacity, max_seqs, max_write, kv_dtype,
                  initial_capacity, page_size, max_seq_len, kv_budget_bytes):
  """The load's `jaxkv.CacheConfig`: from `capacity`, or the largest pool `kv_budget_bytes`
  holds."""
  if (capacity is None) == (kv_budget_bytes is None):
    raise ValueError(f"give exactly one of capacity={capacity!r} and "
                     f"kv_budget_bytes={kv_budget_bytes!r}")
  if kv_budget_bytes is None:
    return config.cache_config(capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                               kv_dtype=kv_dtype, initial_capacity=initial_capacity,
                               max_seq_len=max_seq_len, page_size=page_size)
  from jaxkv import _memory   # pylint: disable=g-import-not-at-top
  page = _memory.DEFAULT_PAGE_SIZE if page_size is None else page_size
  # The geometry only: paged_cache_config replaces capacity (a page or max_seq_len here).
  probe = max(page, max_seq_len or 1)
  geometry = config.cache_config(capacity=probe, max_seqs=max_seqs, max_write=max_write,
                                 kv_dtype=kv_dtype, max_seq_len=max_seq_len, page_size=page)
  return _memory.paged_cache_config(geometry, kv_budget_bytes, page_size=page)


def load_model(checkpoint: str, *, max_seqs: int, max_write: int, capacity: int | None = None,
               kv_dtype="auto", dtype="auto", param_dtype=None,
               implementation: str | None = None, initial_capacity: int | None = None,
               gemm: str | None = None, mesh=None, kv_axis: str = "tp",
               page_size: int | None = None, max_seq_len: int | None = None,
               kv_budget_bytes: int | None = None):
  """Builds the checkpoint's model on a fresh cache config and loads its weights.

  The model is built abstractly and each weight read lazily, cast on the host
  and placed straight onto its devices (module docstring). With `mesh`, heads
  and MLP features are split over `kv_axis` (`jaxkv.models.param_spec`) and
  every device receives only its shard; the rest is replicated.

  Args:
    checkpoint: the checkpoint directory, or a Hugging Face model id
      (`resolve_checkpoint`).
    max_seqs, max_write, initial_capacity, max_seq_len: the cache config.
    capacity: cache positions of all sequences; or give `kv_budget_bytes`.
    kv_budget_bytes: instead of `capacity`: K/V bytes, and the paged pool
      with the largest capacity they hold (`jaxkv.serve.paged_cache_config`;
      `page_size` defaults to 64 then). To size everything from device memory,
      use `jaxkv.serve.loading.load_for_serving`.
    page_size: None: column storage; an int: flat layers in a pool of pages of
      that many positions (serve with `jaxkv.serve.Engine(model, prefix_cache=True)`
      to reuse prompt pages).
    kv_dtype: K/V storage dtype, or `"auto"` (the default: the compute dtype); the
      fp8 formats too (`jnp.float8_e4m3fn`, `jnp.float8_e5m2`, or vLLM's names
      `"fp8"`, `"fp8_e4m3"`, `"fp8_e5m2"`; CONTRACT §3.2).
    dtype: computation dtype, or `"auto"` (the default): the checkpoint's
      (`config.json`'s `torch_dtype`/`dtype`, else the embedding tensor's;
      float64 serves as float32).
    param_dtype: parameter dtype; None or `"auto"` follows `dtype`.
    implementation: attention implementation of every layer.
    gemm: the decode-width output/down projection GEMM (`jaxkv.models.Decoder`'s `gemm`).
    mesh, kv_axis: optional tensor parallelism.

  Returns:
    `(model, model_config, cache_config)`.

  Raises:
    ValueError, TypeError: a bad argument, config or checkpoint (named).
  """
  resolve_gemm(gemm, mesh)   # a bad choice is named before the checkpoint is read
  checkpoint = resolve_checkpoint(checkpoint)
  config, meta = hf_config.read(checkpoint)
  with Checkpoint(checkpoint) as ckpt:
    dtype, param_dtype, kv_dtype = resolve_dtypes(ckpt, meta, dtype, param_dtype, kv_dtype)
  cache_config = _cache_config(config, capacity=capacity, max_seqs=max_seqs,
                               max_write=max_write, kv_dtype=kv_dtype,
                               initial_capacity=initial_capacity, page_size=page_size,
                               max_seq_len=max_seq_len, kv_budget_bytes=kv_budget_bytes)
  model = build_decoder(checkpoint, config, meta, cache_config, dtype=dtype,
                        param_dtype=param_dtype, implementation=implementation, gemm=gemm,
                        mesh=mesh, kv_axis=kv_axis)
  return model, config, cache_config


def build_decoder(checkpoint: str, config: ModelConfig, meta: dict, cache_config, *, dtype,
                  param_dtype, implementation, gemm, mesh, kv_axis):
  """The `Decoder` of `config` on `cache_config`, its weights read from `checkpoint`.

  `config, meta` are `hf_config.read(checkpoint)`'s; `dtype`, `param_dtype` as
  `resolve_dtypes` gives them; the rest as `load_model` takes them. Each weight is read
  lazily and placed straight onto its devices.
  """
  from flax import nnx   # pylint: disable=g-import-not-at-top
  config_path = os.path.join(os.fspath(checkpoint), "config.json")
  with Checkpoint(checkpoint) as ckpt:
    check_tensors(ckpt, config, config_path=config_path, multimodal=meta["multimodal"])
    abstract = nnx.eval_shape(lambda: Decoder(
        config, cache_config, dtype=dtype, param_dtype=param_dtype,
        implementation=implementation, gemm=gemm, mesh=mesh, kv_axis=kv_axis,
        rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    expected = expected_tensors(config)
    values = []
    for path, leaf in leaves:
      name, transpose = hf_name(path)
      hf_shape = tuple(reversed(leaf.shape)) if transpose else tuple(leaf.shape)
      if expected.get(name) != hf_shape:   # the model and the name table disagree: a bug
        raise RuntimeError(f"Decoder parameter {name} has shape {hf_shape}; the loader "
                           f"expects {expected.get(name)}")
      sharding = (jax.sharding.NamedSharding(mesh, param_spec(path, kv_axis)) if mesh is not None
                  else first_device())
      values.append(_place(ckpt, name, transpose, leaf.shape, leaf.dtype, sharding))
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))


# What `resolve_checkpoint` fetches of a hub repository: the model, tokenizer and templates.
HUB_FILES = ("config.json", "generation_config.json", "*.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
             "additional_chat_templates/*.jinja")


def _truthy(name: str) -> bool:
  return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_cache_dir() -> str | None:
  """The Hugging Face cache directory the environment names now (`HF_HUB_CACHE`, else
  `HF_HOME/hub`), or None: huggingface_hub's default (`~/.cache/huggingface/hub`)."""
  if os.environ.get("HF_HUB_CACHE"):
    return os.environ["HF_HUB_CACHE"]
  if os.environ.get("HF_HOME"):
    return os.path.join(os.environ["HF_HOME"], "hub")
  return None


def resolve_checkpoint(checkpoint, *, revision: str | None = None) -> str:
  """A checkpoint directory: `checkpoint` itself, or a Hugging Face model id's snapshot.

  A path that is not a directory and reads as a model id (`name` or
  `org/name`) is fetched with `huggingface_hub.snapshot_download`, only the
  `HUB_FILES` (config, safetensors and index, tokenizer files, generation
  config, chat templates), into the cache named by `HF_HUB_CACHE` / `HF_HOME`
  (read at each call). With `HF_HUB_OFFLINE=1` nothing is downloaded: the
  cached snapshot is used, or the error says it is missing.

  Raises:
    TypeError: `checkpoint` is not a path.
    ValueError: no such directory, or the model id cannot be fetched (naming
      the id, the cache directory and whether offline mode is set).
    ImportError: a model id without the `huggingface_hub` package.
  """
  if not isinstance(checkpoint, (str, os.PathLike)):
    raise TypeError(f"checkpoint={checkpoint!r} must be a directory path or a model id")
  path = os.fspath(checkpoint)
  if os.path.isdir(path):
    return path
  if os.path.exists(path):
    raise ValueError(f"checkpoint={path!r} is a file; give the checkpoint's directory")
  looks_local = (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
                 or "\\" in path or not path.strip())
  if looks_local:
    raise ValueError(f"checkpoint={path!r}: no such directory")
  hub = _optional.require("huggingface_hub", f"loading the Hugging Face model id {path!r}")
  from huggingface_hub import errors   # pylint: disable=g-import-not-at-top
  offline = _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE")
  cache = hub_cache_dir()
  where = (f"the Hugging Face cache {cache or '(huggingface_hub default)'}"
           f"{', HF_HUB_OFFLINE is set: nothing is downloaded' if offline else ''}")
  try:
    return hub.snapshot_download(path, revision=revision, cache_dir=cache,
                                 allow_patterns=list(HUB_FILES), local_files_only=offline)
  except errors.HFValidationError as e:
    raise ValueError(f"checkpoint={path!r} is neither a directory nor a valid model id: {e}"
                     ) from None
  except errors.LocalEntryNotFoundError as e:
    raise ValueError(f"checkpoint={path!r} is not a directory, and the model id is not in "
                     f"{where}: {e}") from None
  except (errors.HfHubHTTPError, OSError) as e:
    raise ValueError(f"checkpoint={path!r}: fetching the model id failed ({where}): "
                     f"{type(e).__name__}: {e}") from None


def load_weights(model: Decoder, tensors: dict[str, np.ndarray]) -> None:
  """Copies Hugging Face tensors (a name -> array dict) into `model` in place.

  Raises:
    ValueError: a tensor is missing or has the wrong shape.
  """
  from flax import nnx   # pylint: disable=g-import-not-at-top
  state = nnx.state(model)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  new = []
  for path, leaf in leaves:
    name, transpose = hf_name(path)
    if name not in tensors:
      raise ValueError(f"checkpoint has no tensor {name!r}")
    array = np.asarray(tensors[name])
    array = array.T if transpose else array
    if array.shape != leaf.shape:
      raise ValueError(f"checkpoint tensor {name} has shape {array.shape}; the model expects "
                       f"{leaf.shape}")
    new.append(jax.device_put(jnp.asarray(array, leaf.dtype), leaf.sharding))
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))


def read_tensors(checkpoint: str) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint, as float32 NumPy arrays (whole; for small checkpoints).

  Raises:
    ValueError: no safetensors file, or an unreadable file or tensor (named).
  """
  with Checkpoint(checkpoint) as ckpt:
    return {name: ckpt.read(name) for name in ckpt.shapes}


def load_tokenizer(checkpoint: str):
  """A `tokenizers.Tokenizer` from `tokenizer.json`, or None when the checkpoint has none.

  Raises:
    ImportError: tokenizer.json exists but the `tokenizers` package is missing
      (naming the extra to install).
  """
  path = os.path.join(checkpoint, "tokenizer.json")
  if not os.path.isfile(path):
    return None
  tokenizers = _optional.require("tokenizers", f"reading {path}")
  return tokenizers.Tokenizer.from_file(path)


__all__ = ["HUB_FILES", "build_decoder", "check_tensors", "expected_tensors", "hf_name",
           "hub_cache_dir", "load_model", "load_tokenizer", "load_weights", "read_config",
           "read_tensors", "resolve_checkpoint", "resolve_dtypes"]
