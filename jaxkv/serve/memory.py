"""Cache sizing for serving: flat-row growth steps, K/V byte counts and size bounds."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jaxkv import CacheConfig, CacheState, _memory

# Flat growth rounds rows up to this multiple (capped at capacity), a multiple of every
# K/V tile the Mosaic GPU kernels use. They serve any row count, but read one that is not
# a multiple of 8 in one-atom column parts (under one tile, through a padded copy): slower.
ROW_MULTIPLE = 128


def _grown_rows(config: CacheConfig, current: int, needed: int) -> int:
  rows = max(needed, 2 * current)
  return min(config.max_flat_rows, -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE)


def bytes_in_use(config: CacheConfig, positions: Sequence[int]) -> int:
  """K+V bytes that sequences at `positions` occupy (a ring layer holds at most its rows)."""
  total = 0
  for l, layer in enumerate(config.layers):
    per_row = 2 * layer.n_kv_heads * layer.head_dim * config.kv_dtype.itemsize
    cap = config.ring_rows(l) if layer.policy.is_ring else None
    total += per_row * sum(p if cap is None else min(p, cap) for p in positions)
  return total


def storage_bytes(cache: CacheState) -> int:
  """Bytes allocated for K/V storage (all layers, all columns)."""
  return sum(int(math.prod(a.shape)) * a.dtype.itemsize for a in cache.k + cache.v)


# The loop's per-column vectors (prompt_len, length, fed, hold, limit, active, done,
# stopped, temperature, top_k, top_p, seed, sample_index, min_p, the three penalties,
# logprobs, lp_row, and the paged loop's parked, stamp, cached, last_use): 23 x 4 bytes
# per column. The prefix cache's page hashes (`uint32[S, max_len / page_size]`) are at
# most a quarter of the token buffer with pages of 4 or more and are left out.
_PER_COLUMN_BYTES = 23 * 4


def loop_buffer_bytes(max_seqs: int, max_len: int, max_stop: int) -> tuple[int, str]:
  """`(bytes, formula)` of the serving loop's own buffers beside the cache.

  The token buffer `int32[max_seqs, max_len]` dominates; stop tokens are
  `int32[max_seqs, max_stop]`, plus a few int32/float32 vectors per column.
  """
  total = max_seqs * (4 * max_len + 4 * max_stop + _PER_COLUMN_BYTES)
  formula = (f"{max_seqs} columns (max_seqs) x (4 x {max_len} tokens (max_len) + "
             f"4 x {max_stop} stop tokens + {_PER_COLUMN_BYTES} bytes of per-column values)")
  return total, formula


def check_engine_fits(config: CacheConfig, max_len: int, max_stop: int, *, mesh=None,
                      kv_axis: str = "tp") -> None:
  """Raises ValueError, with the byte formula, unless an engine's buffers fit the device.

  Counts the cache (K/V at `initial_flat_rows`, split over `kv_axis` with a
  mesh, plus its control values) and the loop's buffers (`loop_buffer_bytes`).
  Call it before allocating either, e.g. in `Engine.__init__`.
  """
  shards = 1 if mesh is None else int(mesh.shape[kv_axis])
  device = None if mesh is None else mesh.devices.flat[0]
  kv, kv_text = _memory.kv_formula(config, config.initial_flat_rows)
  loop, loop_text = loop_buffer_bytes(config.max_seqs, max_len, max_stop)
  control = _memory.control_bytes(config)
  total = -(-kv // shards) + control + loop
  kv_text = kv_text if shards == 1 else f"({kv_text}) / {shards} shards"
  _memory.check_fits(total, what=f"an engine with max_len={max_len} on this cache",
                     formula=f"K/V {kv_text} + {control} control bytes + loop {loop_text}",
                     device=device)


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
  cost = lambda pages: _memory.kv_formula(sized(pages), 0)
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
