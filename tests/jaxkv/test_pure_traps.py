"""Issue 39 item 6: the pure API's and the facade's traps for a first user.

- The default `initial_capacity` allocates every flat row, so a jitted loop never
  meets NEEDS_ROWS unless the config asks for growth.
- The `Step` that the facade's `prepare_step` returns survives the next verb.
- q/k/v in a dtype other than the cache's `kv_dtype` warn once per layer shape.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv

pure = jaxkv.pure
flat, ring = jaxkv.LayerPolicy.flat, jaxkv.LayerPolicy.ring
LayerConfig, CacheConfig, Status = jaxkv.LayerConfig, jaxkv.CacheConfig, jaxkv.Status


def _prefill_loop(config, steps: int):
  """`steps` full-width prefill steps of one sequence inside one jit; the statuses per verb."""
  width = config.step_width

  def body(state, _):
    state, declared = pure.declare_step(config, state, jnp.zeros((width,), jnp.int32),
                                        jnp.int32(width), jnp.zeros((width, 2), jnp.int32))
    state, prepared = pure.prepare_step(config, state)
    for layer, cfg in enumerate(config.layers):
      x = jnp.ones((width, cfg.n_kv_heads, cfg.head_dim), config.kv_dtype)
      state, _, _ = pure.attend(config, state, layer, x, x, x, implementation="reference")
    state, committed = pure.commit_step(config, state)
    return state, jnp.stack([declared, prepared, committed])

  @jax.jit
  def run():
    state = jaxkv.init_state(config)
    state, _, _ = pure.seq_new(config, state)
    return jax.lax.scan(body, state, None, length=steps)

  state, statuses = run()
  return state, np.asarray(statuses)


def test_default_initial_capacity_never_needs_rows_inside_jit():
  """Before: the default of 512 flat rows made step 3 (positions 512..767) NEEDS_ROWS."""
  config = CacheConfig([LayerConfig(flat(), 1, 4), LayerConfig(ring(8), 1, 4)], capacity=1024,
                       max_seqs=1, max_write=256, kv_dtype=jnp.float32)
  state, statuses = _prefill_loop(config, 4)
  assert (statuses == Status.OK).all(), statuses
  assert int(state.pos[0]) == 1024 and state.k[0].shape[0] == 1024


def test_a_smaller_initial_capacity_asks_for_growth():
  """The trade-off the default avoids: with fewer rows the jitted prepare refuses, changing nothing."""
  config = CacheConfig([LayerConfig(flat(), 1, 4)], capacity=1024, max_seqs=1, max_write=256,
                       kv_dtype=jnp.float32, initial_capacity=512)
  state, statuses = _prefill_loop(config, 3)
  assert statuses[:2].tolist() == [[Status.OK] * 3] * 2
  assert statuses[2].tolist() == [Status.OK, Status.NEEDS_ROWS, Status.NOT_PREPARED]
  assert int(state.pos[0]) == 512


def test_prepare_step_result_survives_the_next_verbs():
  """Before: the returned Step was a leaf of the state the next verb donated, so reading it
  after `attend` raised "Array has been deleted"."""
  config = CacheConfig([LayerConfig(flat(), 1, 4)], capacity=32, max_seqs=2, max_write=4,
                       kv_dtype=jnp.float32)
  cache = jaxkv.BatchedSequenceCache(config, implementation="reference")
  a, b = cache.seq_new(), cache.seq_new()
  assert cache.declare_step([a, a, b])
  step = cache.prepare_step()
  x = np.ones((3, 1, 4), np.float32)
  cache.attend(0, x, x, x)
  cache.commit_step()
  assert cache.declare_step([b])
  cache.prepare_step()
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(step))
  assert np.asarray(step.positions)[:3].tolist() == [0, 1, 0]
  assert np.asarray(step.seq_cols)[:3].tolist() == [a, a, b]
  assert int(step.n_tokens) == 3


def _attend_once(config, q_dtype, kv_dtype, heads: int):
  cache = jaxkv.BatchedSequenceCache(config, implementation="reference")
  cache.seq_new()
  assert cache.declare_step([0])
  cache.prepare_step()
  head_dim = config.layers[0].head_dim
  kv = np.ones((1, config.layers[0].n_kv_heads, head_dim), kv_dtype)
  return cache.attend(0, np.ones((1, heads, head_dim), q_dtype), kv, kv)


def test_dtype_mismatch_warns_once_per_layer_shape():
  """Before: float32 activations into a bfloat16 cache were cast silently."""
  # A head dim no other test uses: the warning is once per process and shape.
  config = CacheConfig([LayerConfig(flat(), 1, 12)], capacity=8, max_seqs=1, max_write=2)
  assert config.kv_dtype == np.dtype(jnp.bfloat16)
  with pytest.warns(pure.KVDtypeWarning, match=r"layer 0 .*float32.*kv_dtype=bfloat16"):
    _attend_once(config, np.float32, np.float32, 1)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _attend_once(config, np.float32, np.float32, 1)     # same shape and dtypes: once
    out = _attend_once(config, jnp.bfloat16, jnp.bfloat16, 1)   # matching dtypes: never
  assert out.dtype == jnp.bfloat16
  with pytest.warns(pure.KVDtypeWarning, match="layer 0"):
    _attend_once(config, np.float32, np.float32, 2)     # another query-head count
  with pytest.warns(pure.KVDtypeWarning, match="float32/bfloat16/bfloat16"):
    _attend_once(config, np.float32, jnp.bfloat16, 1)   # only q differs
