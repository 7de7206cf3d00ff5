"""Declarations, positions and lifecycle: CONTRACT §11 scenarios 22–36 (two flat layers).

Every refusal is checked by value and by a bitwise state snapshot (scratch
column excluded) taken before the call. Numerics are compared with
`tests/oracle.py` or, in scenario 22, with attention computed directly in NumPy
from the stored K/V.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from oracle import attend_naive, default_scale, tol
from scenario_utils import (
    HEAD_DIM,
    N_KV_HEADS,
    N_Q_HEADS,
    Harness,
    assert_same_state,
    default_config,
    snapshot,
    stored_rows,
    flat_row_count,
)

# Every scenario runs with column and paged storage (CONTRACT §3.1).
pytestmark = pytest.mark.usefixtures("storage")

flat = jaxkv.LayerPolicy.flat
ring = jaxkv.LayerPolicy.ring

TWO_FLAT = [flat(), flat()]


@pytest.fixture(params=["facade", "pure-poisoned"])
def driver(request):
  """Drives numeric scenarios through the facade or the NaN-poisoned pure API."""
  return request.param


def harness(driver="facade", **overrides):
  overrides.setdefault("layers", TWO_FLAT)
  return Harness(default_config(**overrides), driver=driver)


def inputs(h, l, seq_ids, positions):
  """jnp q/k/v for the harness's content of these tokens on layer l."""
  tags = [h.tags[s] for s in seq_ids]
  return tuple(jnp.asarray(x) for x in h._layer_inputs(l, tags, positions, None))


def assert_refused(cache, call):
  """`call()` returns False or None and leaves the state bitwise unchanged."""
  before = snapshot(cache.state)
  result = call()
  assert result is False or result is None, result
  assert_same_state(before, snapshot(cache.state))


def assert_step_error(cache, match, call):
  """`call()` raises StepError matching `match` and leaves the state bitwise unchanged."""
  before = snapshot(cache.state)
  with pytest.raises(jaxkv.StepError, match=match):
    call()
  assert_same_state(before, snapshot(cache.state))


# --------------------------------------------------------------------------- 22–25


def test_scenario_22_one_span_equals_plain_model():
  """Scenario 22: step([s]*5) equals causal softmax over the stored K/V, computed directly in NumPy."""
  h = harness()
  s = h.new()
  outs = h.step([s] * 5)
  state = h.cache.state
  causal = np.tril(np.ones((5, 5), bool))
  for l in range(2):
    q, k, v = (np.asarray(x) for x in inputs(h, l, [s] * 5, range(5)))
    kc, vc = (x.astype(np.float32)                          # [5, H_kv, D]
              for x in stored_rows(state, h.config, l, s, range(5)))
    assert kc.tobytes() == k.astype(np.float16).astype(np.float32).tobytes()
    assert vc.tobytes() == v.astype(np.float16).astype(np.float32).tobytes()
    # Directly over the stored K/V (no SequenceOracle history), in the one float64 oracle.
    want = attend_naive(q, kc.astype(np.float64), vc.astype(np.float64), causal,
                        default_scale(HEAD_DIM))
    np.testing.assert_allclose(outs[l], want, rtol=0, atol=tol(np.float32))


def test_scenario_23_two_sequences_flattened(driver):
  """Scenario 23: ids 0..3 issued, 0 and 2 removed; step([1]*4 + [3]*3) equals separate runs."""
  h = harness(driver)
  ids = [h.new() for _ in range(4)]
  assert ids == [0, 1, 2, 3]
  h.step([0, 0, 2, 2, 2])   # history that removal must make invisible
  assert h.rm(0) and h.rm(2)
  h.step([1] * 4 + [3] * 3)
  assert (h.cache.pos(1), h.cache.pos(3)) == (4, 3)


def test_scenario_24_interleaved(driver):
  """Scenario 24: step([x,x,y,x]) at [0,1,0,2] equals the separate runs, in order."""
  h = harness(driver)
  x, y = h.new(), h.new()
  assert h.expected_positions([x, x, y, x]) == [0, 1, 0, 2]
  h.step([x, x, y, x])
  h.step([y, x, y, y, x])
  assert (h.cache.pos(x), h.cache.pos(y)) == (5, 4)


