"""Issue 40 item 5: ids and scalars are checked where they enter the cache, the facade and requests.

Every refusal leaves the state bitwise equal (`assert_same_state`; K/V poisoned
with NaN wherever no token was written, so a stray write or copy shows). The
docstrings say what each test caught before its fix; the ones without a
"Before" guard behaviour that already held.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv import serve
from jaxkv.nnx import CachedAttention
from scenario_utils import assert_same_state, snapshot

pure = jaxkv.pure
flat, ring = jaxkv.LayerPolicy.flat, jaxkv.LayerPolicy.ring
LayerConfig, CacheConfig = jaxkv.LayerConfig, jaxkv.CacheConfig
Status = jaxkv.Status

# Ring of 3 (5 rows with W = 3): sequence 2 writes 7 positions, so its ring wraps and
# its floor is above 0 (CONTRACT §4.2); the last column is the one an out-of-range id
# clamps onto.
CONFIG = CacheConfig([LayerConfig(flat(), 1, 4), LayerConfig(ring(3), 1, 4)], capacity=24,
                     max_seqs=3, max_write=3, kv_dtype=jnp.float32, initial_capacity=8)
PAGED = dataclasses.replace(CONFIG, page_size=2)
W = CONFIG.max_write
BAD_IDS = [-1, CONFIG.max_seqs, CONFIG.max_seqs + 5, 2**31 - 1, -(2**31)]


_STATES: dict = {}


def _nan_state(config):
  """Sequences 0, 1, 2 live holding 2, 1 and 7 tokens; K/V NaN wherever nothing was written.

  Built once per config; each call returns a fresh copy (the verbs donate it).
  """
  if config not in _STATES:
    state = jaxkv.init_state(config)
    nan = lambda arrays: tuple(jnp.full_like(a, jnp.nan) for a in arrays)
    state = dataclasses.replace(state, k=nan(state.k), v=nan(state.v))
    for _ in range(3):
      state, _, _ = pure.seq_new(config, state)
    for ids, n in ([0, 0, 1], 3), ([2, 2, 2], 3), ([2, 2, 2], 3), ([2, 2, 2], 1):
      state, status = _jit(pure.declare_step)(config, state, jnp.asarray(ids, jnp.int32),
                                              jnp.int32(n), jnp.zeros((W, 2), jnp.int32))
      assert int(status) == Status.OK
      state, status = _jit(pure.prepare_step)(config, state)
      assert int(status) == Status.OK
      for layer in range(config.num_layers):
        tokens = jnp.arange(W, dtype=jnp.float32)[:, None, None] + 1.0
        kv = jnp.broadcast_to(tokens, (W, 1, 4))
        state, _, _ = _ATTEND(config, state, layer, jnp.ones((W, 1, 4)), kv, kv,
                              implementation="reference")
      state, status = _jit(pure.commit_step)(config, state)
      assert int(status) == Status.OK
    assert np.asarray(state.pos).tolist() == [2, 1, 7]
    _STATES[config] = state
  return jax.tree.map(jnp.copy, _STATES[config])


_JITTED: dict = {}


def _jit(verb):
  """`verb` jitted once per test session, config static, state donated."""
  if verb not in _JITTED:
    _JITTED[verb] = jax.jit(verb, static_argnums=0, donate_argnums=1)
  return _JITTED[verb]


_ATTEND = jax.jit(pure.attend, static_argnums=(0, 2), donate_argnums=1,
                  static_argnames=("scale", "implementation"))

VERBS = {
    "seq_rm": lambda config, s, i: _jit(pure.seq_rm)(config, s, i),
    "seq_clone": lambda config, s, i: _jit(pure.seq_clone)(config, s, i, jnp.int32(1)),
    "seq_clone-whole": lambda config, s, i: _jit(pure.seq_clone)(
        config, s, i, jnp.int32(pure.WHOLE)),
    "rewind": lambda config, s, i: _jit(pure.rewind)(config, s, i, jnp.int32(1)),
    "rewind-0": lambda config, s, i: _jit(pure.rewind)(config, s, i, jnp.int32(0)),
    "declare_step": lambda config, s, i: _jit(pure.declare_step)(
        config, s, jnp.stack([jnp.int32(0), i, jnp.int32(0)]), jnp.int32(2),
        jnp.zeros((W, 2), jnp.int32)),
}


@pytest.mark.parametrize("config", [CONFIG, PAGED], ids=["columns", "paged"])
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_traced_out_of_range_ids_are_refused_with_a_status(config, verb):
  """Every verb taking an id refuses one outside `[0, max_seqs)`, traced, with NOT_LIVE."""
  before = snapshot(_nan_state(config))
  for seq_id in BAD_IDS:
    out = VERBS[verb](config, _nan_state(config), jnp.int32(seq_id))
    assert int(out[1]) == Status.NOT_LIVE, seq_id
    if verb.startswith("seq_clone"):
      assert int(out[2]) == -1, seq_id
    assert_same_state(before, snapshot(out[0]))


def test_floor_of_an_out_of_range_id_is_zero():
  """`pure.floor` of an id that names no column is 0, as the facade's `floor` of a dead id.

  Before: it answered with the floor of the column the id was clamped onto (2**31 - 1
  gave sequence 2's floor, -1 sequence 0's).
  """
  state = _nan_state(CONFIG)
  floor = jax.jit(pure.floor, static_argnums=0)
  assert int(floor(CONFIG, state, jnp.int32(2))) > 0
  for seq_id in BAD_IDS:
    assert int(floor(CONFIG, state, jnp.int32(seq_id))) == 0, seq_id


# --------------------------------------------------------------------------- wide NumPy ints

WIDE = [np.int64(2**32), np.uint64(2**32), np.int64(2**32 + 2), np.int64(-(2**32))]
WIDE_IDS = ["int64-2**32", "uint64-2**32", "int64-2**32+2", "int64--2**32"]


@pytest.mark.parametrize("wide", WIDE, ids=WIDE_IDS)
def test_facade_refuses_wide_numpy_ids_instead_of_wrapping(wide):
  """`np.int64(2**32)` wraps to id 0 when JAX casts it to int32 at a jit boundary (x64 off):
  the facade checks on the host, so no live sequence is touched."""
  cache = jaxkv.BatchedSequenceCache(CONFIG, implementation="reference")
  for _ in range(3):
    cache.seq_new()
  assert cache.declare_step([0, 0, 2])
  cache.prepare_step()
  for layer in range(2):
    cache.attend(layer, np.ones((3, 1, 4), np.float32), np.ones((3, 1, 4), np.float32),
                 np.ones((3, 1, 4), np.float32))
  cache.commit_step()
  before = snapshot(cache.state)
  assert cache.seq_rm(wide) is False
  assert cache.seq_clone(wide) is None
  assert cache.rewind(wide, 0) is False
  assert cache.rewind(0, wide) is False
  assert cache.declare_step([0, wide]) is False
  assert cache.is_live(wide) is False and cache.pos(wide) == 0 and cache.floor(wide) == 0
  assert_same_state(before, snapshot(cache.state))
  assert cache.is_live(0) and cache.pos(0) == 2


# --------------------------------------------------------------------------- scale

# The facade's refusals of dicts, sets and bad scales are cases of
# test_bad_input.py::test_facade_bad_argument_raises_and_changes_nothing (ENTRY_CASES).


def _facade(phase: str):
  cache = jaxkv.BatchedSequenceCache(CONFIG, implementation="reference")
  cache.seq_new(), cache.seq_new()
  if phase in ("declared", "prepared"):
    assert cache.declare_step([0, 1])
  if phase == "prepared":
    cache.prepare_step()
  return cache


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -1.0],
                         ids=["nan", "inf", "-inf", "0", "-1"])
def test_pure_attend_refuses_a_bad_scale_at_trace_time(scale):
  """Before: `pure.attend(..., scale=nan)` returned NaN for every token."""
  cache = _facade("prepared")
  state = jax.tree.map(jnp.copy, cache.state)
  before = snapshot(state)
  q = jnp.ones((W, 1, 4), jnp.float32)
  with pytest.raises(ValueError, match="scale"):
    _ATTEND(CONFIG, state, 0, q, q, q, scale=scale, implementation="reference")
  assert not any(x.is_deleted() for x in jax.tree.leaves(state)), "state donated by a failed call"
  assert_same_state(before, snapshot(state))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.25],
                         ids=["nan", "inf", "0", "negative"])
def test_cached_attention_refuses_a_bad_scale(scale):
  with pytest.raises(ValueError, match="scale"):
    CachedAttention(CONFIG, 0, features=8, num_heads=1, scale=scale, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("layers, extra", [
    ([LayerConfig(flat(), 1, 4)], {}),
    ([LayerConfig(ring(4), 1, 4)], {}),
    ([LayerConfig(flat(), 1, 4), LayerConfig(ring(2), 1, 4)], {"page_size": 8}),
], ids=["flat", "ring", "paged"])
def test_config_bounds_max_write_by_capacity(layers, extra):
  """Before: `CacheConfig(max_write=10**6)` with capacity 64 was accepted (a step can
  never carry more than capacity tokens; the step arrays were sized by it)."""
  for max_write in (65, 10**6, 2**31 - 1):
    with pytest.raises(ValueError, match=f"max_write={max_write}.*capacity=64"):
      CacheConfig(layers, capacity=64, max_seqs=2, max_write=max_write, **extra)
  config = CacheConfig(layers, capacity=64, max_seqs=2, max_write=64, **extra)
  assert config.step_width == 64


# --------------------------------------------------------------------------- requests

Params, Request = serve.SamplingParams, serve.Request
F32_MAX = float(np.finfo(np.float32).max)

# Before: each was accepted (a dict's keys or a set in hash order as the prompt;
# parameters that become inf, or 0, in the engine's float32).
REQUEST_CASES = [
    ("prompt-dict", lambda: Request({1: 2}), TypeError, "prompt.*dict"),
    ("prompt-set", lambda: Request({1, 2}, request_id="r"), TypeError, "request 'r'.*prompt"),
    ("prompt-frozenset", lambda: Request(frozenset([3])), TypeError, "prompt"),
    ("stop_tokens-set", lambda: Params(stop_tokens={1, 2}), TypeError, "stop_tokens"),
    ("stop_tokens-dict", lambda: Params(stop_tokens={1: 0}), TypeError, "stop_tokens"),
    ("temperature-1e308", lambda: Params(temperature=1e308), ValueError, "temperature.*float32"),
    ("temperature-past-f32", lambda: Params(temperature=F32_MAX * 1.01), ValueError,
     "temperature"),
    ("repetition-1e300", lambda: Params(repetition_penalty=1e300), ValueError,
     "repetition_penalty"),
    ("repetition-underflow", lambda: Params(repetition_penalty=1e-60), ValueError,
     "repetition_penalty"),
    ("top_p-underflow", lambda: Params(top_p=1e-60), ValueError, "top_p"),
]
# Already refused, kept so it stays so (issue 40 lists them for the Python boundary).
REQUEST_GUARDS = [
    ("prompt-str", lambda: Request("12"), TypeError, "prompt"),
    ("prompt-bytes", lambda: Request(b"\x01"), TypeError, "prompt"),
    ("prompt-float-id", lambda: Request([1, 2.0]), TypeError, r"prompt\[1\]"),
    ("prompt-bool-id", lambda: Request([True]), TypeError, r"prompt\[0\]"),
    ("max_tokens-str", lambda: Params(max_tokens="5"), TypeError, "max_tokens"),
    ("max_tokens-bool", lambda: Params(max_tokens=True), TypeError, "max_tokens"),
    ("top_k-float", lambda: Params(top_k=2.0), TypeError, "top_k"),
    ("logprobs-bool", lambda: Params(logprobs=True), TypeError, "logprobs"),
    ("seed-str", lambda: Params(seed="1"), TypeError, "seed"),
    ("temperature-str", lambda: Params(temperature="1"), TypeError, "temperature"),
    ("temperature-bool", lambda: Params(temperature=True), TypeError, "temperature"),
    ("temperature-nan", lambda: Params(temperature=float("nan")), ValueError, "temperature"),
    ("min_p-inf", lambda: Params(min_p=float("inf")), ValueError, "min_p"),
]


@pytest.mark.parametrize("make, error, match", [c[1:] for c in REQUEST_CASES + REQUEST_GUARDS],
                         ids=[c[0] for c in REQUEST_CASES + REQUEST_GUARDS])
def test_requests_refuse_bad_values_naming_the_field(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_request_values_at_the_float32_limits_are_accepted():
  """The largest float32 and tiny positive parameters that stay positive in float32 pass."""
  p = Params(temperature=F32_MAX, repetition_penalty=1e-30, top_p=1e-30)
  assert p.temperature == F32_MAX and p.repetition_penalty == 1e-30
  assert Request([1, 2], p).prompt == (1, 2)
  assert Request(np.array([4, 5], np.uint8)).prompt == (4, 5)
