"""`jaxkv.nnx.CachedAttention` against a dense NumPy float64 attention over whole sequences."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv import pure
from jaxkv.nnx import CachedAttention, RMSNorm, RopeScaling, rope_inv_freq
from oracle import attend_naive, default_scale, tol, visible_positions

FEATURES, HEADS, KV_HEADS, HEAD_DIM, WIDTH = 16, 4, 2, 8, 4


def _config(policy, *, max_seqs=3, capacity=128, kv_dtype=jnp.float32):
  layer = jaxkv.LayerConfig(policy, KV_HEADS, HEAD_DIM)
  return jaxkv.CacheConfig([layer], capacity=capacity, max_seqs=max_seqs, max_write=WIDTH,
                           kv_dtype=kv_dtype, initial_capacity=capacity)


def _weights(module):
  get = lambda lin: np.asarray(lin.kernel[...], np.float64)
  return {name: get(getattr(module, name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


def _rms(x, weight, offset):
  normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  return normed * (offset + weight)


def _rope(x, positions, theta):
  inv = 1.0 / theta ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
  ang = positions[:, None] * inv[None, :]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  x1, x2 = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _dense(module, xs, window, *, theta=10000.0, qk_norm=None):
  """Float64 causal (windowed) attention of one whole sequence `xs [T, F]`."""
  w = _weights(module)
  t = xs.shape[0]
  q = (xs @ w["q_proj"]).reshape(t, HEADS, HEAD_DIM)
  k = (xs @ w["k_proj"]).reshape(t, KV_HEADS, HEAD_DIM)
  v = (xs @ w["v_proj"]).reshape(t, KV_HEADS, HEAD_DIM)
  if qk_norm == "gemma":
    q = _rms(q, np.asarray(module.q_norm.weight[...], np.float64), 1.0)
    k = _rms(k, np.asarray(module.k_norm.weight[...], np.float64), 1.0)
  pos = np.arange(t, dtype=np.float64)
  q, k = _rope(q, pos, theta), _rope(k, pos, theta)
  visible = np.zeros((t, t), bool)
  for i in range(t):
    visible[i, visible_positions(i, window)] = True
  out = attend_naive(q, k, v, visible, default_scale(HEAD_DIM))
  return out.reshape(t, HEADS * HEAD_DIM) @ w["o_proj"]


def _step(config, module, state, seq_ids, x):
  """declare → prepare → module → commit, padded to W; returns (out [n, F], state)."""
  n = len(seq_ids)
  ids = np.full((WIDTH,), config.max_seqs, np.int32)
  ids[:n] = seq_ids
  xs = np.zeros((WIDTH, FEATURES), np.float32)
  xs[:n] = x
  state, status = pure.declare_step(config, state, jnp.asarray(ids), jnp.int32(n),
                                    jnp.zeros((WIDTH, 2), jnp.int32))
  assert int(status) == jaxkv.Status.OK
  state, status = pure.prepare_step(config, state)
  assert int(status) == jaxkv.Status.OK
  out, state = module(jnp.asarray(xs), state)
  state, status = pure.commit_step(config, state)
  assert int(status) == jaxkv.Status.OK
  return np.asarray(out[:n]), state


@pytest.mark.parametrize("window", [None, 3], ids=["flat", "ring3"])
@pytest.mark.parametrize("qk_norm", [None, "gemma"])
def test_interleaved_steps_equal_dense_attention(rng, window, qk_norm):
  """Two sequences, chunked prefill mixed with decode, ring wrapping: each equals its dense pass."""
  policy = jaxkv.LayerPolicy.flat() if window is None else jaxkv.LayerPolicy.ring(window)
  config = _config(policy)
  module = CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, qk_norm=qk_norm,
                           rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  if qk_norm:   # Gemma norms start at zero weight: make them matter
    module.q_norm.weight[...] = jnp.asarray(rng.normal(size=HEAD_DIM), jnp.float32)
    module.k_norm.weight[...] = jnp.asarray(rng.normal(size=HEAD_DIM), jnp.float32)
  xs = {s: rng.standard_normal((20, FEATURES)).astype(np.float32) for s in (0, 1)}
  state = jaxkv.init_state(config)
  for _ in range(2):
    state, _, _ = pure.seq_new(config, state)
  fed = {0: 0, 1: 0}
  outs = {0: [], 1: []}
  plan = [[(0, 3), (1, 1)], [(0, 1), (1, 3)], [(1, 2), (0, 2)], [(0, 4)], [(1, 4)],
          [(0, 1), (1, 1)], [(0, 2), (1, 2)], [(1, 1), (0, 3)], [(0, 1), (1, 1)]]
  for step in plan:
    seq_ids, x = [], []
    for s, count in step:
      seq_ids += [s] * count
      x.append(xs[s][fed[s]:fed[s] + count])
      fed[s] += count
    out, state = _step(config, module, state, seq_ids, np.concatenate(x))
    row = 0
    for s, count in step:
      outs[s].append(out[row:row + count])
      row += count
  for s in (0, 1):
    got = np.concatenate(outs[s])
    want = _dense(module, xs[s][:fed[s]].astype(np.float64), window, qk_norm=qk_norm)
    np.testing.assert_allclose(got, want, atol=tol(jnp.float32) * 10, rtol=0)
  # Negative control: the same outputs are far from the other policy's dense pass.
  other = _dense(module, xs[0][:fed[0]].astype(np.float64), 2 if window is None else None,
                 qk_norm=qk_norm)
  assert np.abs(np.concatenate(outs[0]) - other).max() > 1e-3


def test_state_in_and_out_only():
  """The module holds only parameters; the cache lives in the state passed through it."""
  config = _config(jaxkv.LayerPolicy.flat())
  module = CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, qk_norm="llama",
                           rngs=nnx.Rngs(0))
  everything = jax.tree.leaves(nnx.state(module))
  params = jax.tree.leaves(nnx.state(module, nnx.Param))
  assert len(everything) == len(params) == 6   # q, k, v, o kernels and two norm weights
  before = [np.asarray(x).copy() for x in everything]
  state = jaxkv.init_state(config)
  state, _, _ = pure.seq_new(config, state)
  _, state = _step(config, module, state, [0, 0], np.ones((2, FEATURES), np.float32))
  assert int(state.pos[0]) == 2 and float(jnp.abs(state.k[0][:2, 0]).max()) > 0
  for b, a in zip(before, jax.tree.leaves(nnx.state(module))):
    np.testing.assert_array_equal(b, np.asarray(a))


def test_traces_once_in_a_donated_while_loop(rng):
  """The module runs inside one jitted while_loop with the state donated; one trace."""
  config = _config(jaxkv.LayerPolicy.ring(3), max_seqs=2)
  module = CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, rngs=nnx.Rngs(1))
  graphdef, params = nnx.split(module)
  xs = rng.standard_normal((10, WIDTH, FEATURES)).astype(np.float32)

  def loop(params, state, xs):
    m = nnx.merge(graphdef, params)
    ids = jnp.array([0, 1] + [config.max_seqs] * (WIDTH - 2), jnp.int32)

    def body(i, carry):
      state, acc = carry
      state, _ = pure.declare_step(config, state, ids, jnp.int32(2),
                                   jnp.zeros((WIDTH, 2), jnp.int32))
      state, _ = pure.prepare_step(config, state)
      out, state = m(xs[i], state)
      state, _ = pure.commit_step(config, state)
      return state, acc + out[:2].sum()

    return jax.lax.fori_loop(0, xs.shape[0], body, (state, jnp.float32(0)))

  jitted = jax.jit(chex.assert_max_traces(loop, n=1), donate_argnums=1)
  state = jaxkv.init_state(config)
  for _ in range(2):
    state, _, _ = pure.seq_new(config, state)
  state, acc = jitted(params, state, jnp.asarray(xs))
  state, acc2 = jitted(params, state, jnp.asarray(xs))
  assert [int(p) for p in state.pos] == [20, 20]
  assert np.isfinite(float(acc)) and np.isfinite(float(acc2))


def test_owner_block_queries_see_the_whole_block(rng):
  """A block's first query changes with the block's last token; a causal first query does not."""
  config = _config(jaxkv.LayerPolicy.flat(), max_seqs=1)
  module = CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, rngs=nnx.Rngs(2))
  x = rng.standard_normal((WIDTH, FEATURES)).astype(np.float32)
  x2 = x.copy()
  x2[WIDTH - 1] += 1.0

  def run(xs, blocks):
    state = jaxkv.init_state(config)
    state, _, _ = pure.seq_new(config, state)
    b = np.zeros((WIDTH, 2), np.int32)
    for i, block in enumerate(blocks):
      b[i] = block
    state, st = pure.declare_step(config, state, jnp.zeros((WIDTH,), jnp.int32),
                                  jnp.int32(WIDTH), jnp.asarray(b))
    assert int(st) == jaxkv.Status.OK
    state, _ = pure.prepare_step(config, state)
    out, state = module(jnp.asarray(xs), state)
    return np.asarray(out)

  assert np.abs(run(x, [(0, WIDTH)])[0] - run(x2, [(0, WIDTH)])[0]).max() > 1e-4
  np.testing.assert_array_equal(run(x, [])[0], run(x2, [])[0])


def test_rope_scaling_and_helpers():
  base = rope_inv_freq(8, 10000.0)
  np.testing.assert_allclose(rope_inv_freq(8, 10000.0, RopeScaling("linear", 4.0)), base / 4)
  llama3 = rope_inv_freq(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
  high = rope_inv_freq(128, 500000.0)
  assert llama3[0] == high[0] and np.isclose(llama3[-1], high[-1] / 8)
  assert RopeScaling.from_hf({"rope_type": "linear", "factor": 2.0}) == RopeScaling("linear", 2.0)
  norm = RMSNorm(4, offset=1.0)
  np.testing.assert_allclose(norm(jnp.array([[3.0, 4.0, 0.0, 0.0]], jnp.float32)),
                             [[3 / np.sqrt(6.25 + 1e-6), 4 / np.sqrt(6.25 + 1e-6), 0, 0]],
                             rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=3), "num_heads=3"),
    (dict(layer=1), "layer=1"),
    (dict(qk_norm="bogus"), "qk_norm="),
    (dict(implementation="triton"), "implementation="),
    (dict(features=0), "features=0"),
])
def test_bad_arguments_raise(kwargs, match):
  config = _config(jaxkv.LayerPolicy.flat())
  args = dict(layer=0, features=FEATURES, num_heads=HEADS) | kwargs
  layer = args.pop("layer")
  with pytest.raises(ValueError, match=match):
    CachedAttention(config, layer, rngs=nnx.Rngs(0), **args)
  with pytest.raises(ValueError, match="kind="):
    RopeScaling("yarn")


def test_wrong_input_shape_raises():
  config = _config(jaxkv.LayerPolicy.flat())
  module = CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="x must be"):
    module(jnp.zeros((WIDTH + 1, FEATURES), jnp.float32), jaxkv.init_state(config))


def test_bucketed_projections_match_full_width(rng):
  """With `bucket`, small steps run the projections on fewer rows; outputs are unchanged."""
  config = _config(jaxkv.LayerPolicy.ring(3), max_seqs=2)
  full = CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, rngs=nnx.Rngs(4))
  small = CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, bucket=2,
                          rngs=nnx.Rngs(4))
  outs = {}
  for name, module in (("full", full), ("small", small)):
    state = jaxkv.init_state(config)
    for _ in range(2):
      state, _, _ = pure.seq_new(config, state)
    xs = np.random.default_rng(0).standard_normal((6, WIDTH, FEATURES)).astype(np.float32)
    got = []
    for i, ids in enumerate([[0, 0, 1, 1], [0], [0, 1], [1, 1, 1], [1], [0, 1]]):
      out, state = _step(config, module, state, ids, xs[i][:len(ids)])
      got.append(out)
    outs[name] = np.concatenate(got)
  np.testing.assert_allclose(outs["small"], outs["full"], atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="bucket=0"):
    CachedAttention(config, 0, features=FEATURES, num_heads=HEADS, bucket=0, rngs=nnx.Rngs(0))
