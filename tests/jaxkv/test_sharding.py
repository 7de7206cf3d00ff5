"""Tensor-parallel cache on a CPU mesh (issue 5): K/V split over KV heads.

The conftest forces four host devices. A sharded cache must give the unsharded
results for the same calls, keep its K/V split through every verb and growth,
and compile with no collective that moves a K/V array and no cache-sized copy.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkv
from oracle import tol
from scenario_utils import assert_same_state, snapshot

N_DEVICES = 4
N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 8, 4, 8


def _config(initial_capacity=4, **overrides):
  layers = [jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), N_KV_HEADS, HEAD_DIM),
            jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(3), N_KV_HEADS, HEAD_DIM)]
  kwargs = dict(capacity=48, max_seqs=4, max_write=4, kv_dtype=jnp.float32,
                initial_capacity=initial_capacity)
  kwargs.update(overrides)
  return jaxkv.CacheConfig(layers, **kwargs)


def _mesh(axis_type):
  if len(jax.devices()) < N_DEVICES:
    pytest.skip(f"needs {N_DEVICES} devices (XLA_FLAGS forces them on CPU); "
                f"this host has {len(jax.devices())}")
  return jax.make_mesh((N_DEVICES,), ("tp",), axis_types=(axis_type,))


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def mesh(request):
  return _mesh(request.param)


def _content(rng, n):
  q = rng.standard_normal((n, N_Q_HEADS, HEAD_DIM), dtype=np.float32)
  k = rng.standard_normal((n, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
  v = rng.standard_normal((n, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
  return q, k, v


def _step(cache, ids, contents, owner_blocks=None):
  assert cache.declare_step(ids, owner_blocks)
  cache.prepare_step()
  outs = [np.asarray(cache.attend(l, *contents[l])) for l in range(2)]
  cache.commit_step()
  return outs


# A script of facade calls: prefill, mixed decode, ring wrap, growth, a fork, a
# rewind, a removal, owner blocks and refusals.
_SCRIPT = [
    ("new",), ("new",), ("new",),
    ("step", [0, 0, 0, 1], None),
    ("step", [0, 1, 2, 2], None),
    ("step", [0, 0, 0, 0], None),           # grows F, wraps the ring of 0
    ("clone", 0, 5),
    ("step", [3, 0, 1, 3], None),
    ("rewind", 0, 6),
    ("rewind", 0, 1),                       # below the floor: refused
    ("step", [1, 1, 2, 2], [(0, 2), (2, 2)]),   # two owner blocks
    ("rm", 2),
    ("step", [0, 3, 1], None),
    ("clone", 2, None),                     # not live: refused
    ("step", [1] * 4, None),
]


def _run_script(cache, seed):
  rng = np.random.default_rng(seed)
  results = []
  for op in _SCRIPT:
    if op[0] == "new":
      results.append(cache.seq_new())
    elif op[0] == "step":
      contents = [_content(rng, len(op[1])) for _ in range(2)]
      results.append(_step(cache, op[1], contents, op[2]))
    elif op[0] == "clone":
      results.append(cache.seq_clone(op[1], op[2]))
    elif op[0] == "rewind":
      results.append(cache.rewind(op[1], op[2]))
    elif op[0] == "rm":
      results.append(cache.seq_rm(op[1]))
  return results


def _assert_kv_sharded(state, mesh):
  for array in state.k + state.v:
    assert array.sharding.is_equivalent_to(
        NamedSharding(mesh, P(None, None, "tp", None)), array.ndim), array.sharding
    assert array.addressable_shards[0].data.shape[2] == N_KV_HEADS // N_DEVICES


def _assert_same_outputs(expected, got):
  """The script's results, op by op: attention outputs within tolerance, the rest equal."""
  assert len(expected) == len(got)
  for i, (e, g) in enumerate(zip(expected, got)):
    if isinstance(e, list):
      for layer, (a, b) in enumerate(zip(e, g)):
        np.testing.assert_allclose(b, a, atol=tol(jnp.float32), rtol=0,
                                   err_msg=f"op {i} {_SCRIPT[i]} layer {layer}")
    else:
      assert e == g, f"op {i} {_SCRIPT[i]}: {e} != {g}"