def test_scenario_25_prefill_then_decode(driver):
  """Scenario 25: step([x]*4 + [y]*3) then three step([x, y]); every row matches."""
  h = harness(driver)
  x, y = h.new(), h.new()
  h.step([x] * 4 + [y] * 3)
  for i in range(3):
    assert h.expected_positions([x, y]) == [4 + i, 3 + i]
    h.step([x, y])
  assert (h.cache.pos(x), h.cache.pos(y)) == (7, 6)


# --------------------------------------------------------------------------- 26–31


def test_scenario_26_span_must_continue_its_sequence():
  """Scenario 26: wrong positions raise StepError, change nothing, and keep the declaration."""
  h = harness()
  cache = h.cache
  s = h.new()
  assert cache.declare_step([s, s]) is True
  assert_step_error(cache, "BAD_POSITIONS", lambda: cache.prepare_step([1, 2]))
  assert int(cache.state.phase) == jaxkv.Phase.DECLARED
  assert_step_error(cache, "BAD_POSITIONS", lambda: cache.prepare_step([0, 2]))
  step = cache.prepare_step([0, 1])
  assert np.asarray(step.positions)[:2].tolist() == [0, 1]
  assert int(cache.state.phase) == jaxkv.Phase.PREPARED
  # Positions and ids may come as NumPy or JAX integer arrays, as a demanding caller passes them.
  cache.prepare_step(np.array([0, 1], np.int32))
  cache.prepare_step(jnp.array([0, 1], jnp.int32))
  assert_step_error(cache, "BAD_POSITIONS", lambda: cache.prepare_step(np.array([0, 2])))
  assert cache.declare_step(np.array([s, s, s], np.int32)) is True
  assert np.asarray(cache.prepare_step(jnp.arange(3, dtype=jnp.int32)).positions)[:3].tolist() == [
      0, 1, 2]


def test_scenario_27_spanned_twice_continued_across_both():
  """Scenario 27: step([x,y,x]) at [0,0,1]; then [2,1,4] is refused and [2,1,3] accepted."""
  h = harness()
  cache = h.cache
  x, y = h.new(), h.new()
  assert h.expected_positions([x, y, x]) == [0, 0, 1]
  h.step([x, y, x])
  assert (cache.pos(x), cache.pos(y)) == (2, 1)
  assert cache.declare_step([x, y, x]) is True
  assert_step_error(cache, "BAD_POSITIONS", lambda: cache.prepare_step([2, 1, 4]))
  step = cache.prepare_step([2, 1, 3])
  assert np.asarray(step.positions)[:3].tolist() == [2, 1, 3]
  assert int(step.n_segments) == 3


def test_scenario_28_no_declaration():
  """Scenario 28: on a fresh cache prepare_step, attend and commit_step raise StepError."""
  h = harness()
  cache = h.cache
  s = h.new()
  q, k, v = inputs(h, 0, [s], [0])
  assert_step_error(cache, "NO_DECLARATION", lambda: cache.prepare_step())
  assert_step_error(cache, "NO_DECLARATION", lambda: cache.prepare_step([0]))
  assert_step_error(cache, "NOT_PREPARED", lambda: cache.attend(0, q, k, v))
  assert_step_error(cache, "NOT_PREPARED", lambda: cache.commit_step())
  assert int(cache.state.phase) == jaxkv.Phase.IDLE


def test_scenario_29_bad_declarations():
  """Scenario 29: [], [-1], [4] (scratch column), [2] (never issued) are refused."""
  h = harness()
  cache = h.cache
  assert (h.new(), h.new()) == (0, 1)
  for bad in ([], [-1], [4], [2], [0, 2], [1, -1], [2**31 - 1], [0] * 9):
    assert_refused(cache, lambda bad=bad: cache.declare_step(bad))
  assert_refused(cache, lambda: cache.declare_step([2**40]))
  assert int(cache.state.phase) == jaxkv.Phase.IDLE
  # CONTRACT §5 queries: any id that is not live reads pos 0 and not live.
  for bad_id in (-1, 2, 4, 5, 2**31 - 1, 2**40):
    assert cache.pos(bad_id) == 0 and cache.is_live(bad_id) is False
    assert_refused(cache, lambda bad_id=bad_id: cache.seq_rm(bad_id))
    assert_refused(cache, lambda bad_id=bad_id: cache.rewind(bad_id, 0))
    assert_refused(cache, lambda bad_id=bad_id: cache.seq_clone(bad_id))
  assert (cache.max_seqs(), cache.capacity()) == (4, 32)
  assert cache.declare_step([0, 1]) is True


