"""Speculative decoding inside the engine (issue 54): draft, verify in one step, rewind the rest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drivers import PureCache
from jaxkv import CacheConfig, LayerConfig, LayerPolicy, Status, pure


# ----------------------------------------------------------------------------- the verb


def _stepped(config, *steps, seed=0):
  """A `PureCache` whose sequences took `steps` (each: tokens per sequence; random K/V)."""
  rng = np.random.default_rng(seed)
  cache = PureCache(config)
  for _ in steps[0]:
    cache.seq_new()
  for lengths in steps:
    ids = [s for s, n in enumerate(lengths) for _ in range(n)]
    cache.declare_step(ids)
    cache.prepare_step()
    for layer, lc in enumerate(config.layers):
      q = jnp.asarray(rng.normal(size=(len(ids), 2, lc.head_dim)), jnp.float32)
      kv = jnp.asarray(rng.normal(size=(len(ids), lc.n_kv_heads, lc.head_dim)), jnp.float32)
      cache.attend(layer, q, kv, kv)
    cache.commit_step()
  return cache


def _control(state):
  return {name: np.asarray(getattr(state, name)).tolist()
          for name in ("pos", "held", "hw", "page_table", "page_refs")
          if getattr(state, name, None) is not None}


@pytest.mark.parametrize("page_size", [None, 4])
def test_rewind_many_is_every_rewind_at_once(page_size):
  """Equal to one `rewind` per changed sequence; a bad target anywhere refuses the whole call,
  changing nothing."""
  layers = (LayerConfig(LayerPolicy.ring(3), 1, 8), LayerConfig(LayerPolicy.flat(), 1, 8))
  config = CacheConfig(layers=layers, capacity=64, max_seqs=4, max_write=16,
                       **({} if page_size is None else {"page_size": page_size}))
  jitted = jax.jit(pure.rewind_many, static_argnums=0)

  def call(cache, changes):
    positions = np.asarray(cache.state.pos).copy()
    for s, p in changes.items():
      positions[s] = p
    before = _control(cache.state)
    state, status = jitted(config, cache.state, jnp.asarray(positions))
    return state, Status(int(status)), before

  # Sequence 0 wrote 30 positions: its window-3 ring of 18 rows wrapped, floor 30 - 18 + 2 = 14.
  steps = ((15, 1), (15, 1))
  state, status, _ = call(_stepped(config, *steps), {0: 14, 1: 1})
  assert status == Status.OK
  one_by_one = _stepped(config, *steps)
  assert one_by_one.rewind(0, 14) and one_by_one.rewind(1, 1)
  assert _control(state) == _control(one_by_one.state)
  refusals = [({0: 13}, Status.BELOW_FLOOR), ({0: 31}, Status.BAD_TARGET),
              ({1: -1}, Status.BAD_TARGET), ({3: 1}, Status.BAD_TARGET),
              ({0: 20, 1: 3}, Status.BAD_TARGET)]
  for changes, want in refusals:
    state, status, before = call(_stepped(config, *steps), changes)
    assert status == want and _control(state) == before, changes
  if page_size is not None:   # a target inside a page a fork shares would need a copy
    cache = _stepped(config, *steps)
    assert cache.seq_clone(0) is not None
    state, status, before = call(cache, {0: 17})
    assert status == Status.NO_ROOM and _control(state) == before
    state, status, _ = call(cache, {0: 24})   # a page boundary: nothing to copy
    assert status == Status.OK