def test_sharded_facade_equals_unsharded(mesh):
  config = _config()
  plain = jaxkv.BatchedSequenceCache(config, implementation="reference")
  split = jaxkv.BatchedSequenceCache(config, implementation="reference", mesh=mesh)
  expected, got = _run_script(plain, 0), _run_script(split, 0)
  _assert_same_outputs(expected, got)
  assert split.state.k[0].shape[0] > config.initial_flat_rows   # growth happened
  _assert_kv_sharded(split.state, mesh)
  assert_same_state(snapshot(plain.state), snapshot(split.state))


def test_sharded_paged_facade_equals_unsharded():
  """Paged storage (CONTRACT §3.1) on a mesh: the pool is split over its heads like the
  columns, the page table is replicated, and the script's outputs, page tables and
  pages equal the unsharded ones."""
  mesh = _mesh(AxisType.Explicit)
  config = _config(page_size=5)
  plain = jaxkv.BatchedSequenceCache(config, implementation="reference")
  split = jaxkv.BatchedSequenceCache(config, implementation="reference", mesh=mesh)
  expected, got = _run_script(plain, 0), _run_script(split, 0)
  _assert_same_outputs(expected, got)
  _assert_kv_sharded(split.state, mesh)
  assert split.state.page_table.sharding.is_fully_replicated
  assert_same_state(snapshot(plain.state), snapshot(split.state))


def test_sharded_heads_must_divide():
  mesh = _mesh(AxisType.Explicit)
  layers = [jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), 2, HEAD_DIM)]
  config = jaxkv.CacheConfig(layers, capacity=8, max_seqs=2, max_write=2)
  with pytest.raises(ValueError, match=r"n_kv_heads=2 must be divisible by the 'tp' axis size 4"):
    jaxkv.BatchedSequenceCache(config, mesh=mesh)
  with pytest.raises(ValueError, match=r"kv_axis='heads' is not an axis"):
    jaxkv.init_state(_config(), mesh=mesh, kv_axis="heads")
  with pytest.raises(TypeError, match=r"mesh=.* must be a jax.sharding.Mesh"):
    jaxkv.init_state(_config(), mesh="tp")


def test_pure_grow_keeps_the_split(mesh):
  config = _config()
  state = jaxkv.init_state(config, mesh=mesh)
  grown = jaxkv.pure.grow(config, state, 16)
  assert grown.k[0].shape[0] == 16 and grown.k[1].shape == state.k[1].shape
  _assert_kv_sharded(grown, mesh)


# --------------------------------------------------------------------------- HLO

_COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-gather|all-to-all|collective-permute|all-reduce)"
                         r"(-start)?\(")
_COPY = re.compile(r"=\s*(\S+)\s+copy(-start)?\(")


def _shape_of(hlo_type: str) -> tuple[int, ...]:
  dims = re.search(r"\[([\d,]*)\]", hlo_type)
  return tuple(int(d) for d in dims.group(1).split(",") if d) if dims else ()


def _kv_shapes(state, per_shard: bool):
  shapes = set()
  for a in state.k + state.v:
    shapes.add(a.shape)
    if per_shard:
      shapes.add(a.addressable_shards[0].data.shape)
  return shapes


def _prepared_state(config, mesh):
  cache = jaxkv.BatchedSequenceCache(config, implementation="reference", mesh=mesh)
  for _ in range(3):
    cache.seq_new()
  assert cache.declare_step([0, 0, 1, 2])
  cache.prepare_step()
  return cache.state


