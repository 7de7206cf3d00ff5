"""The loop state packed at the jit boundary (`jaxkv.serve.packing`, `EngineCore`'s verbs).

Packing is bookkeeping only: every leaf comes back bitwise (the property under
test, so exact comparison), large arrays travel as they are (no copy on the host,
updated in place by the donated step), and the engine's step takes a few arrays
where the state has about a hundred.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.loop import serve_step
from jaxkv.serve.packing import Packing


def _random_tree(rng):
  """A dict of arrays of mixed dtypes and shapes: scalars, empty, bool, large, a PRNG key."""
  dtypes = [np.int32, np.float32, np.bool_, np.uint32, np.int8, np.float16]
  tree = {}
  for i in range(int(rng.integers(3, 12))):
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    shape = tuple(int(d) for d in rng.integers(0, 5, size=int(rng.integers(0, 3))))
    if dtype == np.bool_:
      value = rng.random(shape) < 0.5
    else:
      value = (rng.standard_normal(shape) * 100).astype(dtype)
    tree[f"a{i}"] = jnp.asarray(value)
  tree["large"] = jnp.arange(70_000, dtype=jnp.int32)   # over SMALL_BYTES: kept
  tree["key"] = jax.random.key(int(rng.integers(1000)))   # not a plain dtype: kept
  return tree


def _same(a, b):
  if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("seed", range(6))
def test_pack_then_unpack_gives_every_leaf_back_bitwise(seed):
  rng = np.random.default_rng(seed)
  tree = _random_tree(rng)
  packing = Packing.of(tree)
  kept, small = packing.split(tree)
  assert any(x is tree["large"] for x in kept) and any(x is tree["key"] for x in kept)
  assert len(packing.dtypes) == len(set(packing.dtypes))   # one vector per dtype
  packed = jax.jit(packing.pack)(tree)
  assert len(packed[1]) == len(packing.dtypes)
  back = jax.jit(packing.unpack)(packed)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  assert all(_same(x, y) for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(tree)))
  # On the host, the kept arrays are the same objects (never copied).
  joined = packing.join(kept, small)
  assert all(x is y for x, y in zip(jax.tree.leaves(joined), jax.tree.leaves(tree)))
  # Disabled (a mesh: sharded arrays stay whole), everything is kept.
  assert Packing.of(tree, enabled=False).kept == len(jax.tree.leaves(tree))


def test_the_engine_steps_on_few_arrays_and_writes_kv_in_place():
  config = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                             num_heads=2, num_kv_heads=1, head_dim=16)
  cache = dataclasses.replace(config.cache_config(capacity=256, max_seqs=4, max_write=8),
                              page_size=8)
  engine = serve.Engine(Decoder(config, cache, rngs=nnx.Rngs(0)), max_len=48)
  engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=4)))
  engine.live.dispatch(1, stepwise=True)
  core = engine.core
  kept, vectors = core._packed   # pylint: disable=protected-access
  assert len(kept) + len(vectors) <= len(jax.tree.leaves(core.state)) // 2
  # The same step on an unpacked copy of the state: what the packed step must equal.
  copy = jax.tree.map(lambda a: jnp.array(a, copy=True), core.state)
  graphdef, widths, treedef = core.graphdef, core.widths, jax.tree.structure(core.params)
  step = jax.jit(lambda leaves, ls: serve_step(graphdef, core.config, widths, 0,
                                               jax.tree.unflatten(treedef, leaves), ls))
  want, _ = step(core._param_leaves, copy)   # pylint: disable=protected-access
  before = [a.unsafe_buffer_pointer() for a in kept]
  core.step(0)
  kept_after, _ = core._packed   # pylint: disable=protected-access
  # The donated step reuses every large buffer (the K/V pools among them): no copy.
  assert [a.unsafe_buffer_pointer() for a in kept_after] == before
  got = core.state
  assert int(got.steps) == int(copy.steps) + 1
  assert all(_same(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