def test_scenario_30_capacity():
  """Scenario 30 (capacity 4, W 4): NO_ROOM refusals leave every position where it was.

  `max_write <= capacity` (CONTRACT §2), so 5 tokens are refused as TOO_WIDE.
  """
  h = harness(capacity=4, max_write=4)
  cache = h.cache
  x, y = h.new(), h.new()
  assert_refused(cache, lambda: cache.declare_step([x] * 5))
  h.step([x, x, y, y])
  assert int(cache.state.held) == 4
  for bad in ([x], [y], [x, y]):
    assert_refused(cache, lambda bad=bad: cache.declare_step(bad))
  assert (cache.pos(x), cache.pos(y)) == (2, 2)
  assert_refused(cache, lambda: cache.seq_clone(x, 1))


def test_scenario_31_token_counts_must_agree():
  """Scenario 31: n = 3, W = 8: prepare and attend refuse mismatched token counts."""
  h = harness()
  cache = h.cache
  s = h.new()
  assert cache.declare_step([s, s, s]) is True
  assert_step_error(cache, "BAD_POSITIONS", lambda: cache.prepare_step([0, 1]))
  cache.prepare_step()
  q3, k3, v3 = inputs(h, 0, [s] * 3, range(3))

  def rows(x, r):
    """x padded with NaN (or cut) to r rows."""
    x = np.asarray(x)
    if r <= x.shape[0]:
      return jnp.asarray(x[:r])
    return jnp.asarray(np.concatenate([x, np.full((r - x.shape[0],) + x.shape[1:], np.nan,
                                                  np.float32)]))

  shape_error = r"(?i)\bT\b|rows|shape|token count"
  assert_step_error(cache, shape_error, lambda: cache.attend(0, rows(q3, 2), rows(k3, 2),
                                                             rows(v3, 2)))
  assert_step_error(cache, shape_error, lambda: cache.attend(0, q3, rows(k3, 4), v3))
  assert_step_error(cache, shape_error, lambda: cache.attend(0, q3, k3, rows(v3, 8)))
  # Another shape or head count wrong (CONTRACT §6.4).
  head_error = r"(?i)head|shape"
  assert_step_error(cache, head_error, lambda: cache.attend(0, q3[:, :3], k3, v3))
  assert_step_error(cache, head_error, lambda: cache.attend(0, q3, k3[:, :1], v3[:, :1]))
  assert_step_error(cache, head_error, lambda: cache.attend(0, q3[..., :4], k3[..., :4],
                                                           v3[..., :4]))
  assert_step_error(cache, r"(?i)\bT\b|rows|shape|token count|rank",
                    lambda: cache.attend(0, q3[0], k3[0], v3[0]))
  assert int(cache.state.phase) == jaxkv.Phase.PREPARED
  out3 = np.asarray(cache.attend(0, q3, k3, v3))
  out8 = np.asarray(cache.attend(0, rows(q3, 8), rows(k3, 8), rows(v3, 8)))
  assert out3.shape == (3, N_Q_HEADS, HEAD_DIM) and out8.shape == (8, N_Q_HEADS, HEAD_DIM)
  assert np.all(np.isfinite(out8[:3]))
  assert out8[:3].tobytes() == out3.tobytes()
  q1, k1, v1 = inputs(h, 1, [s] * 3, range(3))
  cache.attend(1, q1, k1, v1)
  cache.commit_step()
  assert cache.pos(s) == 3


# --------------------------------------------------------------------------- 33–36


def test_scenario_33_removal_invalidates_the_step():
  """Scenario 33: seq_rm drops the declaration; seq_new does not."""
  h = harness()
  cache = h.cache
  x, y = h.new(), h.new()
  assert cache.declare_step([x, y]) is True
  assert h.rm(y) is True
  assert int(cache.state.phase) == jaxkv.Phase.IDLE
  assert_step_error(cache, "NO_DECLARATION", lambda: cache.prepare_step())
  assert cache.declare_step([x]) is True
  z = h.new()
  assert z == y
  step = cache.prepare_step()
  assert int(step.n_tokens) == 1 and np.asarray(step.seq_cols)[0] == x


