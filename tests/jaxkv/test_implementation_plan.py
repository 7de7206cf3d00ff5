"""`implementation=None` never falls back silently, and `implementation_plan` says what it does.

The Hopper cases run on CPU by making `default_implementation` report
"mosaic_gpu": the plan and the dispatch then run the kernels' real static
checks, and only refused layers are ever executed (they run the reference).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

from drivers import has_hopper_gpu
import jaxkv
from jaxkv import _implementation
from scenario_utils import Harness


@pytest.fixture
def fresh_warnings(monkeypatch):
  monkeypatch.setattr(_implementation, "_warned", set())


@pytest.fixture
def hopper_default(monkeypatch, fresh_warnings):
  del fresh_warnings
  monkeypatch.setattr(_implementation, "default_implementation", lambda: "mosaic_gpu")


def _config(kv_dtype, head_dims=(64, 80, 8), capacity=40):
  layers = [jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), 2, head_dims[0])]
  layers += [jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(5), 1, d) for d in head_dims[1:]]
  return jaxkv.CacheConfig(layers, capacity=capacity, max_seqs=2, max_write=4,
                           kv_dtype=kv_dtype, initial_capacity=8)


no_hopper = pytest.mark.skipif(has_hopper_gpu(), reason="the default device is a Hopper GPU")


@no_hopper
def test_plan_without_hopper_is_the_reference_for_every_layer():
  plan = jaxkv.implementation_plan(_config(jnp.float16), 6)
  assert [p.layer for p in plan] == [0, 1, 2]
  assert all(p.implementation == "reference" and "compute capability >= 9.0" in p.reason
             for p in plan)


@pytest.mark.skipif(not has_hopper_gpu(), reason="needs an NVIDIA Hopper GPU")
def test_plan_on_a_real_hopper_gpu():
  plan = jaxkv.implementation_plan(_config(jnp.bfloat16), 6)
  assert [p.implementation for p in plan] == ["mosaic_gpu", "mosaic_gpu", "reference"]


def test_plan_on_hopper_uses_the_kernels_own_checks(hopper_default):
  del hopper_default
  # Layer 0: G 3, D 64; layer 1: G 6, D 80 (both served); layer 2: D 8 (refused).
  plan = jaxkv.implementation_plan(_config(jnp.bfloat16), [6, 6, 6])
  assert [p.implementation for p in plan] == ["mosaic_gpu", "mosaic_gpu", "reference"]
  assert "head_dim=8 must be a multiple of 16" in plan[2].reason
  # float32 storage: every layer, with the kernel's message naming the alternatives.
  plan = jaxkv.implementation_plan(_config(jnp.float32), 6)
  assert [p.implementation for p in plan] == ["reference"] * 3
  assert all("float32 K/V storage" in p.reason and "bfloat16 or float16" in p.reason
             for p in plan)


def test_plan_validates_head_counts():
  with pytest.raises(ValueError, match="3 entries for 2 layers"):
    jaxkv.implementation_plan(_config(jnp.float16, head_dims=(64, 64)), [4, 4, 4])
  with pytest.raises(ValueError, match="multiple of n_kv_heads=2"):
    jaxkv.implementation_plan(_config(jnp.float16), 3)


def test_hopper_fallback_warns_once_per_layer_shape_and_reason(hopper_default):
  del hopper_default
  jax.clear_caches()   # a cached trace of the same config would not dispatch again
  config = _config(jnp.float32, head_dims=(16, 16, 32), capacity=24)
  h = Harness(config, implementation=None, n_q_heads=4)
  a = h.new()
  with pytest.warns(jaxkv.KernelFallbackWarning) as record:
    h.step([a, a, a])          # checked against the oracle: the reference served it
  messages = sorted(str(w.message) for w in record
                    if issubclass(w.category, jaxkv.KernelFallbackWarning))
  # Layers 1 and 2 differ in head dim, layer 0 in KV heads: three shapes, one each.
  assert len(messages) == 3, messages
  assert all("float32 K/V storage" in m for m in messages)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.clear_caches()           # even a fresh trace does not repeat the warning
    h.step([a, a])


def test_warn_fallback_deduplicates(fresh_warnings):
  del fresh_warnings
  q = jax.ShapeDtypeStruct((4, 8, 64), jnp.float32)
  k = jax.ShapeDtypeStruct((16, 3, 2, 64), jnp.float32)
  with pytest.warns(jaxkv.KernelFallbackWarning, match="8 query heads, 2 KV heads of dim 64"):
    _implementation.warn_fallback(q, k, "reason A")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _implementation.warn_fallback(q, k, "reason A")
  with pytest.warns(jaxkv.KernelFallbackWarning, match="reason B"):
    _implementation.warn_fallback(q, k, "reason B")


@no_hopper
def test_cpu_default_does_not_warn(fresh_warnings):
  del fresh_warnings
  config = _config(jnp.float32, head_dims=(16, 8), capacity=28)
  h = Harness(config, implementation=None, n_q_heads=4)
  a = h.new()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.clear_caches()
    h.step([a, a])
