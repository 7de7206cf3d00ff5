"""Tensor-parallel models (issue 5): `jaxkv.nnx`, the example models and the engine on a mesh.

The conftest forces four host devices; these tests use two (and four for the
divisibility errors). Heads and MLP features are split over `"tp"`; a sharded
layer or engine must give the unsharded results, hold its weights and K/V split,
and compile with no collective that moves a K/V array.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxkv
from oracle import tol
from jaxkv.models import hf
from jaxkv.models import ModelConfig, build, param_spec, shard_model
from jaxkv import serve
from jaxkv.nnx import CachedAttention, merge_model, split_model
from jaxkv.serve.state import init_loop_state, pack_queue

HEADS, KV_HEADS, HEAD_DIM, FEATURES = 4, 2, 8, 16


def _mesh(n=2, axis_type=AxisType.Auto):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices (XLA_FLAGS forces them on CPU); "
                f"this host has {len(jax.devices())}")
  return jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n], axis_types=(axis_type,))


def _assert_split(array, spec, mesh):
  assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), array.sharding
  axis = next(i for i, s in enumerate(spec) if s == "tp")
  assert array.addressable_shards[0].data.shape[axis] == array.shape[axis] // mesh.shape["tp"]


# --------------------------------------------------------------------------- one layer


def _cache_config():
  layers = [jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), KV_HEADS, HEAD_DIM),
            jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(3), KV_HEADS, HEAD_DIM)]
  return jaxkv.CacheConfig(layers, capacity=32, max_seqs=2, max_write=4, kv_dtype=jnp.float32)


def _set(variable, value):
  """Assigns keeping the variable's placement (explicit meshes refuse a mismatched one)."""
  variable[...] = jax.device_put(value, variable[...].sharding)


class _TwoLayers(nnx.Module):
  """A flat and a ring `CachedAttention` in a row (biases, Gemma q/k norms, a bucket)."""

  def __init__(self, config, mesh):
    kw = dict(features=FEATURES, num_heads=HEADS, qk_norm="gemma", use_bias=True, bucket=2,
              implementation="reference", mesh=mesh)
    rngs = nnx.Rngs(0)
    self.layers = nnx.List([CachedAttention(config, l, rngs=rngs, **kw) for l in range(2)])
    # Non-zero biases and norm weights, so a misplaced bias or norm shows.
    for layer in self.layers:
      for proj in (layer.q_proj, layer.k_proj, layer.v_proj):
        _set(proj.bias, np.linspace(-1, 1, proj.bias[...].shape[0], dtype=np.float32))
      _set(layer.q_norm.weight, np.linspace(-0.5, 0.5, HEAD_DIM, dtype=np.float32))

  def __call__(self, x, state):
    outs = []
    for layer in self.layers:
      out, state = layer(x, state)
      outs.append(out)
    return outs, state


def _layer_step(config, graphdef, params, state, seq_ids, n, x):
  state, _ = jaxkv.pure.declare_step(config, state, seq_ids, n,
                                     jnp.zeros((config.step_width, 2), jnp.int32))
  state, _ = jaxkv.pure.prepare_step(config, state)
  outs, state = merge_model(graphdef, params)(x, state)
  state, status = jaxkv.pure.commit_step(config, state)
  return state, outs, status


_jit_layer_step = jax.jit(_layer_step, static_argnums=(0, 1), donate_argnums=3)

# (seq_ids, n): prefill, mixed, a two-token decode (bucketed), a ring wrap.
_STEPS = [([0, 0, 0, 1], 4), ([0, 1, 1, 1], 4), ([0, 1, 2, 2], 2), ([0, 0, 0, 0], 4)]


