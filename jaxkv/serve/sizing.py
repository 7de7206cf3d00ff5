"""Serving sizes from memory: K/V bytes, sequences at once, max_len (`LLM`, `jaxkv serve`).

`plan_serving` turns a model's geometry and a memory budget into a
`ServingPlan`: the `jaxkv.CacheConfig` an engine serves on, with the numbers
that decided it and the startup lines that report them. It is host arithmetic
only (nothing is allocated, nothing of the server imported); the byte counts
are those of `jaxkv.serve.memory` and `jaxkv._memory`, which the engine checks
again before it allocates.

The rules, in order:

- **K/V budget.** `kv_cache_memory` bytes when given (it is the K/V storage
  itself and, as vLLM's `kv_cache_memory_bytes`, makes `gpu_memory_utilization`
  ignored). Otherwise `gpu_memory_utilization` (default 0.9, vLLM's) of the
  device's memory (`device.memory_stats()["bytes_limit"]`), minus the weights,
  the serving loop's own buffers (`jaxkv.serve.memory.loop_buffer_bytes`), its
  temporaries (the sampler's, `jaxkv.serve.memory.sampler_temp_bytes`, and one
  step's activations at the step width) and the cache's control values. The
  share left over is the headroom for XLA's workspace and what the estimates
  miss (nothing is profiled). A device that reports
  no memory figure (a CPU) counts as `CPU_DEVICE_BYTES` (1 GiB): a CPU run is
  for development and tests, and the host's memory is shared with everything
  else on it.
- **Storage.** Paged (`page_size`, default `DEFAULT_PAGE_SIZE` = 64: a page
  the Mosaic GPU kernels stream at full speed for head dims 64 and 128, whose
  K/V tiles are 128 and 64 rows) unless `page_size=None` (columns), or unless
  the model has no flat layer (every layer a sliding window: ring layers keep
  per-sequence rows, so columns). Prefix caching follows `prefix_caching` on
  paged storage and is off on columns.
- **max_len** (prompt + completion of one request) is the argument, else the
  checkpoint's `max_position_embeddings`; it is never capped silently. If one
  sequence of `max_len` does not fit the budget, ValueError names the argument
  and the numbers.
- **max_seqs** (sequences at once) is the argument, else as many "average"
  sequences of `min(max_len, AVERAGE_SEQ_TOKENS)` (2048) positions as the
  budget holds, at most `MAX_SEQS_BOUND` (256, vLLM's default `max_num_seqs`)
  and `max_write` (a decode step of every sequence then fits one step of the
  widest compiled width), at least 1. Over pages a sequence holds only the pages
  its tokens need and the engine preempts when the pool runs out, so this is a
  concurrency bound, not a reservation.
- **capacity** (cache positions of all sequences together): paged, the largest
  pool the budget holds (`jaxkv.serve.paged_cache_config`), but at most
  `max_seqs * max_len` positions (rounded up to a page): running sequences can
  never hold more. Columns: `max_seqs` columns of `max_len` rows, allocated whole.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from jaxkv import CacheConfig
from jaxkv import _memory
from jaxkv._memory import DEFAULT_PAGE_SIZE
from jaxkv.serve.memory import loop_buffer_bytes, sampler_temp_bytes
from jaxkv.structured.pool import default_capacity, pool_bytes

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_WRITE = 512
CPU_DEVICE_BYTES = 1 << 30
MAX_SEQS_BOUND = 256
AVERAGE_SEQ_TOKENS = 2048
DEFAULT_MAX_STOP_TOKENS = 8   # `jaxkv.serve.Engine`'s default `max_stop_tokens`

# How the refusals and `max_len_source` spell each argument: Python or `jaxkv serve` flags.
_PYTHON = {"max_len": "max_len", "max_seqs": "max_seqs", "page_size": "page_size",
           "kv_cache_memory": "kv_cache_memory",
           "gpu_memory_utilization": "gpu_memory_utilization", "max_write": "max_write"}
_FLAGS = {k: "--" + v.replace("_", "-") for k, v in _PYTHON.items()}
_FLAGS["max_write"] = "--max-write"


@dataclasses.dataclass(frozen=True)
class ServingPlan:
  """What `plan_serving` decided, and from what.

  Attributes:
    cache_config: the `jaxkv.CacheConfig` to build the model on
      (`max_seq_len = max_len`, so `jaxkv.serve.Engine(model, max_len=max_len)`
      accepts it).
    storage: `"paged"` or `"columns"`.
    page_size: positions per page (None on columns).
    capacity: cache positions of all sequences together (`cache_config.capacity`).
    max_seqs: sequences served at once.
    max_len: longest prompt + completion of one request.
    max_len_source: where `max_len` came from: `"max_len argument"` (or
      `"--max-len"`) or `"checkpoint max_position_embeddings"`.
    max_write: the step width W.
    kv_bytes: K/V bytes allocated (every layer, the whole pool or every column).
    kv_budget_bytes: the K/V budget the sizes were fitted to.
    budget_source: how the budget was derived, in words with the numbers.
    weights_bytes: the weights' bytes (subtracted from the device's share unless
      `kv_cache_memory` gave the K/V budget).
    token_capacity: tokens the K/V can hold at once (`capacity`).
    dtype, kv_dtype: names of the compute and K/V dtypes.
    prefix_caching: whether the engine keeps and reuses prompt pages.
    model: a name for the startup lines (the checkpoint path or hub id), or None.
  """

  cache_config: CacheConfig
  storage: str
  page_size: int | None
  capacity: int
  max_seqs: int
  max_len: int
  max_len_source: str
  max_write: int
  kv_bytes: int
  kv_budget_bytes: int
  budget_source: str
  weights_bytes: int
  token_capacity: int
  dtype: str
  kv_dtype: str
  prefix_caching: bool
  model: str | None = None

  def lines(self) -> list[str]:
    """The human-readable startup block, one line each (no trailing newlines)."""
    gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"
    page = f", page size {self.page_size}" if self.page_size is not None else ""
    return [
        f"model: {self.model or '(unnamed)'}",
        f"dtype: {self.dtype} (weights {gib(self.weights_bytes)}), K/V dtype {self.kv_dtype}",
        f"storage: {self.storage}{page}, prefix caching "
        f"{'on' if self.prefix_caching else 'off'}",
        f"K/V: {self.kv_bytes:,} bytes ({gib(self.kv_bytes)}) for {self.token_capacity:,} "
        f"tokens; budget {self.kv_budget_bytes:,} bytes = {self.budget_source}",
        f"max_len: {self.max_len:,} ({self.max_len_source})",
        f"max concurrency: {self.max_seqs} sequences at once (the K/V holds "
        f"{self.token_capacity / self.max_len:.2f}x sequences of max_len); step width "
        f"{self.max_write}",
    ]


def device_memory_bytes(device=None) -> tuple[int, str]:
  """`(bytes, source)`: the device's memory (`bytes_limit`), else `CPU_DEVICE_BYTES`."""
  import jax   # pylint: disable=g-import-not-at-top
  device = jax.devices()[0] if device is None else device
  stats = _memory.device_stats(device)
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"{device.device_kind} bytes_limit"
  return CPU_DEVICE_BYTES, (f"{device.platform} reports no memory figure: "
                            f"CPU_DEVICE_BYTES={CPU_DEVICE_BYTES:,}")


