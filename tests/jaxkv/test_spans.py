"""Spans and isolation: CONTRACT §11 scenarios 1–13.

Scenarios 1–10 run with every implementation (`implementation` fixture) and
with two drivers: the facade, and the pure API with every K/V row that no live
sequence owns NaN-poisoned before each step (so any stray read shows as NaN).
Outputs are compared with `tests/oracle.py`, which shares no code with jaxkv.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drivers import KERNEL_IMPLEMENTATIONS
import jaxkv
from oracle import SequenceOracle, probe_expected, tol
from scenario_utils import (
    HEAD_DIM,
    N_KV_HEADS,
    N_Q_HEADS,
    Harness,
    assert_same_state,
    default_config,
    probe,
    snapshot,
    tok,
    stored_rows,
)

# Every scenario runs with column and paged storage (CONTRACT §3.1).
pytestmark = pytest.mark.usefixtures("storage")

flat = jaxkv.LayerPolicy.flat
ring = jaxkv.LayerPolicy.ring


# (implementation, driver) pairs: the reference runs both drivers; the kernels, whose
# stray reads the poison is there to catch and which are slow under the interpreter, run
# the poisoned pure driver only (the facade adds nothing implementation-specific).
VARIANTS = [(impl, drv) for impl in KERNEL_IMPLEMENTATIONS
            for drv in (("facade", "pure-poisoned") if impl == "reference" else ("pure-poisoned",))]


def pytest_generate_tests(metafunc):
  """Parametrizes tests taking `driver` over VARIANTS (overriding the `implementation` fixture)."""
  if "driver" in metafunc.fixturenames:
    metafunc.parametrize("implementation, driver", VARIANTS,
                         ids=[f"{impl}-{drv}" for impl, drv in VARIANTS])


@pytest.fixture
def make(implementation, driver):
  """Builds a Harness for a config with this test's implementation and driver."""

  def build(config, **kwargs):
    return Harness(config, implementation=implementation, driver=driver, **kwargs)

  return build


def step_positions(step, n):
  return np.asarray(step.positions)[:n].tolist()


# --------------------------------------------------------------------------- 1–10


def test_scenario_01_spans_match_separate_runs(make):
  """Scenario 1: step([a,a,a,b,b]) gets positions [0,1,2,0,1]; rows equal each oracle."""
  h = make(default_config())
  a, b = h.new(), h.new()
  assert (a, b) == (0, 1)
  assert h.expected_positions([a, a, a, b, b]) == [0, 1, 2, 0, 1]
  assert h.cache.declare_step([a, a, a, b, b]) is True
  step = h.cache.prepare_step()
  assert int(step.n_tokens) == 5 and int(step.n_segments) == 2
  assert np.asarray(step.seq_cols).tolist() == [0, 0, 0, 1, 1, 4, 4, 4]
  assert np.asarray(step.write_rows).tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
  assert np.asarray(step.seq_info).tolist() == [[0, 3, 0, 0, 0], [3, 2, 1, 0, 0]] + [
      [5, 0, 4, 0, 0]] * 6
  h.step([a, a, a, b, b])   # re-declared; checks positions and every row against the oracles
  assert (h.cache.pos(a), h.cache.pos(b)) == (3, 2)


def test_scenario_02_decode_continues_each_history(make):
  """Scenario 2: step([a,a,b]) then step([a,b]) at [2,1]."""
  h = make(default_config())
  a, b = h.new(), h.new()
  h.step([a, a, b])
  assert h.expected_positions([a, b]) == [2, 1]
  h.step([a, b], T=8)   # T = W: NaN in the padded q/k/v rows must not reach real rows
  assert (h.cache.pos(a), h.cache.pos(b)) == (3, 2)