def _run_layers(config, model, mesh, seed):
  graphdef, params = split_model(model)
  state = jaxkv.init_state(config, mesh=mesh)
  for _ in range(2):
    state, _, _ = jax.jit(jaxkv.pure.seq_new, static_argnums=0)(config, state)
  rng = np.random.default_rng(seed)
  outs = []
  for ids, n in _STEPS:
    ids = np.where(np.arange(4) < n, ids, config.max_seqs).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((4, FEATURES), dtype=np.float32))
    state, out, status = _jit_layer_step(config, graphdef, params, state, jnp.asarray(ids),
                                         jnp.int32(n), x)
    assert int(status) == jaxkv.Status.OK
    outs.append([np.asarray(o)[:n] for o in out])
  return outs, state


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_sharded_attention_equals_unsharded(axis_type):
  mesh = _mesh(2, axis_type)
  config = _cache_config()
  plain, split = _TwoLayers(config, None), _TwoLayers(config, mesh)
  attn = split.layers[0]
  _assert_split(attn.q_proj.kernel[...], P(None, "tp"), mesh)
  _assert_split(attn.k_proj.bias[...], P("tp"), mesh)
  _assert_split(attn.o_proj.kernel[...], P("tp", None), mesh)
  np.testing.assert_array_equal(np.asarray(attn.q_proj.kernel[...]),
                                np.asarray(plain.layers[0].q_proj.kernel[...]))
  expected, _ = _run_layers(config, plain, None, seed=1)
  got, state = _run_layers(config, split, mesh, seed=1)
  for i, (e, g) in enumerate(zip(expected, got)):
    for layer in range(2):
      np.testing.assert_allclose(g[layer], e[layer], atol=tol(jnp.float32), rtol=0,
                                 err_msg=f"step {i} layer {layer}")
  for array in state.k + state.v:
    _assert_split(array, P(None, None, "tp", None), mesh)


def test_indivisible_heads_are_named():
  mesh = _mesh(4)
  config = _cache_config()   # 2 KV heads: not divisible by 4
  with pytest.raises(ValueError, match=r"num_heads=6 must be divisible by the 'tp' axis size 4"):
    CachedAttention(config, 0, features=FEATURES, num_heads=6, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"n_kv_heads=2 must be divisible by the 'tp' axis size 4"):
    CachedAttention(config, 0, features=FEATURES, num_heads=4, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"kv_axis='heads' is not an axis"):
    CachedAttention(config, 0, features=FEATURES, num_heads=4, mesh=mesh, kv_axis="heads",
                    rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"mesh='tp' must be a jax.sharding.Mesh"):
    CachedAttention(config, 0, features=FEATURES, num_heads=4, mesh="tp", rngs=nnx.Rngs(0))
  model = ModelConfig.llama(num_heads=8, num_kv_heads=4, intermediate_size=66)
  cache = model.cache_config(capacity=8, max_seqs=1, max_write=2)
  with pytest.raises(ValueError, match=r"intermediate_size=66 must be divisible by the 'tp' "
                                       r"axis size 4"):
    build(model, cache, mesh=mesh)


# --------------------------------------------------------------------------- HLO

_COLLECTIVE = re.compile(r"=\s*(\S+)\s+(all-gather|all-to-all|collective-permute|all-reduce)"
                         r"(-start)?\(")


def _shape_of(hlo_type: str) -> tuple[int, ...]:
  dims = re.search(r"\[([\d,]*)\]", hlo_type)
  return tuple(int(d) for d in dims.group(1).split(",") if d) if dims else ()


def test_sharded_layer_moves_no_kv():
  """The layer step attends per shard, all-reduces activations (o_proj), never a K/V array."""
  mesh = _mesh(2)
  config = _cache_config()
  model = _TwoLayers(config, mesh)
  graphdef, params = split_model(model)
  state = jaxkv.init_state(config, mesh=mesh)
  ids = jnp.asarray([0, 0, 1, 1], jnp.int32)
  lowered = _jit_layer_step.lower(config, graphdef, params, state, ids, jnp.int32(4),
                                  jnp.zeros((4, FEATURES), jnp.float32))
  # Each layer's write + attention runs per shard (a shard_map), not left to the partitioner.
  stablehlo = lowered.as_text()
  per_shard = stablehlo.count("sdy.manual_computation") + stablehlo.count("SPMDFullToShardShape")
  assert per_shard >= 2, "the layers' attention does not run under shard_map"
  compiled = lowered.compile()
  text = compiled.as_text()
  kv_shapes = {a.shape for a in state.k + state.v}
  kv_shapes |= {a.addressable_shards[0].data.shape for a in state.k + state.v}
  moved = [_shape_of(m.group(1)) for m in _COLLECTIVE.finditer(text)]
  assert moved, "no collective at all: the check would see nothing"
  assert (4, FEATURES) in moved, moved          # o_proj's partial sums
  assert not kv_shapes & set(moved), moved
  kv_bytes = sum(a.addressable_shards[0].data.nbytes for a in state.k + state.v)
  alias = compiled.memory_analysis().alias_size_in_bytes
  assert alias >= kv_bytes, f"{alias=} < per-device K/V bytes {kv_bytes}"


