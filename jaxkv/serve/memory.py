"""Cache sizing for serving: flat-row growth steps and K/V byte counts."""

from __future__ import annotations

import math
from typing import Sequence

from jaxkv import CacheConfig, CacheState

# Flat growth rounds rows up to this multiple (capped at capacity): the Mosaic GPU
# kernels need a row count that is a multiple of 8 and at least their key block
# (128), and refuse (falling back to the reference) otherwise.
ROW_MULTIPLE = 128


def _grown_rows(config: CacheConfig, current: int, needed: int) -> int:
  rows = max(needed, 2 * current)
  return min(config.capacity, -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE)


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
