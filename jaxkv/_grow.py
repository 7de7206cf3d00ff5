"""Flat growth (CONTRACT §3): host-only, shapes change, so it is not a jitted verb.

Column-stored flat layers grow to more rows; paged flat layers never grow (their
pool is allocated whole, CONTRACT §3.1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv._config import CacheConfig
from jaxkv._memory import check_state_fits
from jaxkv._state import CacheState, flat_rows
from jaxkv._validate import static_validate_state


def grown_array(array, rows: int):
  """A new `[rows, ...]` array whose first rows are `array`'s bytes, the rest zero.

  The result keeps `array`'s sharding, built in place on each device.
  """
  return _grow_rows(rows, array.sharding)(array)


@functools.lru_cache(maxsize=64)
def _grow_rows(rows: int, sharding):
  def grow_one(array):
    # Zero rows appended along the unsharded row axis: each device pads its own
    # heads, so a head-sharded cache stays sharded with no collective.
    extra = [(0, rows - array.shape[0])] + [(0, 0)] * (array.ndim - 1)
    return jnp.pad(array, extra)
  return jax.jit(grow_one, out_shardings=sharding)


def grow(config: CacheConfig, state: CacheState, rows: int, *, allocate=grown_array):
  """A new state whose flat layers have `rows` rows (host only: shapes change).

  Transactional: every new array is built before the result is assembled, so if
  an allocation raises, the error propagates and `state` is untouched. Rows
  `[0, F)` keep their bytes exactly; new rows are zero. Not donated.

  Raises:
    ValueError: no flat layer, not `F < rows <= max_flat_rows` (`capacity`, or
      `max_seq_len` when set), or the new flat
      arrays would not fit in the device's free memory (checked before
      allocating; the message gives the byte formula).
  """
  if not isinstance(config, CacheConfig):
    raise TypeError(f"config={config!r} must be a CacheConfig")
  static_validate_state(config, state)
  current = flat_rows(config, state)
  if not config.has_flat:
    raise ValueError("grow needs a flat layer; this config has only rings")
  if config.is_paged:
    raise ValueError(f"grow does not apply to paged storage (page_size={config.page_size}): "
                     "the page pool is allocated whole, for the full capacity")
  if isinstance(rows, bool) or not isinstance(rows, int):
    raise TypeError(f"rows={rows!r} must be a Python int")
  if not current < rows <= config.max_flat_rows:
    bound = ("capacity" if config.max_seq_len is None else "max_seq_len")
    raise ValueError(f"rows={rows} must satisfy F={current} < rows <= "
                     f"{bound}={config.max_flat_rows}")
  flat = [l for l, layer in enumerate(config.layers) if not layer.policy.is_ring]
  first = state.k[flat[0]]
  # A head-split layer holds 1/shards of its heads on each device.
  shards = first.shape[2] // first.sharding.shard_shape(first.shape)[2]
  devices = sorted(first.sharding.device_set, key=lambda d: d.id)
  # The old arrays stay alive while the new ones are built, so only the new count.
  check_state_fits(config, rows, layers=flat, shards=shards, device=devices[0], control=False)
  new_k, new_v = list(state.k), list(state.v)
  for l in flat:
    new_k[l] = allocate(state.k[l], rows)
    new_v[l] = allocate(state.v[l], rows)
  return dataclasses.replace(state, k=tuple(new_k), v=tuple(new_v))
