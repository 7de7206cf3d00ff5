"""The checkpoint-to-engine path: a checkpoint sized from device memory, loaded, served.

`load_for_serving` reads a checkpoint's config, sizes its cache from memory
(`sizing.plan_serving`), loads the weights onto it (`jaxkv.models.hf`) and
returns `(model, tokenizer, plan)`; `build_engine` builds the `Engine` on top (a
`Served`), the one way `jaxkv serve` (`cli.build_server`) and `jaxkv.LLM` make theirs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import numpy as np

from jaxkv import tokenizer as tokenizer_lib
from jaxkv.models import hf, hf_config
from jaxkv.models.safetensors_io import Checkpoint
from jaxkv.serve import sizing
from jaxkv.serve.engine import Engine
from jaxkv.serve.parallel import DataParallelEngine
from jaxkv.serve.sizing import DEFAULT_MAX_WRITE, DEFAULT_PAGE_SIZE


DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "jaxkv", "jax")


def use_compilation_cache(directory: str | None) -> str | None:
  """Points JAX's persistent compilation cache at `directory` (None or `none`: off); the
  directory used. `jaxkv serve` and `jaxkv.LLM` use it, so a restart compiles nothing new."""
  if directory is None or directory.lower() == "none":
    return None
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  # The serving loop and its helpers: every compile is worth keeping across restarts.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return directory


def load_for_serving(checkpoint: str, *, dtype="auto", kv_cache_dtype="auto",
                     max_len: int | None = None, max_seqs: int | None = None,
                     page_size: int | None = DEFAULT_PAGE_SIZE,
                     kv_cache_memory: int | None = None,
                     gpu_memory_utilization: float | None = None, prefix_caching: bool = True,
                     max_write: int = DEFAULT_MAX_WRITE, implementation: str | None = None,
                     mesh=None, kv_axis: str = "tp", flags: bool = False):
  """`(model, tokenizer, plan)`: a checkpoint sized from memory, ready for `jaxkv.serve.Engine`.

  The one place a checkpoint and serving sizes become a model (`build_engine`
  calls it for `jaxkv.LLM` and `jaxkv serve`). The sizes come from `sizing.plan_serving` (its
  docstring: the rules); serve the model with
  `Engine(model, max_len=plan.max_len, prefix_cache=plan.prefix_caching)`.

  Args:
    checkpoint: a directory or a Hugging Face model id (`jaxkv.models.hf.resolve_checkpoint`).
    dtype, kv_cache_dtype: compute and K/V dtypes, `"auto"`: the checkpoint's
      (K/V: the compute dtype).
    max_len, max_seqs, page_size, kv_cache_memory, gpu_memory_utilization,
      prefix_caching, max_write, flags: `plan_serving`'s.
    implementation: attention implementation of every layer (None: automatic).
    mesh, kv_axis: optional tensor parallelism (K/V and weights split over
      `kv_axis`; the budget is per device, so the pool holds that many times more).

  Returns:
    `(model, tokenizer, plan)`: the `Decoder`, the `jaxkv.tokenizer.Tokenizer`
    (None when the checkpoint has no tokenizer.json) and the `ServingPlan`.

  Raises:
    ValueError, TypeError: a bad checkpoint or size (named).
    ImportError: an optional package a hub id or the tokenizer needs.
  """
  name = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else None
  directory = hf.resolve_checkpoint(checkpoint)
  config, meta = hf_config.read(directory)
  with Checkpoint(directory) as ckpt:
    dtype, param_dtype, kv_dtype = hf.resolve_dtypes(ckpt, meta, dtype, None, kv_cache_dtype)
  shards = 1 if mesh is None else int(mesh.shape[kv_axis])
  weights = config.num_params * param_dtype.itemsize
  plan = sizing.plan_serving(
      config, dtype=dtype, kv_dtype=kv_dtype, weights_bytes=-(-weights // shards),
      max_len=max_len, max_seqs=max_seqs, page_size=page_size, kv_cache_memory=kv_cache_memory,
      gpu_memory_utilization=gpu_memory_utilization, max_write=max_write,
      device=None if mesh is None else mesh.devices.flat[0], prefix_caching=prefix_caching,
      model=name, flags=flags, shards=shards)
  tokenizer = (tokenizer_lib.Tokenizer.from_checkpoint(directory)
               if os.path.isfile(os.path.join(directory, "tokenizer.json")) else None)
  if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
    raise ValueError(f"{name}: the tokenizer has {tokenizer.vocab_size} tokens; config.json's "
                     f"vocab_size is {config.vocab_size}")
  model = hf.build_decoder(directory, config, meta, plan.cache_config, dtype=dtype,
                 param_dtype=param_dtype, implementation=implementation, gemm=None, mesh=mesh,
                 kv_axis=kv_axis)
  return model, tokenizer, plan


class Served(NamedTuple):
  """What `build_engine` makes of a checkpoint."""
  engine: Engine | DataParallelEngine
  model: object       # the `Decoder` the (first) engine serves
  tokenizer: object   # the `jaxkv.tokenizer.Tokenizer`, None without tokenizer.json
  plan: sizing.ServingPlan


def build_engine(checkpoint: str, *, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 max_logprobs: int | None = None, scheduling: str = "fcfs",
                 need_tokenizer: bool = False, speculative=None, **load) -> Served:
  """`load_for_serving(checkpoint, **load)` and the `Engine` on its model (a `Served`).

  Args:
    checkpoint: a directory or a Hugging Face model id.
    tensor_parallel_size: devices each engine's weights and K/V are split over (a mesh of
      that many local devices, axis `"tp"`).
    data_parallel_size: engines, each with its own copy of the weights and its own cache
      on its own `tensor_parallel_size` devices; more than one: a `DataParallelEngine`.
      Each engine is sized as one would be (the budget is per device).
    max_logprobs, scheduling, speculative: the `Engine`'s.
    need_tokenizer: refuse a checkpoint without tokenizer.json (a server decodes text).
    **load: `load_for_serving`'s sizing and dtype arguments.

  Raises:
    ValueError, TypeError: a bad checkpoint, size or device count (named).
  """
  tp, dp = tensor_parallel_size, data_parallel_size
  for name, value in (("tensor_parallel_size", tp), ("data_parallel_size", dp)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"{name}={value!r} must be an int")
    if value < 1:
      raise ValueError(f"{name}={value} must be >= 1")
  devices = jax.local_devices()
  if tp * dp > len(devices):
    raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} = {tp * dp} devices; "
                     f"this host has {len(devices)} local devices")
  groups = [devices[g * tp:(g + 1) * tp] for g in range(dp)]
  kwargs = lambda plan: dict(max_len=plan.max_len, max_logprobs=max_logprobs,
                             prefix_cache=plan.prefix_caching, scheduling=scheduling,
                             speculative=speculative)
  if tp == 1:   # the weights loaded once; data parallel engines copy them to their devices
    model, tokenizer, plan = load_for_serving(checkpoint, **load)
    engine = (Engine(model, **kwargs(plan)) if dp == 1 else
              DataParallelEngine(model, devices=[g[0] for g in groups], **kwargs(plan)))
  else:   # each group its own mesh, the weights loaded onto it
    loads = [load_for_serving(checkpoint, mesh=jax.sharding.Mesh(np.array(g), ("tp",)), **load)
             for g in groups]
    model, tokenizer, plan = loads[0]
    engines = [Engine(m, **kwargs(p)) for m, _, p in loads]
    engine = engines[0] if dp == 1 else DataParallelEngine.of(engines)
  if tokenizer is None and need_tokenizer:
    path = os.path.join(hf.resolve_checkpoint(checkpoint), "tokenizer.json")
    raise ValueError(f"{path} does not exist: the server needs the checkpoint's tokenizer")
  return Served(engine, model, tokenizer, plan)
