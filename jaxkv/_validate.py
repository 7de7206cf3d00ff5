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
  """Checks the invariants of CONTRACT §4.1 on concrete values; raises AssertionError."""
  live, pos, hw = (np.asarray(x) for x in (state.live, state.pos, state.hw))
  held = int(state.held)
  assert set(np.unique(live)) <= {0, 1}, f"live must be 0/1: {live}"
  assert np.all(pos[live == 0] == 0) and np.all(hw[live == 0] == 0), (
      f"non-live columns must have pos = hw = 0: {pos=}, {hw=}, {live=}")
  assert held == int(pos[live == 1].sum()), f"{held=} != sum of live pos {pos}"
  assert held <= config.capacity, f"{held=} > capacity={config.capacity}"
  assert np.all(pos <= hw) and np.all(hw <= config.seq_len_limit), f"{pos=}, {hw=}"
  flat = [state.k[l].shape[0] for l, c in enumerate(config.layers) if not c.policy.is_ring]
  if flat and not config.is_paged:
    assert np.all(hw <= flat[0]), f"hw {hw} exceeds flat rows {flat[0]}"


def static_validate_int_arg(name: str, x, shape: tuple[int, ...]) -> None:
  """An integer argument of a pure verb: integer dtype and exactly `shape`.

  Python ints are accepted for scalars; floats are refused rather than truncated.
  Concrete values (Python and NumPy ints and arrays) must fit in int32: a NumPy
  int64 `2**32` would otherwise wrap onto id 0. Traced wider ints (x64 on) are
  saturated by the verbs, so they are refused with a status instead.
  """
  if isinstance(x, (bool, np.bool_)):
    raise ValueError(f"{name}={x!r} must be an integer, not a bool")
  if isinstance(x, int) and not shape:
    if not -2**31 <= x < 2**31:
      raise ValueError(f"{name}={x} does not fit in int32")
    return
  dtype = getattr(x, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape {shape}; got "
                     f"dtype {dtype} ({type(x).__name__})")
  if tuple(jnp.shape(x)) != shape:
    raise ValueError(f"{name} must have shape {shape}; got {tuple(jnp.shape(x))}")
  if isinstance(x, (np.ndarray, np.generic)) and x.size:
    lo, hi = int(np.min(x)), int(np.max(x))
    if lo < -2**31 or hi >= 2**31:
      raise ValueError(f"{name} holds {lo if lo < -2**31 else hi}, which does not fit in int32")


def step_width_of(config: CacheConfig, state) -> int:
  """The static token width of `state.step`: `W`, or less for a narrowed view (`narrow_step`)."""
  shape = getattr(getattr(getattr(state, "step", None), "seq_cols", None), "shape", None)
  if shape is None or len(shape) != 1 or not 1 <= shape[0] <= config.step_width:
    raise ValueError(f"state.step.seq_cols has shape {shape}; it must be [w] with "
                     f"1 <= w <= W={config.step_width}")
  return int(shape[0])


def static_validate_state(config: CacheConfig, state) -> None:
  """The state's leaves have the shapes and dtypes `config` implies (CONTRACT §10.2)."""
  if not isinstance(state, CacheState):
    raise TypeError(f"state={type(state).__name__} must be a CacheState")
  if len(state.k) != config.num_layers or len(state.v) != config.num_layers:
    raise ValueError(f"state has {len(state.k)} K and {len(state.v)} V layers; config has "
                     f"{config.num_layers}")
  flat_rows = {a.shape[0] for a, c in zip(state.k, config.layers) if not c.policy.is_ring}
  if config.is_paged:
    flat_rows = {config.max_flat_rows}   # pools are checked by layer_shape below
  if len(flat_rows) > 1:
    raise ValueError(f"state's flat layers disagree on their row count: {sorted(flat_rows)}")
  rows = flat_rows.pop() if flat_rows else 0
  for l in range(config.num_layers):
    expected = config.layer_shape(l, rows)
    for name, a in (("k", state.k[l]), ("v", state.v[l])):
      if a.shape != expected or a.dtype != config.kv_dtype:
        raise ValueError(f"state.{name}[{l}] is {a.dtype}{list(a.shape)}; config needs "
                         f"{config.kv_dtype}{list(expected)}")
  if not 0 < rows <= config.max_flat_rows and config.has_flat:
    raise ValueError(f"state's flat rows {rows} must be in [1, max_flat_rows="
                     f"{config.max_flat_rows}]")
  width, seqs = config.step_width, config.max_seqs
  # The step may be a narrowed view (`narrow_step`): any width up to W, the same for every field.
  step_width = step_width_of(config, state)
  for name, shape in (("live", (seqs,)), ("pos", (seqs,)), ("hw", (seqs,)), ("held", ()),
                      ("phase", ()), ("decl_ids", (width,)), ("decl_block", (width,)),
                      ("decl_n", ()), ("attended", (config.num_layers,)),
                      ("step.seq_cols", (step_width,)),
                      ("step.positions", (step_width,)),
                      ("step.write_rows", (config.num_layers, step_width)),
                      ("step.seq_info", (step_width, 5))):
    leaf = state
    for part in name.split("."):
      leaf = getattr(leaf, part)
    if tuple(leaf.shape) != shape or leaf.dtype != jnp.int32:
      raise ValueError(f"state.{name} is {leaf.dtype}{list(leaf.shape)}; config needs "
                       f"int32{list(shape)}")
  pages = {"page_table": (seqs + 1, config.max_pages_per_seq), "page_refs": (config.num_pages,)}
  for name, shape in pages.items():
    leaf = getattr(state, name)
    if not config.is_paged:
      if leaf is not None:
        raise ValueError(f"state.{name} must be None: the config has no page_size")
    elif leaf is None or tuple(leaf.shape) != shape or leaf.dtype != jnp.int32:
      got = "None" if leaf is None else f"{leaf.dtype}{list(leaf.shape)}"
      raise ValueError(f"state.{name} is {got}; config (page_size={config.page_size}) "
                       f"needs int32{list(shape)}")
  for name in ("k_scale", "v_scale"):
    scales = getattr(state, name)
    if not config.is_fp8:
      if scales is not None:
        raise ValueError(f"state.{name} must be None: kv_dtype={config.kv_dtype} is not fp8")
      continue
    shapes = [(layer.n_kv_heads,) for layer in config.layers]
    got = None if scales is None else [(tuple(a.shape), a.dtype) for a in scales]
    if got != [(shape, np.dtype(np.float32)) for shape in shapes]:
      raise ValueError(f"state.{name} is {got}; kv_dtype={config.kv_dtype} needs one "
                       f"float32[n_kv_heads] per layer: {shapes}")
