"""Configuration: validation (CONTRACT §2, scenario 39), value semantics and derived properties."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

flat = jaxkv.LayerPolicy.flat
ring = jaxkv.LayerPolicy.ring


def layer(policy=None, n_kv_heads=2, head_dim=8):
  return jaxkv.LayerConfig(flat() if policy is None else policy, n_kv_heads, head_dim)


def config(**overrides):
  kwargs = dict(layers=[layer()], capacity=32, max_seqs=4, max_write=8, kv_dtype=jnp.float16,
                initial_capacity=32)
  kwargs.update(overrides)
  return jaxkv.CacheConfig(**kwargs)


def names(field: str, value: str) -> str:
  """A regex requiring the message to name `field` and then its `value` (CONTRACT §2)."""
  return rf"(?s)\b{re.escape(field)}\b.*{re.escape(value)}"


# --------------------------------------------------------------------------- scenario 39


@pytest.mark.parametrize(
    "build, field, value",
    [
        pytest.param(lambda: ring(0), "window", "0", id="ring0"),
        pytest.param(lambda: ring(-1), "window", "-1", id="ring-1"),
        pytest.param(lambda: jaxkv.LayerPolicy(kind="flat", window=3), "window", "3", id="flat-window3"),
        pytest.param(lambda: jaxkv.LayerPolicy(kind="paged", window=0), "kind", "paged", id="kind-paged"),
        pytest.param(lambda: layer(n_kv_heads=0), "n_kv_heads", "0", id="n_kv_heads0"),
        pytest.param(lambda: layer(n_kv_heads=-2), "n_kv_heads", "-2", id="n_kv_heads-2"),
        pytest.param(lambda: layer(head_dim=0), "head_dim", "0", id="head_dim0"),
        pytest.param(lambda: config(layers=[]), "layers", "", id="layers-empty"),
        pytest.param(lambda: config(capacity=0), "capacity", "0", id="capacity0"),
        pytest.param(lambda: config(capacity=2**31), "capacity", str(2**31), id="capacity-2**31"),
        pytest.param(lambda: config(max_seqs=0), "max_seqs", "0", id="max_seqs0"),
        pytest.param(lambda: config(max_write=0), "max_write", "0", id="max_write0"),
        pytest.param(lambda: config(initial_capacity=0), "initial_capacity", "0", id="initial_capacity0"),
        pytest.param(lambda: config(kv_dtype=jnp.int32), "kv_dtype", "int32", id="kv_dtype-int32"),
        pytest.param(lambda: config(kv_dtype=jnp.float64), "kv_dtype", "float64", id="kv_dtype-float64"),
        pytest.param(lambda: config(kv_dtype=jnp.float8_e4m3fnuz), "kv_dtype", "float8_e4m3fnuz", id="kv_dtype-fp8-fnuz"),
    ],
)
def test_scenario_39_validation_names_field_and_value(build, field, value):
  """Scenario 39: every invalid field raises ValueError naming the field and its value."""
  with pytest.raises(ValueError, match=names(field, value)):
    build()


def test_scenario_39_window_plus_width_must_fit_int32():
  """CONTRACT §2: `w + max_write - 1 < 2**31`; the largest legal sum is accepted.

  `max_write <= capacity` too, so the capacity is the largest one.
  """
  big = dict(layers=[layer(ring(2**30))], capacity=2**31 - 1)
  with pytest.raises(ValueError, match=r"max_write"):
    config(max_write=2**30 + 1, **big)
  ok = config(max_write=2**30, **big)
  assert ok.max_write == 2**30
  assert ok.ring_rows(0) == 2**31 - 1  # min(capacity, w + W - 1)
  assert config(layers=[layer(ring(2**30))], max_write=32).ring_rows(0) == 32


def test_scenario_39_initial_capacity_is_clamped():
  """Scenario 39: initial_capacity = 100 with capacity 32 gives F = 32 (state and facade)."""
  cfg = config(initial_capacity=100, capacity=32)
  assert cfg.initial_flat_rows == 32
  state = jaxkv.init_state(cfg)
  assert state.k[0].shape == (32, 5, 2, 8)
  cache = jaxkv.BatchedSequenceCache(cfg, implementation="reference")
  assert cache.state.k[0].shape[0] == 32
  assert cache.state.v[0].shape[0] == 32


def test_boundary_values_accepted():
  """The smallest legal values and capacity = 2**31 - 1 are accepted."""
  cfg = config(layers=[layer(ring(1), n_kv_heads=1, head_dim=1)], capacity=1, max_seqs=1,
               max_write=1, initial_capacity=1, kv_dtype=jnp.float32)
  assert cfg.ring_rows(0) == 1 and cfg.initial_flat_rows == 1 and cfg.step_width == 1
  big = config(capacity=2**31 - 1, initial_capacity=4)
  assert big.capacity == 2**31 - 1 and big.initial_flat_rows == 4


# --------------------------------------------------------------------------- value semantics


def test_policy_constructors():
  """CONTRACT §2: flat() is LayerPolicy("flat", 0); ring(w) is LayerPolicy("ring", w)."""
  assert flat() == jaxkv.LayerPolicy(kind="flat", window=0)
  assert ring(4) == jaxkv.LayerPolicy(kind="ring", window=4)
  assert ring(4).kind == "ring" and ring(4).window == 4
  assert flat().kind == "flat" and flat().window == 0
  assert ring(4) != ring(5) and ring(4) != flat()


def test_configs_are_frozen_hashable_and_value_compared():
  """CONTRACT §2: frozen, hashable, value-compared; layers stored as a tuple."""
  a = config(layers=[layer(), layer(ring(4))])
  b = config(layers=(layer(), layer(ring(4))))
  assert a == b and hash(a) == hash(b)
  assert isinstance(a.layers, tuple)
  assert a != config(layers=[layer(), layer(ring(5))])
  assert a != config(layers=[layer(), layer(ring(4))], capacity=64)
  assert hash(layer()) == hash(layer()) and hash(ring(3)) == hash(ring(3))
  assert len({a, b, config()}) == 2
  with pytest.raises(dataclasses.FrozenInstanceError, match="capacity"):
    a.capacity = 64  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError, match="window"):
    ring(3).window = 4  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError, match="head_dim"):
    layer().head_dim = 4  # type: ignore[misc]


@pytest.mark.parametrize("spelling", [jnp.bfloat16, np.dtype(jnp.bfloat16), "bfloat16"],
                         ids=["jnp", "np.dtype", "str"])
def test_kv_dtype_canonicalised(spelling):
  """CONTRACT §2: kv_dtype is canonicalised to a NumPy dtype; spellings compare and hash equal."""
  cfg = config(kv_dtype=spelling)
  assert isinstance(cfg.kv_dtype, np.dtype)
  assert cfg.kv_dtype == np.dtype(jnp.bfloat16)
  ref = config(kv_dtype=np.dtype(jnp.bfloat16))
  assert cfg == ref and hash(cfg) == hash(ref)


def test_defaults():
  """CONTRACT §2: kv_dtype defaults to bfloat16 and initial_capacity to every flat row
  (`max_flat_rows`: capacity, or max_seq_len when set), so a jitted loop never needs growth."""
  cfg = jaxkv.CacheConfig([layer()], 1024, 2, 4)
  assert cfg.kv_dtype == np.dtype(jnp.bfloat16)
  assert cfg.initial_capacity == 1024
  assert cfg.initial_flat_rows == 1024
  short = jaxkv.CacheConfig([layer()], 1024, 2, 4, max_seq_len=300)
  assert short.initial_capacity == short.initial_flat_rows == 300
  asked = jaxkv.CacheConfig([layer()], 1024, 2, 4, initial_capacity=16)
  assert asked.initial_flat_rows == 16
  # Resolved at construction: an explicit value equal to the default is the same config.
  assert cfg == jaxkv.CacheConfig([layer()], 1024, 2, 4, initial_capacity=1024)


def test_derived_properties_worked_example():
  """CONTRACT §2 example: [flat, ring(4)], capacity 64, max_seqs 4, max_write 8, initial 16."""
  cfg = config(layers=[layer(), layer(ring(4))], capacity=64, max_write=8, initial_capacity=16)
  assert cfg.step_width == 8
  assert cfg.initial_flat_rows == 16
  assert cfg.ring_rows(1) == 11
  state = jaxkv.init_state(cfg)
  assert [a.shape for a in state.k] == [(16, 5, 2, 8), (11, 5, 2, 8)]
  assert [a.shape for a in state.v] == [(16, 5, 2, 8), (11, 5, 2, 8)]


@pytest.mark.parametrize(
    "window, max_write, capacity, rows",
    [(4, 1, 32, 4), (4, 3, 32, 6), (4, 5, 32, 8), (2, 4, 32, 5), (4, 4, 6, 6), (4, 8, 64, 11),
     (1, 1, 1, 1), (100, 8, 64, 64)],
)
def test_ring_rows(window, max_write, capacity, rows):
  """CONTRACT §3: R = min(capacity, w + W - 1), clamped rings included."""
  cfg = config(layers=[layer(), layer(ring(window))], max_write=max_write, capacity=capacity,
               initial_capacity=capacity)
  assert cfg.ring_rows(1) == rows
  assert jaxkv.init_state(cfg).k[1].shape[0] == rows


def test_per_layer_geometry_and_dtype():
  """CONTRACT §3: each layer has its own [rows, max_seqs + 1, H_l, D_l] in kv_dtype."""
  cfg = config(layers=[layer(n_kv_heads=1, head_dim=16), layer(ring(3), n_kv_heads=4, head_dim=4)],
               kv_dtype=jnp.bfloat16, initial_capacity=8, max_write=2)
  state = jaxkv.init_state(cfg)
  assert state.k[0].shape == (8, 5, 1, 16) and state.k[1].shape == (4, 5, 4, 4)
  for arr in (*state.k, *state.v):
    assert arr.dtype == np.dtype(jnp.bfloat16)
    assert not np.any(np.asarray(arr, np.float32))


def test_config_is_a_static_jit_argument():
  """CONTRACT §2: configs work as static jit arguments; an equal config reuses the trace."""
  traces = []

  def f(cfg, x):
    traces.append(cfg)
    return x + jnp.int32(cfg.step_width)

  jf = jax.jit(f, static_argnums=0)
  a = config(layers=[layer(ring(4))])
  b = config(layers=(layer(ring(4)),))
  assert int(jf(a, jnp.int32(1))) == 9
  assert int(jf(b, jnp.int32(2))) == 10
  assert len(traces) == 1


def test_static_fields_take_python_or_numpy_ints_never_arrays():
  """STYLE habit 5/8: an array in a static field is a TypeError; NumPy ints normalise to int."""
  with pytest.raises(TypeError, match=r"capacity"):
    config(capacity=jnp.int32(32))
  with pytest.raises(TypeError, match=r"window"):
    ring(jnp.int32(4))
  with pytest.raises(TypeError, match=r"head_dim"):
    layer(head_dim=jnp.int32(8))
  a = config(capacity=np.int64(32), max_write=np.int32(8))
  assert a == config() and hash(a) == hash(config())
  assert type(a.capacity) is int and type(a.max_write) is int
  assert ring(np.int64(3)) == ring(3) and type(ring(np.int64(3)).window) is int