def test_scenario_33_other_invalidations():
  """CONTRACT §6.1: seq_clone, rewind (even to pos) and a refused verb; refusals keep the step."""
  h = harness()
  cache = h.cache
  x = h.new()
  h.step([x, x])
  # Refused verbs never change the phase.
  assert cache.declare_step([x]) is True
  assert_refused(cache, lambda: cache.rewind(x, 5))
  assert_refused(cache, lambda: cache.seq_rm(3))
  assert_refused(cache, lambda: cache.seq_clone(3))
  assert int(cache.state.phase) == jaxkv.Phase.DECLARED
  # A successful clone invalidates.
  assert h.clone(x) is not None
  assert_step_error(cache, "NO_DECLARATION", lambda: cache.prepare_step())
  # A rewind to pos(x) invalidates too.
  assert cache.declare_step([x]) is True
  assert h.rewind(x, 2) is True and cache.pos(x) == 2
  assert_step_error(cache, "NO_DECLARATION", lambda: cache.prepare_step())
  h.step([x])


def test_scenario_34_rewind_keeps_a_prefix():
  """Scenario 34: rewind(y, 2) lowers pos and held, keeps hw, and leaves x untouched."""
  h = harness()
  cache = h.cache
  x, y = h.new(), h.new()
  h.step([x] * 4 + [y] * 4)
  before = snapshot(cache.state)
  assert h.rewind(y, 2) is True
  after = snapshot(cache.state)
  assert cache.pos(y) == 2 and int(np.asarray(cache.state.hw)[y]) == 4
  assert int(cache.state.held) == 6
  assert cache.pos(x) == 4 and int(np.asarray(cache.state.hw)[x]) == 4
  for name in before:
    if name.startswith((".k", ".v")):
      assert before[name][:, x].tobytes() == after[name][:, x].tobytes(), name
  assert h.rm(y) is True
  assert int(cache.state.held) == 4
  assert int(np.asarray(cache.state.hw)[y]) == 0 and cache.pos(y) == 0


def test_scenario_35_rewind_then_continue(driver):
  """Scenario 35: tokens 0..3, rewind to 2, tokens 2..4 in one step equal an unbroken run."""
  h = harness(driver)
  s = h.new()
  h.step([s] * 4)
  assert h.rewind(s, 2) is True
  outs = h.step([s] * 3)   # the oracle was rewound too: it is the unbroken run 0..4
  cold = harness(driver)
  c = cold.new(tag=h.tags[s])
  cold.step([c] * 2)
  cold_outs = cold.step([c] * 3)
  for l in range(2):
    np.testing.assert_allclose(outs[l], cold_outs[l], rtol=0, atol=tol(np.float16))


def test_scenario_36_rewind_bounds():
  """Scenario 36: rewind past pos or below 0 is refused; the ring floor bounds rewinds."""
  h = harness()
  cache = h.cache
  s = h.new()
  h.step([s] * 3)
  assert_refused(cache, lambda: cache.rewind(s, 4))
  assert_refused(cache, lambda: cache.rewind(s, -1))
  assert_refused(cache, lambda: cache.rewind(s, 2**40))
  assert_refused(cache, lambda: cache.rewind(s, -2**40))
  assert_refused(cache, lambda: cache.rewind(s + 1, 0))
  assert cache.pos(s) == 3

  # ring(2), max_write 1 (R = 2): five 1-token steps give hw 5, floor 4.
  h = harness(layers=[flat(), ring(2)], max_write=1)
  cache = h.cache
  assert h.config.ring_rows(1) == 2
  s = h.new()
  for _ in range(5):
    h.step([s])
  assert int(np.asarray(cache.state.hw)[s]) == 5
  assert int(jaxkv.pure.floor(h.config, cache.state, jnp.int32(s))) == 4
  assert_refused(cache, lambda: cache.rewind(s, 3))
  assert h.rewind(s, 4) is True
  assert_refused(cache, lambda: cache.rewind(s, 3))
  assert cache.pos(s) == 4 and int(np.asarray(cache.state.hw)[s]) == 5
  h.step([s])   # continuing from the floor is exact
  h.step([s])

  # ring(2), max_write 5 (R = 6): one 5-token step does not wrap; floor 0.
  h = harness(layers=[flat(), ring(2)], max_write=5)
  cache = h.cache
  assert h.config.ring_rows(1) == 6
  s = h.new()
  h.step([s] * 5)
  assert int(jaxkv.pure.floor(h.config, cache.state, jnp.int32(s))) == 0
  assert h.rewind(s, 1) is True
  h.step([s] * 2)