def test_scenario_03_sequence_spanned_twice_keeps_order(make):
  """Scenario 3: step([a,b,a]) at [0,0,1] has 3 segments; row 0 does not see a's position 1."""
  h = make(default_config())
  a, b = h.new(), h.new()
  assert h.cache.declare_step([a, b, a]) is True
  step = h.cache.prepare_step()
  assert step_positions(step, 3) == [0, 0, 1]
  assert int(step.n_segments) == 3
  assert np.asarray(step.seq_info)[:4].tolist() == [
      [0, 1, 0, 0, 0], [1, 1, 1, 0, 0], [2, 1, 0, 1, 0], [3, 0, 4, 0, 0]]
  # Re-declaring drops the prepared step (CONTRACT §6.1); the harness step then runs it for real.
  outs = h.step([a, b, a])
  # Row 0 is a's first token alone: attention over one key returns that key's value exactly
  # (as stored), whatever its own query; seeing position 1 would mix in another value.
  _, _, v0 = tok(h.tags[a], 0, 0, n_q_heads=N_Q_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM)
  group = N_Q_HEADS // N_KV_HEADS
  want = np.repeat(v0.astype(np.float16).astype(np.float32), group, axis=0)
  np.testing.assert_allclose(outs[0][0], want, rtol=0, atol=tol(np.float32))


def test_scenario_04_window_bounds_each_span(make):
  """Scenario 4: ring(2), max_write 4 (R = 5); a wraps from p = 5, both rows match every time."""
  config = default_config(layers=[ring(2)], max_write=4)
  assert config.ring_rows(0) == 5
  h = make(config)
  a, b = h.new(), h.new()
  h.step([a, a, a, b])
  assert h.expected_positions([a, b]) == [3, 1]
  h.step([a, b])
  for p in range(4, 9):
    assert h.expected_positions([a, b]) == [p, p - 2]
    h.step([a, b], T=4 if p % 2 else None)
  assert (h.cache.pos(a), h.cache.pos(b)) == (9, 7)


def test_scenario_05_dtype_cast(make):
  """Scenario 5: bfloat16 storage, float32 q/k/v: float32 output, stored K is k.astype(bfloat16)."""
  config = default_config(kv_dtype=jnp.bfloat16)
  h = make(config)
  a, b = h.new(), h.new()
  outs = h.step([a, b])   # row 0 vs the bfloat16 oracle, within tol(bfloat16)
  assert outs[0].dtype == np.float32
  assert h.cache.state.k[0].dtype == np.dtype(jnp.bfloat16)
  for col, s in ((0, a), (1, b)):
    _, k, v = tok(h.tags[s], 0, 0, n_q_heads=N_Q_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM)
    stored_k, stored_v = stored_rows(h.cache.state, config, 0, col, [0])
    assert stored_k[0].tobytes() == k.astype(jnp.bfloat16).tobytes()
    assert stored_v[0].tobytes() == v.astype(jnp.bfloat16).tobytes()


def test_scenario_06_removed_id_starts_over(make):
  """Scenario 6: a removed id reads as not live, is refused, and a reused id starts at 0."""
  h = make(default_config())
  a = h.new()
  h.step([a, a, a])
  assert h.rm(a) is True
  assert h.cache.pos(a) == 0
  assert h.cache.is_live(a) is False
  before = snapshot(h.cache.state)
  assert h.cache.seq_rm(a) is False
  assert_same_state(before, snapshot(h.cache.state))
  assert h.new() == 0
  assert h.cache.pos(0) == 0 and int(np.asarray(h.cache.state.hw)[0]) == 0
  h.step([0])   # a fresh oracle: the removed sequence's rows must not be seen