# --------------------------------------------------------------------------- engine

LLAMA = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
GEMMA = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                           layer_types=("sliding", "full", "sliding"), num_heads=4,
                           num_kv_heads=2, head_dim=16, sliding_window=4,
                           query_pre_attn_scalar=16.0)
MAX_SEQS, WIDTH, MAX_LEN = 3, 8, 24


def _livelier(model):
  """Rescaled random weights whose greedy tokens vary (the default init repeats tokens)."""
  embed_scale, kernel_scale = (40, 1) if model.config.arch == "llama" else (0.2, 4)
  _set(model.embed.embedding, np.asarray(model.embed.embedding[...]) * np.float32(embed_scale))
  for path, variable in nnx.iter_graph(model):
    if isinstance(variable, nnx.Param) and path[-1] == "kernel":
      _set(variable, np.asarray(variable[...]) * np.float32(kernel_scale))
  return model


def _requests(rng):
  lengths, limits = [3, 11, 6, 1, 9], [7, 9, 5, 8, 6]   # 5 requests over 3 columns
  return [serve.Request(tuple(int(t) for t in rng.integers(0, 64, size=n)),
                        serve.SamplingParams(max_tokens=m)) for n, m in zip(lengths, limits)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sharded_engine_greedy_equals_unsharded(arch, rng):
  """Llama via `shard_model` on an explicit mesh, Gemma 3 built sharded on an auto mesh."""
  model_config = LLAMA if arch == "llama" else GEMMA
  cache = model_config.cache_config(capacity=96, max_seqs=MAX_SEQS, max_write=WIDTH,
                                    initial_capacity=8)
  plain = _livelier(build(model_config, cache, implementation="reference"))
  if arch == "llama":
    mesh = _mesh(2, AxisType.Explicit)
    split = shard_model(plain, mesh)
  else:
    mesh = _mesh(2, AxisType.Auto)
    split = _livelier(build(model_config, cache, implementation="reference", mesh=mesh))
  q_kernel = split.layers[0].attn.q_proj.kernel[...]
  _assert_split(q_kernel, P(None, "tp"), mesh)
  _assert_split(split.layers[0].mlp.down_proj.kernel[...], P("tp", None), mesh)
  np.testing.assert_array_equal(np.asarray(q_kernel),
                                np.asarray(plain.layers[0].attn.q_proj.kernel[...]))
  requests = _requests(rng)
  # Setup precondition: the longest sequence outgrows a ring layer's rows, so rings wrap.
  assert arch == "llama" or max(len(r.prompt) + r.params.max_tokens
                                for r in requests) > cache.ring_rows(0)
  expected = serve.Engine(plain, max_len=MAX_LEN).run(requests)
  engine = serve.Engine(split, max_len=MAX_LEN)
  assert engine.mesh is mesh
  got = engine.run(requests)
  assert [c.tokens for c in got] == [c.tokens for c in expected]
  assert len({t for c in expected for t in c.tokens}) >= 8, "greedy tokens too uniform to compare"
  cache_state = engine.state.cache
  assert cache_state.k[1].shape[0] > cache.initial_flat_rows   # flat rows grew, still split
  for array in cache_state.k + cache_state.v:
    _assert_split(array, P(None, None, "tp", None), mesh)
  for path, leaf in jax.tree_util.tree_flatten_with_path(engine.core.params)[0]:
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, param_spec(path)), leaf.ndim), path


def test_engine_refuses_another_mesh():
  mesh = _mesh(2)
  other = jax.make_mesh((2,), ("tp",), devices=jax.devices()[2:4] if len(jax.devices()) >= 4
                        else jax.devices()[:2][::-1], axis_types=(AxisType.Auto,))
  cache = LLAMA.cache_config(capacity=16, max_seqs=1, max_write=2)
  model = build(LLAMA, cache, mesh=mesh)
  with pytest.raises(ValueError, match=r"mesh=.* differs from the model's mesh"):
    serve.Engine(model, mesh=other)


