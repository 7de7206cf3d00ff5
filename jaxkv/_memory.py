"""Size bounds: what a cache costs in bytes, and whether the device can hold it.

Allocating an absurd cache (a typo in `max_seqs`, `2**31` rows) should fail at
once with the arithmetic in the message, not after minutes of paging or with an
allocator error naming no argument. `check_fits` compares a byte count with
what the device can still hold: `bytes_limit - bytes_in_use` from
`device.memory_stats()` where the backend reports it (GPUs), else the host's
available memory (CPU arrays live there).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxkv._config import CacheConfig


def device_stats(device=None) -> dict | None:
  """`device.memory_stats()` (default device: the first), or None where the backend has none."""
  device = jax.devices()[0] if device is None else device
  try:
    return device.memory_stats()
  except (AttributeError, NotImplementedError, RuntimeError):   # backends without stats
    return None


def available_bytes(device=None) -> tuple[int, str]:
  """`(bytes, source)`: memory `device` can still hold, and where the figure comes from."""
  device = jax.devices()[0] if device is None else device
  stats = device_stats(device)
  if stats and "bytes_limit" in stats:
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return free, f"{device.device_kind} bytes_limit - bytes_in_use"
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024, "host MemAvailable"
  except OSError:
    pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host physical memory"


def check_fits(nbytes: int, *, what: str, formula: str, device=None) -> None:
  """Raises ValueError when `nbytes` exceed what `device` can still hold.

  Args:
    nbytes: bytes about to be allocated.
    what: the thing allocated, for the message (e.g. "the cache of CacheConfig(...)").
    formula: how `nbytes` was computed, with the numbers filled in.
  """
  free, source = available_bytes(device)
  if nbytes > free:
    raise ValueError(f"{what} needs {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB) = {formula}; "
                     f"the device can hold {free:,} bytes ({source})")


def is_tracing() -> bool:
  """Whether array creation here is traced (under `jax.eval_shape` or `jit`): nothing
  is allocated then, so no bound applies."""
  return isinstance(jnp.zeros(()), jax.core.Tracer)


def kv_formula(config: CacheConfig, flat_rows: int, layers=None) -> tuple[int, str]:
  """`(bytes, formula)` of the K/V storage of `layers` (default all) with `flat_rows`.

  Each layer holds K and V of `[rows, max_seqs + 1, n_kv_heads, head_dim]`;
  layers of one geometry are grouped in the formula. An fp8 cache stores one byte
  per element plus a float32 scale per layer and KV head for K and for V
  (CONTRACT §3.2), counted here too: a byte budget holds twice bfloat16's tokens,
  less those few bytes.
  """
  layers = range(config.num_layers) if layers is None else layers
  groups: dict[tuple[int, ...], int] = {}
  for l in layers:
    key = config.layer_shape(l, flat_rows)
    groups[key] = groups.get(key, 0) + 1
  item = config.kv_dtype.itemsize
  total, terms = 0, []
  paged = {config.layer_shape(l, flat_rows) for l in layers if config.is_paged_layer(l)}
  for shape, count in groups.items():
    rows, cols, heads, dim = shape
    total += count * 2 * rows * cols * heads * dim * item
    if shape in paged:
      what = f"{rows} pages (ceil(capacity / page_size) + max_seqs + 1) x {cols} page_size"
    else:
      what = f"{rows} rows x {cols} columns (max_seqs + 1)"
    terms.append(f"{count} layers x 2 (K, V) x {what} x "
                 f"{heads} kv heads x {dim} head_dim x {item} bytes")
  if config.is_fp8:
    heads = sum(config.layers[l].n_kv_heads for l in layers)
    total += 2 * heads * 4
    terms.append(f"2 (K, V) x {heads} kv heads (all layers) x 4 bytes (fp8 scales)")
  return total, " + ".join(terms)


def control_bytes(config: CacheConfig) -> int:
  """Bytes of the int32 control leaves: `live/pos/hw [S]`, declaration and Step `[W]`, ..."""
  s, w, n = config.max_seqs, config.step_width, config.num_layers
  pages = (s + 1) * config.max_pages_per_seq + config.num_pages   # page table + refs
  return 4 * (3 * s + 5 + n + w * (2 + 2 + n + 5) + pages)


def state_bytes(config: CacheConfig, flat_rows: int | None = None) -> int:
  """Bytes of a whole `CacheState` with `flat_rows` (default the initial ones)."""
  rows = config.initial_flat_rows if flat_rows is None else flat_rows
  return kv_formula(config, rows)[0] + control_bytes(config)


def check_state_fits(config: CacheConfig, flat_rows: int, *, shards: int = 1,
                     layers=None, device=None, control: bool = True) -> None:
  """Raises ValueError (with the formula) unless a state of `flat_rows` fits on `device`.

  Args:
    shards: devices the K/V heads are split over (each holds `1/shards` of K/V).
    layers: the layers allocated (default all); growth allocates only flat layers.
    control: count the control leaves too.
  """
  if is_tracing():
    return
  kv, formula = kv_formula(config, flat_rows, layers)
  total = -(-kv // shards)
  if shards > 1:
    formula = f"({formula}) / {shards} shards"
  if control:
    total += control_bytes(config)
    formula += (f" + {control_bytes(config)} control bytes (int32 live/pos/hw per sequence, "
                f"declaration and Step per step token)")
  check_fits(total, what=(f"a cache of {flat_rows} flat rows (max_seqs={config.max_seqs}, "
                          f"max_write={config.max_write}, {config.num_layers} layers)"),
             formula=formula, device=device)


# The page size of a pool sized from a byte budget, unless one is given (`jaxkv serve`'s).
DEFAULT_PAGE_SIZE = 64


def paged_cache_config(config: CacheConfig, kv_budget_bytes: int, *,
                       page_size: int | None = None) -> CacheConfig:
  """The paged `CacheConfig` with the largest `capacity` whose K/V fit `kv_budget_bytes`.

  Layers, `max_seqs`, `max_write`, `kv_dtype` and `max_seq_len` come from
  `config` (a `max_seq_len` narrows the page table: set it to the longest
  request the engine serves); the pool
  then holds `ceil(capacity / page_size) + max_seqs + 1` pages per flat layer
  (CONTRACT §3.1), so K/V bytes are `num_pages x page bytes` over the flat
  layers plus the ring layers' fixed columns. `capacity` is a multiple of
  `page_size`. Build the model on the result (`Decoder(model_config, result)`)
  and serve it with `Engine`: admission follows claims and preemption, so the
  budget, not the longest request, sets how many requests run at once.

  Args:
    config: a `CacheConfig` giving the geometry (its capacity is ignored).
    kv_budget_bytes: bytes for K and V storage of all layers.
    page_size: positions per page (default `config.page_size`, else 16).

  Raises:
    TypeError: a non-int budget or page size.
    ValueError: a budget too small for one page per sequence beyond the scratch
      page (the message gives the byte formula of the smallest pool), or for
      `config.max_seq_len` positions.
  """
  if not isinstance(config, CacheConfig):
    raise TypeError(f"config={config!r} must be a CacheConfig")
  page = (config.page_size or 16) if page_size is None else page_size
  for name, value in (("kv_budget_bytes", kv_budget_bytes), ("page_size", page)):
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"{name}={value!r} must be an int")
  if page < 1:
    raise ValueError(f"page_size={page} must be >= 1")
  if not config.has_flat:
    raise ValueError("paged storage needs a flat layer; every layer of config is a ring")
  # A `max_seq_len` above a candidate's capacity is clipped while searching; the result
  # must hold it whole (checked below).
  sized = lambda pages: dataclasses.replace(
      config, capacity=pages * page, page_size=page,
      initial_capacity=min(config.initial_capacity, pages * page),
      max_seq_len=None if config.max_seq_len is None else min(config.max_seq_len, pages * page))
  cost = lambda pages: kv_formula(sized(pages), 0)
  # The smallest pool holds one step's tokens (`max_write <= capacity`).
  least = max(1, -(-config.max_write // page))
  smallest, formula = cost(least)
  if smallest > kv_budget_bytes:
    raise ValueError(f"kv_budget_bytes={kv_budget_bytes:,} is below the smallest paged cache "
                     f"(capacity = {least * page}, one step of max_write={config.max_write} "
                     f"in pages of {page}): {smallest:,} bytes = {formula}")
  lo, hi = least, max(least + 1, (2**31 - 1) // page)   # K/V bytes grow with pages: bisect
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if cost(mid)[0] <= kv_budget_bytes:
      lo = mid
    else:
      hi = mid - 1
  result = sized(lo)
  if config.max_seq_len is not None and result.capacity < config.max_seq_len:
    raise ValueError(f"kv_budget_bytes={kv_budget_bytes:,} holds capacity={result.capacity} "
                     f"positions, below config.max_seq_len={config.max_seq_len}")
  return result