def test_scenario_07_ill_formed_steps(implementation):
  """Scenario 7 (two flat layers): phase errors, position errors, repeat prepare and attend."""
  config = default_config(layers=[flat(), flat()])
  h = Harness(config, implementation=implementation)
  cache = h.cache
  a = h.new()
  q, k, v = (jnp.asarray(x) for x in h._layer_inputs(0, [h.tags[a]] * 2, [0, 1], None))
  before = snapshot(cache.state)
  with pytest.raises(jaxkv.StepError, match="NOT_PREPARED"):
    cache.attend(0, q, k, v)
  assert_same_state(before, snapshot(cache.state))

  assert cache.declare_step([a, a]) is True
  for bad in ([0], [1, 2]):
    before = snapshot(cache.state)
    with pytest.raises(jaxkv.StepError, match="BAD_POSITIONS"):
      cache.prepare_step(bad)
    assert_same_state(before, snapshot(cache.state))
  step1 = snapshot(cache.prepare_step([0, 1]))
  step2 = snapshot(cache.prepare_step([0, 1]))
  assert_same_state(step1, step2)
  assert_same_state(step1, snapshot(cache.prepare_step()))
  before = snapshot(cache.state)
  with pytest.raises(jaxkv.StepError, match="BAD_POSITIONS"):
    cache.prepare_step([0, 2])
  assert_same_state(before, snapshot(cache.state))
  assert int(cache.state.phase) == jaxkv.Phase.PREPARED
  with pytest.raises(jaxkv.StepError, match=r"layer=2"):
    cache.attend(2, q, k, v)
  assert_same_state(before, snapshot(cache.state))

  out_a = np.asarray(cache.attend(0, q, k, v))
  out_b = np.asarray(cache.attend(0, q, k, v))
  assert out_a.tobytes() == out_b.tobytes()
  q1, k1, v1 = (jnp.asarray(x) for x in h._layer_inputs(1, [h.tags[a]] * 2, [0, 1], None))
  out_1 = np.asarray(cache.attend(1, q1, k1, v1))
  assert cache.pos(a) == 0
  cache.commit_step()
  assert cache.pos(a) == 2
  oracle = SequenceOracle([None, None], np.float16, 1 / math.sqrt(HEAD_DIM))
  np.testing.assert_allclose(out_a, oracle.feed(0, q, k, v), rtol=0, atol=tol(np.float16))
  np.testing.assert_allclose(out_1, oracle.feed(1, q1, k1, v1), rtol=0, atol=tol(np.float16))


def test_scenario_08_fork_copies_prefix_then_diverges(make):
  """Scenario 8: seq_clone(a) has pos = hw = 2; upto 100 clamps; equal content gives equal rows."""
  h = make(default_config())
  a = h.new()
  h.step([a, a])
  b = h.clone(a)
  assert b == 1
  assert h.cache.pos(b) == 2 and int(np.asarray(h.cache.state.hw)[b]) == 2
  c = h.clone(a, 100)
  assert c == 2 and h.cache.pos(c) == 2
  # CONTRACT §5 seq_clone EMPTY: keep = min(upto, pos(src)) <= 0 is refused, state unchanged.
  d = h.new()
  for src, upto in ((a, 0), (a, -3), (d, None), (d, 5)):
    before = snapshot(h.cache.state)
    assert h.cache.seq_clone(src, upto) is None
    assert_same_state(before, snapshot(h.cache.state))
  assert h.rm(d) is True
  outs = h.step([a, b], tags=[h.tags[a], h.tags[a]])   # both against their (equal) oracles
  assert outs[0][0].tobytes() == outs[0][1].tobytes()
  assert (h.cache.pos(a), h.cache.pos(b), h.cache.pos(c)) == (3, 3, 2)


def test_scenario_09_partial_flat_fork_copies_only_prefix(make):
  """Scenario 9: f = seq_clone(src, 3); after seq_rm(src), f at 3 sees src's 0..2 then its own 3."""
  h = make(default_config())
  src = h.new()
  h.step([src] * 8)
  f = h.clone(src, 3)
  assert f is not None and h.cache.pos(f) == 3
  assert h.rm(src) is True
  h.step([f])   # oracle: src's tokens 0..2, then f's token 3
  h.step([f, f])
  assert h.cache.pos(f) == 6


@pytest.mark.columns_only   # paged storage never grows; its forks are tests/jaxkv/test_paged.py's
def test_scenario_10_fork_and_source_diverge_while_rows_grow(make):
  """Scenario 10: initial_capacity 2; F grows 2 -> 4 -> 8 -> 16 under decode and a fork."""
  config = default_config(initial_capacity=2)
  h = make(config)
  a = h.new()
  assert h.cache.state.k[0].shape[0] == 2
  rows = []
  for _ in range(8):
    h.step([a])
    rows.append(h.cache.state.k[0].shape[0])
  assert rows == [2, 2, 4, 4, 8, 8, 8, 8]
  b = h.clone(a, 3)
  assert h.cache.pos(b) == 3
  for i in range(3):
    assert h.expected_positions([a, b]) == [8 + i, 3 + i]
    h.step([a, b])
    assert h.cache.state.k[0].shape[0] == 16
    assert h.cache.state.v[0].shape[0] == 16