def test_sharded_model_runner_equals_unsharded(rng):
  """`ModelRunner` takes the model's mesh: same logits step by step, K/V split."""
  mesh = _mesh(2)
  cache = LLAMA.cache_config(capacity=32, max_seqs=2, max_write=WIDTH, initial_capacity=4)
  plain = _livelier(build(LLAMA, cache, implementation="reference"))
  split = shard_model(plain, mesh)
  runners = [serve.ModelRunner(plain), serve.ModelRunner(split)]
  assert runners[1].mesh is mesh and runners[0].mesh is None
  tokens = [int(t) for t in rng.integers(0, LLAMA.vocab_size, size=6)]
  steps = [([0, 0, 0, 1, 1], tokens[:5]), ([0, 1], tokens[5:] + [3])]
  for runner in runners:
    assert runner.seq_new() == 0 and runner.seq_new() == 1
  for ids, toks in steps:
    expected, got = (runner.step(ids, toks) for runner in runners)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-5)
  for array in runners[1].cache.k + runners[1].cache.v:
    _assert_split(array, P(None, None, "tp", None), mesh)


def test_sharded_decode_loop_only_all_reduces_activations():
  """The engine's jitted loop on a mesh: two all-reduces of `[W, hidden]` per layer
  (o_proj, down_proj), no weight or K/V gathered, the K/V donated in place."""
  mesh = _mesh(2)
  cache = LLAMA.cache_config(capacity=32, max_seqs=2, max_write=WIDTH, initial_capacity=16)
  engine = serve.Engine(build(LLAMA, cache, implementation="reference", mesh=mesh), max_len=16)
  queue = pack_queue([(1, 2)], [serve.SamplingParams(max_tokens=3)], max_len=16,
                     max_stop=engine.max_stop)
  ls = init_loop_state(cache, queue, num_widths=len(engine.widths), mesh=mesh)
  compiled = engine.lower(ls, 4).compile()
  moved = [(m.group(2), _shape_of(m.group(1)))
           for m in _COLLECTIVE.finditer(compiled.as_text())]
  assert sorted(moved) == [("all-reduce", (WIDTH, LLAMA.hidden_size))] * 2 * LLAMA.num_layers, moved
  kv_bytes = sum(a.addressable_shards[0].data.nbytes for a in ls.cache.k + ls.cache.v)
  alias = compiled.memory_analysis().alias_size_in_bytes
  assert alias >= kv_bytes, f"{alias=} < per-device K/V bytes {kv_bytes}"


def test_sharded_hf_llama_matches_transformers():
  """`jaxkv.models.hf.load_model(mesh=)` on the committed Llama fixture (4 q / 2 KV heads):
  the sharded model's logits match the `transformers` reference of every sequence."""
  mesh = _mesh(2)
  fixture = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "fixtures", "hf_llama")
  data = np.load(os.path.join(fixture, "logits.npz"))
  count = len([k for k in data.files if k.startswith("tokens_")])
  tokens = [data[f"tokens_{i}"] for i in range(count)]
  model, _, _ = hf.load_model(fixture, capacity=256, max_seqs=count, max_write=8, mesh=mesh)
  _assert_split(model.layers[1].attn.v_proj.kernel[...], P(None, "tp"), mesh)
  runner = serve.ModelRunner(model)
  ids = [runner.seq_new() for _ in range(count)]
  fed, logits = [0] * count, [[] for _ in range(count)]
  with jax.default_matmul_precision("highest"):
    while any(f < len(t) for f, t in zip(fed, tokens)):
      seq_ids, toks, spans = [], [], []
      for i in range(count):   # up to 3 tokens of every unfinished sequence, while W lasts
        n = min(3, len(tokens[i]) - fed[i], 8 - len(seq_ids))
        if n > 0:
          spans.append((i, len(seq_ids), n))
          seq_ids += [ids[i]] * n
          toks += [int(t) for t in tokens[i][fed[i]:fed[i] + n]]
      out = runner.step(seq_ids, toks)
      for i, start, n in spans:
        logits[i].append(out[start:start + n])
        fed[i] += n
  for i in range(count):
    np.testing.assert_allclose(np.concatenate(logits[i]), data[f"logits_{i}"], atol=5e-5, rtol=0,
                               err_msg=f"sequence {i}")
