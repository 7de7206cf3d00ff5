"""Two-tier validation (STYLE habit 7).

`static_validate_*` checks shapes, dtypes and static arguments at trace time and
raises `ValueError`. `dynamic_validate_*` checks concrete values on the host (tests
and the facade's debug mode), never inside the jitted path.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv._config import CacheConfig
from jaxkv._state import CacheState

IMPLEMENTATIONS = ("reference", "mosaic_gpu", "interpret")


def static_validate_implementation(implementation) -> None:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} must be None or one of "
                     f"{IMPLEMENTATIONS}")


def static_validate_attend(config: CacheConfig, layer, q, k, v, *, width: int) -> None:
  """Checks one `attend` call's static facts: layer id, ranks, token counts, heads."""
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
    raise ValueError(f"layer={layer!r} must be a Python int")
  if not 0 <= layer < config.num_layers:
    raise ValueError(f"layer={layer} must be in [0, {config.num_layers})")
  cfg = config.layers[layer]
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.ndim(x) != 3:
      raise ValueError(f"{name} must be [T, heads, head_dim]; got shape {jnp.shape(x)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point; got {name}.dtype={x.dtype}")
  if not q.shape[0] == k.shape[0] == v.shape[0] == width:
    raise ValueError(f"q, k and v must all have T={width} rows; got {q.shape[0]=}, "
                     f"{k.shape[0]=}, {v.shape[0]=}")
  kv_shape = (width, cfg.n_kv_heads, cfg.head_dim)
  if k.shape != kv_shape or v.shape != kv_shape:
    raise ValueError(f"k and v of layer {layer} must be {kv_shape}; got {k.shape=}, "
                     f"{v.shape=}")
  if q.shape[2] != cfg.head_dim:
    raise ValueError(f"q head_dim {q.shape[2]} != layer {layer} head_dim {cfg.head_dim}")
  if q.shape[1] % cfg.n_kv_heads:
    raise ValueError(f"q heads {q.shape[1]} must be a multiple of layer {layer} "
                     f"n_kv_heads={cfg.n_kv_heads}")


def dynamic_validate_state(config: CacheConfig, state: CacheState) -> None:
  """Checks the invariants of SPEC §4.1 on concrete values; raises AssertionError."""
  live, pos, hw = (np.asarray(x) for x in (state.live, state.pos, state.hw))
  held = int(state.held)
  assert set(np.unique(live)) <= {0, 1}, f"live must be 0/1: {live}"
  assert np.all(pos[live == 0] == 0) and np.all(hw[live == 0] == 0), (
      f"non-live columns must have pos = hw = 0: {pos=}, {hw=}, {live=}")
  assert held == int(pos[live == 1].sum()), f"{held=} != sum of live pos {pos}"
  assert held <= config.capacity, f"{held=} > capacity={config.capacity}"
  assert np.all(pos <= hw) and np.all(hw <= config.capacity), f"{pos=}, {hw=}"
  flat = [state.k[l].shape[0] for l, c in enumerate(config.layers) if not c.policy.is_ring]
  if flat:
    assert np.all(hw <= flat[0]), f"hw {hw} exceeds flat rows {flat[0]}"