# Every group size with the reference; the kernels (slow under the interpreter) with g = 4.
GQA_CASES = [("reference", 2, 2), ("reference", 4, 1), ("reference", 8, 2)] + [
    (impl, 8, 2) for impl in KERNEL_IMPLEMENTATIONS if impl != "reference"]


@pytest.mark.parametrize("implementation, n_q_heads, n_kv_heads", GQA_CASES,
                         ids=[f"{i}-hq{q}-hkv{k}" for i, q, k in GQA_CASES])
def test_spans_gqa_groups(implementation, n_q_heads, n_kv_heads):
  """CONTRACT §8 GQA/MQA: query head h reads KV head h // g, for g = 1, H_q and 4 (scenario 1 shape)."""
  layers = [jaxkv.LayerConfig(flat(), n_kv_heads, HEAD_DIM),
            jaxkv.LayerConfig(ring(3), n_kv_heads, 16)]
  h = Harness(default_config(layers=layers), implementation=implementation,
              driver="pure-poisoned", n_q_heads=n_q_heads)
  a, b = h.new(), h.new()
  h.step([a, a, a, b, b])
  h.step([b, a, b], T=8)
  h.step([a, b, a, a])


@pytest.mark.parametrize("max_write", [1, 3, 8])
def test_spans_ring_before_at_after_wrap(max_write):
  """STYLE §5 product: max_write 1, 3, W over [flat, ring(3)], two sequences past the wrap."""
  config = default_config(layers=[flat(), ring(3)], max_write=max_write, capacity=64,
                          kv_dtype=jnp.float32, initial_capacity=64)
  h = Harness(config, driver="pure-poisoned")
  a, b = h.new(), h.new()
  rows = config.ring_rows(1)
  assert rows == min(64, 3 + max_write - 1)
  total = 0
  while h.pos(a) < 2 * rows + 2:   # every ring row rewritten at least twice
    n = min(max_write, 3)
    ids = ([a] * (n - 1) + [b]) if n > 1 else [a if total % 3 else b]
    h.step(ids, T=max_write if total % 2 else None)
    total += 1
  assert h.cache.pos(a) == h.pos(a)