def test_scenario_25_dependent_model(driver):
  """Scenario 25 with the CONTRACT §11 dependent model: layer 1's q/k/v are maps of layer 0's output."""
  h = Harness(default_config(layers=TWO_FLAT), driver=driver, dependent=True)
  x, y = h.new(), h.new()
  h.step([x] * 4 + [y] * 3)
  for _ in range(3):
    h.step([x, y])
  assert h.rewind(x, 5) is True
  h.step([y, x, x])


# --------------------------------------------------------------------------- pure twins


def _jit(fn):
  return jax.jit(fn, static_argnums=0)


def test_scenario_28_pure_twins_report_status_and_keep_state():
  """Scenario 28, pure API (CONTRACT §10.3): statuses, an unchanged state, and zeros from attend."""
  config = default_config(layers=TWO_FLAT)
  state = jaxkv.init_state(config)
  state, status, s = _jit(jaxkv.pure.seq_new)(config, state)
  assert int(status) == jaxkv.Status.OK and int(s) == 0
  before = snapshot(state)
  state, status = _jit(jaxkv.pure.prepare_step)(config, state)
  assert int(status) == jaxkv.Status.NO_DECLARATION
  assert_same_state(before, snapshot(state))
  q = jnp.ones((8, N_Q_HEADS, HEAD_DIM), jnp.float32)
  kv = jnp.ones((8, N_KV_HEADS, HEAD_DIM), jnp.float32)
  attend = jax.jit(lambda c, st, q, k, v: jaxkv.pure.attend(c, st, 0, q, k, v,
                                                             implementation="reference"),
                   static_argnums=0)
  state, out, status = attend(config, state, q, kv, kv)
  assert int(status) == jaxkv.Status.NOT_PREPARED
  assert out.shape == (8, N_Q_HEADS, HEAD_DIM) and not np.any(np.asarray(out))
  assert_same_state(before, snapshot(state))
  state, status = _jit(jaxkv.pure.commit_step)(config, state)
  assert int(status) == jaxkv.Status.NOT_PREPARED
  assert_same_state(before, snapshot(state))