def _positive_int(name: str, value, spelled: str, lo: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{spelled}={value!r} must be an int")
  if value < lo:
    raise ValueError(f"{spelled}={value} must be >= {lo}")
  return int(value)


def _budget(*, names, kv_cache_memory, gpu_memory_utilization, weights_bytes,
            device) -> tuple[int | None, int, str]:
  """`(kv_cache_memory or None, bytes left for K/V + loop + control, source text)`."""
  if kv_cache_memory is not None:
    kv = _positive_int("kv_cache_memory", kv_cache_memory, names["kv_cache_memory"])
    return kv, kv, f"{names['kv_cache_memory']}={kv:,} bytes"
  util = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else (
      gpu_memory_utilization)
  where = names["gpu_memory_utilization"]
  if isinstance(util, bool) or not isinstance(util, (int, float, np.floating)):
    raise TypeError(f"{where}={util!r} must be a number")
  if not 0 < util <= 1:
    raise ValueError(f"{where}={util} must be in (0, 1]")
  memory, source = device_memory_bytes(device)
  left = int(util * memory) - weights_bytes
  text = (f"{util} x {memory:,} bytes ({source}) - {weights_bytes:,} bytes of weights")
  if left <= 0:
    raise ValueError(f"no memory is left for the K/V cache: {text} = {left:,} bytes; raise "
                     f"{where} or give {names['kv_cache_memory']}")
  return None, left, text


def _step_bytes(model_config, max_write: int) -> int:
  """An upper estimate of one step's activations: float32 rows of the residual stream and
  attention (8 x hidden), the MLP (3 x intermediate) and the logits (vocab) per token."""
  per_token = (8 * model_config.hidden_size + 3 * model_config.intermediate_size
               + model_config.vocab_size)
  return max_write * per_token * 4


def _geometry(model_config, *, kv_dtype, max_write, max_len, max_seqs, page_size,
              capacity) -> CacheConfig:
  return model_config.cache_config(capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                                   kv_dtype=kv_dtype, initial_capacity=max_len,
                                   max_seq_len=max_len, page_size=page_size)


def _flat_token_bytes(config: CacheConfig) -> int:
  """K+V bytes of one position over every flat layer."""
  item = config.kv_dtype.itemsize
  return sum(2 * l.n_kv_heads * l.head_dim * item for l in config.layers if not l.policy.is_ring)


def _ring_column_bytes(config: CacheConfig) -> int:
  """K+V bytes of one sequence's column over every ring layer."""
  item = config.kv_dtype.itemsize
  return sum(2 * config.ring_rows(i) * l.n_kv_heads * l.head_dim * item
             for i, l in enumerate(config.layers) if l.policy.is_ring)


def _derived_max_seqs(tokens: int, max_len: int, max_write: int) -> int:
  """The documented rule: average sequences of `min(max_len, AVERAGE_SEQ_TOKENS)` that fit."""
  return max(1, min(MAX_SEQS_BOUND, max_write, tokens // min(max_len, AVERAGE_SEQ_TOKENS)))


def _fit(config: CacheConfig, budget: int, *, paged: bool, fixed_kv: bool,
         shards: int, grammar_bytes: int = 0, temp_bytes: int = 0) -> tuple[int, int]:
  """`(K/V budget, capacity)` for `config`'s `max_seqs`: `budget` (per device) less the loop's
  buffers, `temp_bytes` of temporaries and the control values (unless the budget is K/V
  only), times `shards`, and the largest capacity it holds."""
  kv = budget
  if not fixed_kv:
    kv -= loop_buffer_bytes(config.max_seqs, config.max_seq_len, DEFAULT_MAX_STOP_TOKENS,
                            grammar_bytes)[0]
    kv -= temp_bytes
    # Control values grow with the pool's pages: count them at the most pages the budget holds.
    most = max(kv // max(_flat_token_bytes(config), 1), config.max_seq_len)
    kv -= _memory.control_bytes(dataclasses.replace(config, capacity=most))
  kv *= shards   # each device holds 1/shards of every layer's K/V heads
  if not paged:
    per_column = config.max_seq_len * _flat_token_bytes(config) + _ring_column_bytes(config)
    return kv, (config.max_seq_len if kv >= (config.max_seqs + 1) * per_column else 0)
  ceiling = -(-config.max_seqs * config.max_seq_len // config.page_size) * config.page_size
  try:
    sized = _memory.paged_cache_config(
        dataclasses.replace(config, max_seq_len=None), kv, page_size=config.page_size)
  except ValueError:   # not even one page beyond the scratch page
    return kv, 0
  return kv, min(sized.capacity, ceiling)


def plan_serving(model_config, *, dtype, kv_dtype, weights_bytes: int, max_len: int | None = None,
                 max_seqs: int | None = None, page_size: int | None = DEFAULT_PAGE_SIZE,
                 kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float | None = None,
                 max_write: int = DEFAULT_MAX_WRITE, device=None, prefix_caching: bool = True,
                 model: str | None = None, flags: bool = False,
                 shards: int = 1) -> ServingPlan:
  """Sizes a serving engine from a memory budget (module docstring: the rules).

  Args:
    model_config: the `jaxkv.models.ModelConfig` (its `max_position_embeddings`
      is the default `max_len`).
    dtype, kv_dtype: compute and K/V dtypes (resolved: no `"auto"`).
    weights_bytes: bytes of the parameters on the device.
    max_len: longest prompt + completion; default the checkpoint's.
    max_seqs: sequences at once; default derived from the budget.
    page_size: positions per page; None: column storage.
    kv_cache_memory: K/V bytes; wins over `gpu_memory_utilization`.
    gpu_memory_utilization: fraction of the device's memory this engine may
      use (weights included); default 0.9.
    max_write: the step width W (tokens per step).
    device: the device sized for (default the first).
    prefix_caching: keep and reuse prompt pages (paged storage only).
    model: a name for `ServingPlan.lines`.
    flags: spell arguments as `jaxkv serve` flags (`--max-len`) in messages.
    shards: devices the K/V heads are split over (tensor parallelism): the
      budget (`kv_cache_memory` too, as vLLM's is per GPU) is per device, so
      the K/V hold `shards` times more; `weights_bytes` is then per device.

  Returns:
    The `ServingPlan`.

  Raises:
    TypeError: an argument of the wrong kind (named).
    ValueError: a bad value, a model without `max_position_embeddings` and no
      `max_len`, or a budget that cannot hold one sequence of `max_len` (the
      message names the argument and gives the numbers).
  """
  names = _FLAGS if flags else _PYTHON
  max_write = _positive_int("max_write", max_write, names["max_write"])
  if not isinstance(prefix_caching, bool):
    raise TypeError(f"prefix_caching={prefix_caching!r} must be a bool")
  if max_len is None:
    max_len = getattr(model_config, "max_position_embeddings", None)
    if max_len is None:
      raise ValueError(f"the checkpoint's config.json has no max_position_embeddings: give "
                       f"{names['max_len']}")
    source = "checkpoint max_position_embeddings"
  else:
    source = "--max-len" if flags else "max_len argument"
  max_len = _positive_int("max_len", max_len, names["max_len"], lo=2)
  trained = getattr(model_config, "max_position_embeddings", None)
  if trained is not None and max_len > trained:
    # Positions past the checkpoint's context were never trained: refused, not served wrong.
    raise ValueError(f"{names['max_len']}={max_len} is past the checkpoint's "
                     f"max_position_embeddings={trained}; give at most {trained}")
  if max_seqs is not None:
    max_seqs = _positive_int("max_seqs", max_seqs, names["max_seqs"])
  paged = page_size is not None
  if paged:
    page_size = _positive_int("page_size", page_size, names["page_size"])
  if not any(t == "full" for t in model_config.layer_types):
    paged = False   # only ring layers: nothing to page
  weights_bytes = _positive_int("weights_bytes", weights_bytes, "weights_bytes", lo=0)
  shards = _positive_int("shards", shards, "shards")
  kv_dtype, dtype = np.dtype(kv_dtype), np.dtype(dtype)
  fixed, budget, budget_text = _budget(
      names=names, kv_cache_memory=kv_cache_memory,
      gpu_memory_utilization=gpu_memory_utilization, weights_bytes=weights_bytes, device=device)
  step = _step_bytes(model_config, max_write)
  memory, memory_source = device_memory_bytes(device)
  if weights_bytes + step > memory:
    raise ValueError(f"{names['max_write']}={max_write} does not fit: one step of that many "
                     f"tokens needs about {step:,} bytes of activations (max_write x (8 x hidden "
                     f"+ 3 x intermediate + vocab) x 4 bytes) beside {weights_bytes:,} bytes of "
                     f"weights, and the device has {memory:,} ({memory_source}); give a smaller "
                     f"{names['max_write']}")
  def geometry(seqs, capacity):
    capacity = max(capacity, page_size) if paged else capacity   # a page fits the pool
    # A step never carries more tokens than the pool holds (a CacheConfig rule).
    return _geometry(model_config, kv_dtype=kv_dtype, max_write=min(max_write, capacity),
                     max_len=max_len, max_seqs=seqs, page_size=page_size if paged else None,
                     capacity=capacity)
  probe = geometry(1, max_len)
  per_seq = max_len * _flat_token_bytes(probe) + _ring_column_bytes(probe)
  seqs = max_seqs
  if seqs is None:
    tokens = budget * shards // max(per_seq // max_len, 1)
    seqs = _derived_max_seqs(tokens, max_len, max_write)
  while True:
    config = geometry(seqs, max_len)
    kv_budget, capacity = _fit(config, budget, paged=paged, fixed_kv=fixed is not None,
                               shards=shards, grammar_bytes=pool_bytes(
                                   model_config.vocab_size,
                                   default_capacity(model_config.vocab_size)),
                               temp_bytes=sampler_temp_bytes(
                                   seqs, max_len, model_config.vocab_size)
                               + _step_bytes(model_config, config.max_write))
    if capacity >= max_len or max_seqs is not None or seqs == 1:
      break
    seqs -= 1   # a derived count that leaves too little for one max_len sequence: fewer
  if capacity < max_len:
    what = (f"{names['max_len']}={max_len} ({source})" if max_seqs is None else
            f"{names['max_seqs']}={max_seqs} sequences of {names['max_len']}={max_len} "
            f"({source})")
    raise ValueError(
        f"{what} does not fit: one sequence of max_len needs {per_seq:,} bytes of K/V "
        f"({max_len} positions x {_flat_token_bytes(probe)} bytes over the flat layers + "
        f"{_ring_column_bytes(probe)} bytes of ring rows); the K/V budget is "
        f"{kv_budget:,} bytes = {budget_text}"
        f"{'' if fixed is not None else ' - the loop buffers, temporaries and control values'}. "
        f"Give a smaller {names['max_len']}"
        f"{'' if max_seqs is None else ' or ' + names['max_seqs']}, or more memory "
        f"({names['kv_cache_memory']} or {names['gpu_memory_utilization']})")
  if not paged:
    capacity = seqs * max_len
  if fixed is None:
    budget_text += (f" - {budget - kv_budget // shards:,} bytes of loop buffers, temporaries "
                    "and control values")
  if shards > 1:
    budget_text = f"{shards} devices x ({budget_text})"
  config = geometry(seqs, capacity)
  kv_bytes = _memory.kv_formula(config, config.initial_flat_rows)[0]
  return ServingPlan(
      cache_config=config, storage="paged" if paged else "columns",
      page_size=page_size if paged else None, capacity=capacity, max_seqs=seqs,
      max_len=max_len, max_len_source=source, max_write=config.max_write, kv_bytes=kv_bytes,
      kv_budget_bytes=kv_budget, budget_source=budget_text,
      weights_bytes=weights_bytes, token_capacity=capacity,
      dtype=dtype.name, kv_dtype=kv_dtype.name, prefix_caching=paged and prefix_caching,
      model=model)


__all__ = ["AVERAGE_SEQ_TOKENS", "CPU_DEVICE_BYTES", "DEFAULT_GPU_MEMORY_UTILIZATION",
           "DEFAULT_MAX_WRITE", "DEFAULT_PAGE_SIZE", "MAX_SEQS_BOUND", "ServingPlan",
           "device_memory_bytes", "plan_serving"]