def test_explicit_scale(implementation):
  """CONTRACT §6.4: attend(scale=...) replaces 1/sqrt(head_dim); float32 storage, tight tolerance."""
  config = default_config(layers=[flat(), ring(2)], max_write=4, kv_dtype=jnp.float32)
  h = Harness(config, implementation=implementation, scale=0.75, driver="pure-poisoned")
  a, b = h.new(), h.new()
  h.step([a, a, b, a])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_output_follows_q_dtype(implementation, dtype):
  """CONTRACT §6.4: the output comes back in q's dtype (here 16-bit q/k/v over float32 storage)."""
  config = default_config(kv_dtype=jnp.float32)
  cache = jaxkv.BatchedSequenceCache(config, implementation=implementation)
  a = cache.seq_new()
  q, k, v = tok(7, 0, 0)
  q, k, v = (jnp.asarray(x[None]).astype(dtype) for x in (q, k, v))
  assert cache.declare_step([a]) is True
  cache.prepare_step()
  out = cache.attend(0, q, k, v)
  assert out.dtype == np.dtype(dtype)
  cache.commit_step()
  # One visible key: the output is that key's value (as stored), per GQA group.
  want = np.repeat(np.asarray(v[0], np.float32), N_Q_HEADS // N_KV_HEADS, axis=0)
  np.testing.assert_allclose(np.asarray(out[0], np.float32), want, rtol=0, atol=tol(dtype))


# --------------------------------------------------------------------------- 11–13


def test_scenario_11_refused_declaration_leaves_last_standing():
  """Scenario 11: refused declarations change nothing; the first one is still prepared."""
  h = Harness(default_config())
  cache = h.cache
  a = h.new()
  assert cache.declare_step([a]) is True
  for bad in ([3], [], [a] * 9):
    before = snapshot(cache.state)
    assert cache.declare_step(bad) is False
    assert_same_state(before, snapshot(cache.state))
  step = cache.prepare_step()
  assert step_positions(step, 8) == [0] * 8 and int(step.n_tokens) == 1
  q, k, v = (jnp.asarray(x) for x in h._layer_inputs(0, [h.tags[a]], [0], None))
  cache.attend(0, q, k, v)
  cache.commit_step()
  assert cache.pos(a) == 1


def test_scenario_12_shared_capacity():
  """Scenario 12: capacity 4, max_write 4: the shared budget refuses declarations and clones."""
  h = Harness(default_config(capacity=4, max_write=4))
  cache = h.cache
  a, b = h.new(), h.new()
  h.step([a, a, b])
  assert (cache.pos(a), cache.pos(b)) == (2, 1)
  h.step([a])
  assert int(cache.state.held) == 4
  for bad in ([a], [b]):
    before = snapshot(cache.state)
    assert cache.declare_step(bad) is False
    assert_same_state(before, snapshot(cache.state))
  before = snapshot(cache.state)
  assert cache.seq_clone(a) is None
  assert_same_state(before, snapshot(cache.state))
  assert h.rm(b) is True
  assert int(cache.state.held) == 3
  assert cache.declare_step([a]) is True


def test_scenario_13_public_surface():
  """Scenario 13: exports, StepError is a ValueError, state leaf shapes, stable enum values."""
  for name in ("CacheConfig", "LayerConfig", "LayerPolicy", "BatchedSequenceCache", "StepError",
               "Status", "Phase", "Step", "CacheState", "init_state", "pure"):
    assert hasattr(jaxkv, name), name
  assert issubclass(jaxkv.StepError, ValueError)
  assert [(s.name, int(s)) for s in jaxkv.Status] == [
      ("OK", 0), ("NOT_LIVE", 1), ("NO_ROOM", 2), ("NO_FREE_ID", 3), ("EMPTY", 4),
      ("TOO_WIDE", 5), ("BAD_BLOCKS", 6), ("BAD_TARGET", 7), ("BELOW_FLOOR", 8),
      ("NO_DECLARATION", 9), ("BAD_POSITIONS", 10), ("NEEDS_ROWS", 11), ("NOT_PREPARED", 12),
      ("NOT_ATTENDED", 13), ("TOO_LONG", 14)]
  assert [(p.name, int(p)) for p in jaxkv.Phase] == [
      ("IDLE", 0), ("DECLARED", 1), ("PREPARED", 2), ("COMMITTED", 3)]
  assert jaxkv.pure.WHOLE == 2**31 - 1

  config = default_config(layers=[flat(), ring(4)], capacity=64, initial_capacity=16)
  assert hash(config) == hash(default_config(layers=[flat(), ring(4)], capacity=64,
                                             initial_capacity=16))
  state = jaxkv.init_state(config)
  assert isinstance(state, jaxkv.CacheState) and isinstance(state.step, jaxkv.Step)
  leaves = jax.tree_util.tree_leaves(state)
  assert all(isinstance(x, jax.Array) for x in leaves)
  W, S, L = 8, 4, 2
  # Flat: 16 columns rows, or paged (CONTRACT §3.1) ceil(64 / P) + S + 1 pages of P rows.
  P = config.page_size
  flat_shape = (16, S + 1, 2, 8) if P is None else (-(-64 // P) + S + 1, P, 2, 8)
  expect = {
      "k": [flat_shape, (11, S + 1, 2, 8)], "v": [flat_shape, (11, S + 1, 2, 8)],
      "live": (S,), "pos": (S,), "hw": (S,), "held": (), "phase": (), "decl_ids": (W,),
      "decl_block": (W,), "decl_n": (),
  }
  for name, shape in expect.items():
    value = getattr(state, name)
    if isinstance(shape, list):
      assert [a.shape for a in value] == shape, name
      assert all(a.dtype == np.dtype(jnp.float16) for a in value), name
      assert all(not np.any(np.asarray(a, np.float32)) for a in value), name
    else:
      assert value.shape == shape and value.dtype == np.int32, name
  assert int(state.phase) == jaxkv.Phase.IDLE
  assert not np.any(np.asarray(state.live)) and int(state.held) == 0
  step_shapes = {"n_tokens": (), "n_segments": (), "seq_cols": (W,), "positions": (W,),
                 "write_rows": (L, W), "seq_info": (W, 5)}
  for name, shape in step_shapes.items():
    value = getattr(state.step, name)
    assert value.shape == shape and value.dtype == np.int32, name


def test_scenario_13_facade_implementation_argument():
  """CONTRACT §10.5, §10.7: implementation=None works on any platform; unknown names are refused."""
  config = default_config()
  h = Harness(config, implementation=None)
  a, b = h.new(), h.new()
  h.step([a, b, a])
  with pytest.raises(ValueError, match="implementation"):
    jaxkv.BatchedSequenceCache(config, implementation="triton")


def test_scenario_13_jitted_pure_step_traces_once():
  """Scenario 13: one jitted pure step, driven through 20 varied steps, traces once and is exact."""
  config = default_config(layers=[flat(), ring(3)], capacity=128, initial_capacity=128, max_write=4,
                          kv_dtype=jnp.float32)
  W = config.step_width
  traces = []

  def one_step(cfg, state, ids, n, q0, k0, v0, q1, k1, v1):
    traces.append(1)
    blocks = jnp.zeros((W, 2), jnp.int32)
    state, s_decl = jaxkv.pure.declare_step(cfg, state, ids, n, blocks)
    state, s_prep = jaxkv.pure.prepare_step(cfg, state)
    state, out0, s_att0 = jaxkv.pure.attend(cfg, state, 0, q0, k0, v0, implementation="reference")
    state, out1, s_att1 = jaxkv.pure.attend(cfg, state, 1, q1, k1, v1, implementation="reference")
    state, s_commit = jaxkv.pure.commit_step(cfg, state)
    statuses = jnp.stack([s_decl, s_prep, s_att0, s_att1, s_commit])
    return state, out0, out1, statuses

  jstep = jax.jit(one_step, static_argnums=0)
  jnew = jax.jit(jaxkv.pure.seq_new, static_argnums=0)
  state = jaxkv.init_state(config)
  ids = []
  for _ in range(3):
    state, status, s = jnew(config, state)
    assert int(status) == jaxkv.Status.OK
    ids.append(int(s))
  assert ids == [0, 1, 2]
  scale = 1 / math.sqrt(HEAD_DIM)
  oracles = {s: SequenceOracle([None, 3], np.float32, scale) for s in ids}
  pos = {s: 0 for s in ids}
  rng = np.random.default_rng([13, 0, 0])
  for it in range(20):
    n = int(rng.integers(1, W + 1))
    step_ids = [int(x) for x in rng.choice(ids, size=n)]
    positions = []
    counts = {}
    for s in step_ids:
      positions.append(pos[s] + counts.get(s, 0))
      counts[s] = counts.get(s, 0) + 1
    layers = []
    for l in range(2):
      triples = [tok(50 + s, p, l, n_q_heads=N_Q_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM)
                 for s, p in zip(step_ids, positions)]
      q, k, v = (np.stack(x) for x in zip(*triples))
      layers.append((q, k, v))
    padded = [tuple(jnp.asarray(np.concatenate(
        [x, np.zeros((W - n,) + x.shape[1:], np.float32)])) for x in lay) for lay in layers]
    ids_arr = np.full((W,), config.max_seqs, np.int32)
    ids_arr[:n] = step_ids
    state, out0, out1, statuses = jstep(config, state, jnp.asarray(ids_arr), jnp.int32(n),
                                        *padded[0], *padded[1])
    assert np.asarray(statuses).tolist() == [0] * 5, (it, np.asarray(statuses))
    assert np.asarray(state.step.positions)[:n].tolist() == positions
    for l, out in enumerate((out0, out1)):
      want = np.zeros((n, N_Q_HEADS, HEAD_DIM))
      t = 0
      while t < n:   # runs of one id, in step order
        u = t
        while u < n and step_ids[u] == step_ids[t]:
          u += 1
        q, k, v = layers[l]
        want[t:u] = oracles[step_ids[t]].feed(l, q[t:u], k[t:u], v[t:u])
        t = u
      np.testing.assert_allclose(np.asarray(out)[:n], want, rtol=0, atol=tol(np.float32),
                                 err_msg=f"step {it} layer {l}")
    for s in step_ids:
      pos[s] += 1
  assert len(traces) == 1
  assert np.asarray(state.pos).tolist() == [pos[s] for s in ids] + [0]


# --------------------------------------------------------------------------- the oracle itself


def _probe_feed(oracle, layer, positions, *, block=False):
  triples = [probe(p) for p in positions]
  q, k, v = (np.stack(x) for x in zip(*triples))
  return oracle.feed(layer, q, k, v, block=block)[:, 0, :2]


def test_oracle_reproduces_spec_worked_examples():
  """The oracle gives the CONTRACT's own probe numbers (§7.3, §9; scenarios 42 and 46)."""
  # §7.3: [flat, ring(4)], a at 5, step [a, a, b, a]: ring 4.5, 5.5, 1, 6.5; flat 3.5, 4, 1, 4.5.
  a = SequenceOracle([None, 4], np.float32, 1.0)
  b = SequenceOracle([None, 4], np.float32, 1.0)
  for l in range(2):
    _probe_feed(a, l, range(5))
  got = {}
  for l in range(2):
    rows = [_probe_feed(a, l, [5, 6]), _probe_feed(b, l, [0]), _probe_feed(a, l, [7])]
    got[l] = np.concatenate(rows)[:, 0].tolist()
  # A tolerance, not ==: float sums differ in the last bit between CPUs' summation paths.
  np.testing.assert_allclose(got[0], [3.5, 4.0, 1.0, 4.5], rtol=1e-6)
  np.testing.assert_allclose(got[1], [4.5, 5.5, 1.0, 6.5], rtol=1e-6)
  # §7.3 wrap case: ring(4), a at 9, two tokens: the queries see 6..9 and 7..10.
  w = SequenceOracle([4], np.float32, 1.0)
  _probe_feed(w, 0, range(9))
  np.testing.assert_allclose(_probe_feed(w, 0, [9, 10])[:, 0], [8.5, 9.5], rtol=1e-6)
  # §9 / scenario 46: [flat, ring(2)], x at 6, a block of 4: 5.5 (flat) and 8 (ring);
  # a causal query at 6 would read 6.5 on the ring; block K/V are not kept.
  x = SequenceOracle([None, 2], np.float32, 1.0)
  for l in range(2):
    _probe_feed(x, l, range(6))
  np.testing.assert_allclose(_probe_feed(x, 0, [6, 7, 8, 9], block=True)[:, 0], [5.5] * 4, rtol=1e-6)
  np.testing.assert_allclose(_probe_feed(x, 1, [6, 7, 8, 9], block=True)[:, 0], [8.0] * 4, rtol=1e-6)
  assert (x.length(0), x.length(1)) == (6, 6)
  np.testing.assert_allclose(_probe_feed(x, 1, [6])[:, 0], [6.5], rtol=1e-6)
  # Channel 1 is the mean of squares; rewind and fork keep exactly a prefix.
  np.testing.assert_allclose(_probe_feed(x.fork(3), 0, [3])[0], probe_expected(range(4)))
  x.rewind(2)
  assert (x.length(0), x.length(1)) == (2, 2)
  np.testing.assert_allclose(_probe_feed(x, 1, [2])[0], probe_expected([1, 2]))


@pytest.mark.columns_only   # the paged poison: tests/jaxkv/test_paged.py
def test_poison_free_storage_keeps_owned_rows_only():
  """The NaN poison covers free columns, scratch and unowned rows, and nothing a sequence owns."""
  config = default_config(layers=[flat(), ring(2)], max_write=1, kv_dtype=jnp.float32)
  h = Harness(config, driver="pure-poisoned", content="probe")
  a, b = h.new(), h.new()
  for _ in range(5):
    h.step([a])
  h.step([b])
  assert h.rewind(a, 4) is True   # hw 5, floor 4 (R = 2): ring rows of position 3 and 4 differ
  h.cache.poison()
  k0, k1 = (np.asarray(x) for x in h.cache.state.k)
  assert np.all(np.isnan(k0[4:, a])) and not np.any(np.isnan(k0[:4, a]))
  assert np.all(np.isnan(k0[1:, b])) and not np.any(np.isnan(k0[:1, b]))
  assert np.all(np.isnan(k0[:, 2:]))                  # free columns and scratch
  assert not np.any(np.isnan(k1[3 % 2, a])) and np.all(np.isnan(k1[4 % 2, a]))
  h.step([a])   # still exact: nothing the cache keeps was poisoned
  h.step([b])