def test_pure_statuses_follow_the_spec_check_order():
  """CONTRACT §5, §6.2: the first failing check sets the status, and every refusal changes nothing."""
  config = default_config(layers=[flat(), ring(2)], capacity=6, max_seqs=2, max_write=4,
                          initial_capacity=6)
  W = 4
  declare = _jit(jaxkv.pure.declare_step)
  prepare = _jit(jaxkv.pure.prepare_step)
  commit = _jit(jaxkv.pure.commit_step)
  clone = _jit(jaxkv.pure.seq_clone)
  rewind = _jit(jaxkv.pure.rewind)
  rm = _jit(jaxkv.pure.seq_rm)
  new = _jit(jaxkv.pure.seq_new)
  state = jaxkv.init_state(config)
  no_blocks = jnp.zeros((W, 2), jnp.int32)

  def ids(*xs):
    arr = np.full((W,), config.max_seqs, np.int32)
    arr[:len(xs)] = xs
    return jnp.asarray(arr)

  def expect(result, status):
    nonlocal state
    before = snapshot(state)
    new_state, got = result[0], result[1]
    assert int(got) == status, (jaxkv.Status(int(got)).name, status.name)
    assert_same_state(before, snapshot(new_state))
    state = new_state

  S = jaxkv.Status
  state, status, x = new(config, state)
  assert int(status) == S.OK and int(x) == 0
  expect(clone(config, state, jnp.int32(1), jnp.int32(jaxkv.pure.WHOLE)), S.NOT_LIVE)
  expect(clone(config, state, x, jnp.int32(jaxkv.pure.WHOLE)), S.EMPTY)   # pos 0
  expect(declare(config, state, ids(), jnp.int32(0), no_blocks), S.EMPTY)
  expect(declare(config, state, ids(1, 1, 1, 1), jnp.int32(5), no_blocks), S.TOO_WIDE)
  expect(declare(config, state, ids(0, 1), jnp.int32(2), no_blocks), S.NOT_LIVE)
  bad_block = jnp.asarray(np.array([[0, 3]] + [[0, 0]] * 3, np.int32))
  expect(declare(config, state, ids(0, 0), jnp.int32(2), bad_block), S.BAD_BLOCKS)
  q = jnp.ones((W, N_Q_HEADS, HEAD_DIM), jnp.float32)
  kv = jnp.ones((W, N_KV_HEADS, HEAD_DIM), jnp.float32)
  attend = jax.jit(lambda c, st, layer: jaxkv.pure.attend(c, st, layer, q, kv, kv,
                                                          implementation="reference"),
                   static_argnums=(0, 2), donate_argnums=1)
  # Three 2-token steps for x: hw 6 wraps ring(2) (R = min(6, 2 + 4 - 1) = 5), floor 6 - 5 + 1 = 2.
  for i in range(3):
    state, status = declare(config, state, ids(0, 0), jnp.int32(2), no_blocks)
    assert int(status) == S.OK
    state, status = prepare(config, state)
    assert int(status) == S.OK
    state, _, status = attend(config, state, 0)
    if i == 0:   # a layer not attended: the commit is refused (NOT_ATTENDED), nothing changes
      expect(commit(config, state), S.NOT_ATTENDED)
    state, _, status = attend(config, state, 1)
    state, status = commit(config, state)
    assert int(status) == S.OK
  assert np.asarray(state.pos).tolist() == [6, 0] and int(state.held) == 6
  assert int(jaxkv.pure.floor(config, state, x)) == 2
  expect(declare(config, state, ids(0), jnp.int32(1), no_blocks), S.NO_ROOM)
  expect(declare(config, state, ids(0, 0, 0, 0), jnp.int32(4), bad_block), S.BAD_BLOCKS)
  expect(rewind(config, state, jnp.int32(1), jnp.int32(0)), S.NOT_LIVE)
  expect(rewind(config, state, x, jnp.int32(7)), S.BAD_TARGET)
  expect(rewind(config, state, x, jnp.int32(-1)), S.BAD_TARGET)
  expect(rewind(config, state, x, jnp.int32(1)), S.BELOW_FLOOR)
  expect(clone(config, state, x, jnp.int32(0)), S.EMPTY)
  expect(clone(config, state, x, jnp.int32(1)), S.BELOW_FLOOR)
  expect(clone(config, state, x, jnp.int32(2)), S.NO_ROOM)   # held 6 = capacity
  state, status = rewind(config, state, x, jnp.int32(3))
  assert int(status) == S.OK and int(state.held) == 3
  state, status, y = new(config, state)
  assert int(status) == S.OK and int(y) == 1
  expect(new(config, state), S.NO_FREE_ID)
  expect(clone(config, state, x, jnp.int32(3)), S.NO_FREE_ID)   # room for 3, no id
  expect(rm(config, state, jnp.int32(-1)), S.NOT_LIVE)
  expect(rm(config, state, jnp.int32(2)), S.NOT_LIVE)
  state, status = rm(config, state, y)
  assert int(status) == S.OK
  state, status, f = clone(config, state, x, jnp.int32(2))
  assert int(status) == S.OK and int(f) == 1
  assert np.asarray(state.pos).tolist() == [3, 2] and np.asarray(state.hw).tolist() == [6, 6]
  assert int(state.held) == 5


def test_clear_drops_sequences_and_keeps_storage(driver):
  """CONTRACT §5 clear(): every sequence and the step go, held = 0; storage keeps shape and bytes."""
  h = harness(driver, initial_capacity=4)
  cache = h.cache
  x, y = h.new(), h.new()
  h.step([x] * 5 + [y] * 2)
  assert cache.declare_step([x, y]) is True
  before = snapshot(cache.state)
  cache.clear()
  after = snapshot(cache.state)
  for name in before:
    if name.startswith((".k", ".v")):
      assert before[name].tobytes() == after[name].tobytes(), name
  assert flat_row_count(cache.state, h.config) == (32 if h.config.page_size else 8)
  assert np.asarray(cache.state.live).tolist() == [0] * 4
  assert np.asarray(cache.state.pos).tolist() == [0] * 4
  assert np.asarray(cache.state.hw).tolist() == [0] * 4
  assert int(cache.state.held) == 0 and int(cache.state.phase) == jaxkv.Phase.IDLE
  assert cache.pos(x) == 0 and not cache.is_live(y)
  if driver == "facade":
    assert_step_error(cache, "NO_DECLARATION", lambda: cache.prepare_step())
  h.oracles.clear()
  h.tags.clear()
  assert (h.new(), h.new()) == (0, 1)
  h.step([1, 0, 1])   # fresh oracles: nothing of the cleared histories is seen