def _compiled_verbs(config, state, mesh):
  """Each verb (and a short jitted loop) compiled with the state donated."""
  jit = lambda f, **kw: jax.jit(f, static_argnums=0, donate_argnums=1, **kw)
  pure, i32 = jaxkv.pure, jnp.int32
  q = jnp.zeros((config.step_width, N_Q_HEADS, HEAD_DIM), jnp.float32)
  kv = jnp.zeros((config.step_width, N_KV_HEADS, HEAD_DIM), jnp.float32)

  def loop(config, state, q, k, v):
    def body(state, _):
      state, _ = pure.declare_step(config, state, state.decl_ids, i32(3),
                                   jnp.zeros((config.step_width, 2), jnp.int32))
      state, _ = pure.prepare_step(config, state)
      for layer in range(config.num_layers):
        state, _, _ = pure.attend(config, state, layer, q, k, v, implementation="reference",
                                  mesh=mesh)
      state, _ = pure.commit_step(config, state)
      return state, None
    return jax.lax.scan(body, state, None, length=3)[0]

  attend = lambda layer: jax.jit(
      pure.attend, static_argnums=(0, 2), donate_argnums=1,
      static_argnames=("implementation", "mesh")).lower(
          config, state, layer, q, kv, kv, implementation="reference", mesh=mesh)
  return {
      "prepare_step": jit(pure.prepare_step).lower(config, state),
      "commit_step": jit(pure.commit_step).lower(config, state),
      "seq_clone": jit(pure.seq_clone).lower(config, state, i32(0), i32(2)),
      "seq_rm": jit(pure.seq_rm).lower(config, state, i32(1)),
      "rewind": jit(pure.rewind).lower(config, state, i32(0), i32(1)),
      "attend[0]": attend(0),
      "attend[1]": attend(1),
      "loop": jit(loop).lower(config, state, q, kv, kv),
  }


def test_no_collective_or_copy_moves_kv(mesh):
  config = _config(initial_capacity=48)
  state = _prepared_state(config, mesh)
  kv_shapes = _kv_shapes(state, per_shard=True)
  kv_bytes = sum(a.addressable_shards[0].data.nbytes for a in state.k + state.v)
  for name, lowered in _compiled_verbs(config, state, mesh).items():
    compiled = lowered.compile()
    text = compiled.as_text()
    for match in _COLLECTIVE.finditer(text):
      assert _shape_of(match.group(1)) not in kv_shapes, f"{name}: {match.group(0)}"
    for match in _COPY.finditer(text):
      assert _shape_of(match.group(1)) not in kv_shapes, f"{name}: {match.group(0)}"
    alias = compiled.memory_analysis().alias_size_in_bytes
    assert alias >= kv_bytes, f"{name}: {alias=} < per-device K/V bytes {kv_bytes}"


def test_hlo_check_sees_a_gather_of_kv(mesh):
  """Negative control: gathering a K/V array to one device shows up as a collective."""
  config = _config(initial_capacity=48)
  state = jaxkv.init_state(config, mesh=mesh)
  replicate = jax.jit(lambda k: k * 2, out_shardings=NamedSharding(mesh, P()))
  text = replicate.lower(state.k[0]).compile().as_text()
  shapes = [_shape_of(m.group(1)) for m in _COLLECTIVE.finditer(text)]
  assert any(s in _kv_shapes(state, per_shard=True) for s in shapes), shapes


def test_init_state_on_a_mesh_compiles_once(mesh):
  """Before: every init_state on a mesh recompiled its zeros (a fresh jit per leaf), so
  each Engine.run on a mesh paid compilations inside its serving time (issue 11)."""
  compiles = []
  listener = lambda event, *args, **kwargs: compiles.append(event) if "compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    jax.block_until_ready(jaxkv.init_state(_config(), mesh=mesh))
    first = len(compiles)
    jax.block_until_ready(jaxkv.init_state(_config(), mesh=mesh))
    assert len(compiles) == first, compiles[first:]
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
