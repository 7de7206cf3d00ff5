"""Issue 6, part 2: bad input at every public entry raises the right error and changes nothing.

Wrong ranks, shapes, dtypes, head counts, ids of the wrong type, huge values
and malformed owner blocks must raise `ValueError`/`StepError` (or `TypeError`
for the wrong kind of object) whose message names the argument (STYLE habit 8),
at trace time where the problem is static (CONTRACT §10.3), and leave the state
bitwise equal (scratch column excluded). Values that are merely refused (a dead
id, a position out of range) are results, not errors: `test_stateful.py`
covers those. A hypothesis fuzz checks that no other exception type escapes the
facade. NaN and inf in one sequence's q/k/v are data: they may reach only that
sequence's outputs and history.
"""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import jaxkv
from jaxkv._validate import dynamic_validate_state
from reliability import harness as H
from scenario_utils import assert_same_state, snapshot

pure = jaxkv.pure
flat, ring = jaxkv.LayerPolicy.flat, jaxkv.LayerPolicy.ring
LayerConfig, CacheConfig = jaxkv.LayerConfig, jaxkv.CacheConfig

CONFIG = CacheConfig([LayerConfig(flat(), 2, 4), LayerConfig(ring(3), 2, 4)], capacity=24,
                     max_seqs=3, max_write=4, kv_dtype=jnp.float32, initial_capacity=8)
W = CONFIG.max_write
Q = np.ones((1, 4, 4), np.float32)
KV = np.zeros((1, 2, 4), np.float32)


def _cache(phase: str):
  """A facade cache: a holds 2 tokens, b is new; then `phase` for the next step [a]."""
  cache = jaxkv.BatchedSequenceCache(CONFIG, implementation="reference")
  a, b = cache.seq_new(), cache.seq_new()
  assert (a, b) == (0, 1)
  assert cache.declare_step([a, a, b])
  cache.prepare_step()
  for layer in range(2):
    cache.attend(layer, np.ones((3, 4, 4), np.float32), np.ones((3, 2, 4), np.float32),
                 np.ones((3, 2, 4), np.float32))
  cache.commit_step()
  if phase in ("declared", "prepared"):
    assert cache.declare_step([a])
  if phase == "prepared":
    cache.prepare_step()
  return cache


# (id, phase, call, error types, match). Every row must raise and change nothing.
FACADE_CASES = [
    ("is_live-str", "idle", lambda c: c.is_live("0"), TypeError, "seq_id"),
    ("is_live-none", "idle", lambda c: c.is_live(None), TypeError, "seq_id"),
    ("pos-float", "idle", lambda c: c.pos(1.0), TypeError, "seq_id"),
    ("pos-np-float", "idle", lambda c: c.pos(np.float32(1)), TypeError, "seq_id"),
    ("pos-array", "idle", lambda c: c.pos(np.array([0])), TypeError, "seq_id"),
    ("seq_clone-str", "idle", lambda c: c.seq_clone("0"), TypeError, "src"),
    ("seq_clone-upto-float", "idle", lambda c: c.seq_clone(0, 1.5), TypeError, "upto"),
    ("seq_clone-bool", "idle", lambda c: c.seq_clone(True), TypeError, "src"),
    ("seq_rm-none", "idle", lambda c: c.seq_rm(None), TypeError, "seq_id"),
    ("rewind-id-float", "idle", lambda c: c.rewind(0.0, 1), TypeError, "seq_id"),
    ("rewind-position-str", "idle", lambda c: c.rewind(0, "1"), TypeError, "position"),
    ("rewind-position-none", "idle", lambda c: c.rewind(0, None), TypeError, "position"),
    ("declare-id-float", "idle", lambda c: c.declare_step([0.0]), TypeError, r"seq_ids\[0\]"),
    ("declare-id-none", "idle", lambda c: c.declare_step([0, None]), TypeError,
     r"seq_ids\[1\]"),
    ("declare-id-str", "idle", lambda c: c.declare_step("01"), TypeError, r"seq_ids\[0\]"),
    ("declare-ids-2d", "idle", lambda c: c.declare_step(np.zeros((1, 1), np.int32)), TypeError,
     r"seq_ids\[0\]"),
    ("declare-block-int", "idle", lambda c: c.declare_step([0], owner_blocks=[5]), TypeError,
     r"owner_blocks\[0\]"),
    ("declare-block-short", "idle", lambda c: c.declare_step([0], owner_blocks=[(0,)]),
     TypeError, r"owner_blocks\[0\]"),
    ("declare-block-long", "idle", lambda c: c.declare_step([0], owner_blocks=[(0, 1, 2)]),
     TypeError, r"owner_blocks\[0\]"),
    ("declare-block-str", "idle", lambda c: c.declare_step([0], owner_blocks=[("0", 1)]),
     TypeError, r"owner_blocks\[0\] start"),
    ("declare-block-float", "idle", lambda c: c.declare_step([0], owner_blocks=[(0, 1.0)]),
     TypeError, r"owner_blocks\[0\] length"),
    ("prepare-position-str", "declared", lambda c: c.prepare_step(["2"]), TypeError,
     r"positions\[0\]"),
    ("prepare-position-float", "declared", lambda c: c.prepare_step([2.0]), TypeError,
     r"positions\[0\]"),
    ("prepare-position-huge", "declared", lambda c: c.prepare_step([2**31 + 2]),
     jaxkv.StepError, "positions"),
    ("prepare-position-huge-negative", "declared", lambda c: c.prepare_step([-(2**32) + 2]),
     jaxkv.StepError, "positions"),
    ("prepare-positions-too-many", "declared", lambda c: c.prepare_step([2, 3]),
     jaxkv.StepError, "positions"),
    ("attend-layer-float", "prepared", lambda c: c.attend(0.0, Q, KV, KV),
     (TypeError, jaxkv.StepError), "layer"),
    ("attend-layer-none", "prepared", lambda c: c.attend(None, Q, KV, KV),
     (TypeError, jaxkv.StepError), "layer"),
    ("attend-layer-range", "prepared", lambda c: c.attend(2, Q, KV, KV), jaxkv.StepError,
     "layer"),
    ("attend-layer-negative", "prepared", lambda c: c.attend(-1, Q, KV, KV), jaxkv.StepError,
     "layer"),
    ("attend-q-int", "prepared", lambda c: c.attend(0, Q.astype(np.int32), KV, KV),
     jaxkv.StepError, "q"),
    ("attend-q-bool", "prepared", lambda c: c.attend(0, Q > 0, KV, KV), jaxkv.StepError, "q"),
    ("attend-q-rank2", "prepared", lambda c: c.attend(0, Q[0], KV, KV), jaxkv.StepError, "q"),
    ("attend-q-rank4", "prepared", lambda c: c.attend(0, Q[None], KV, KV), jaxkv.StepError,
     "q"),
    ("attend-q-heads", "prepared", lambda c: c.attend(0, Q[:, :3], KV, KV), jaxkv.StepError,
     "heads"),
    ("attend-q-dim", "prepared", lambda c: c.attend(0, Q[:, :, :3], KV, KV), jaxkv.StepError,
     "head_dim"),
    ("attend-k-heads", "prepared", lambda c: c.attend(0, Q, KV[:, :1], KV), jaxkv.StepError,
     "k and v"),
    ("attend-v-dim", "prepared", lambda c: c.attend(0, Q, KV, KV[:, :, :2]), jaxkv.StepError,
     "k and v"),
    ("attend-T-mismatch", "prepared",
     lambda c: c.attend(0, Q, np.zeros((W, 2, 4), np.float32), KV), jaxkv.StepError,
     "token count"),
    ("attend-T-neither", "prepared", lambda c: c.attend(
        0, np.ones((2, 4, 4), np.float32), np.zeros((2, 2, 4), np.float32),
        np.zeros((2, 2, 4), np.float32)), jaxkv.StepError, "T=2"),
    ("construct-config", "idle", lambda c: jaxkv.BatchedSequenceCache(None), TypeError,
     "config"),
    ("construct-implementation", "idle",
     lambda c: jaxkv.BatchedSequenceCache(CONFIG, implementation="cuda"), ValueError,
     "implementation"),
]

# Regressions (CONTRACT §10.5 facade; STYLE habit 8), found by these tests and fixed in
# 07fe30d: each raised an error that did not name the argument, or of the wrong type.
FACADE_BUG_CASES = [
    # TypeError("'int' object is not iterable"): the message does not name seq_ids.
    ("declare-ids-int", "idle", lambda c: c.declare_step(5), TypeError, "seq_ids"),
    ("declare-ids-none", "idle", lambda c: c.declare_step(None), TypeError, "seq_ids"),
    # TypeError("'int' object is not iterable"): the message does not name owner_blocks.
    ("declare-blocks-int", "idle", lambda c: c.declare_step([0], owner_blocks=5), TypeError,
     "owner_blocks"),
    # TypeError("'int' object is not iterable"): the message does not name positions.
    ("prepare-positions-int", "declared", lambda c: c.prepare_step(2), TypeError,
     "positions"),
    # jnp.asarray("q") warns (UserWarning, an error under filterwarnings=error) and
    # then raises ValueError("invalid literal for int()"); None gives ValueError
    # "None is not a valid value for jnp.array". Neither names q.
    ("attend-q-str", "prepared", lambda c: c.attend(0, "q", KV, KV), TypeError, "q"),
    ("attend-q-none", "prepared", lambda c: c.attend(0, None, KV, KV), TypeError, "q"),
    # Found by the fuzz: jnp.asarray(2**31) raises OverflowError ("Python int
    # 2147483648 too large to convert to int32"), neither TypeError nor ValueError.
    ("attend-v-huge-int", "idle", lambda c: c.attend(0, Q, KV, 2**31), TypeError, "v"),
    # float("x") raises ValueError("could not convert string to float") naming nothing.
    ("attend-scale-str", "prepared", lambda c: c.attend(0, Q, KV, KV, scale="x"),
     (TypeError, ValueError), "scale"),
]


# Regressions of issue 40 (item 5): a dict or set was accepted as a list of ids, positions
# or blocks (its keys, or hash order), and a scale of nan/inf/0/-0.5 ran (NaN outputs, or
# uniform and inverted attention).
ENTRY_CASES = [
    ("declare-dict", "idle", lambda c: c.declare_step({0: 1}), TypeError, "seq_ids.*dict"),
    ("declare-set", "idle", lambda c: c.declare_step({0, 1}), TypeError, "seq_ids.*set"),
    ("declare-frozenset", "idle", lambda c: c.declare_step(frozenset([0])), TypeError,
     "seq_ids"),
    ("declare-blocks-dict", "idle", lambda c: c.declare_step([0, 0], owner_blocks={0: 2}),
     TypeError, "owner_blocks"),
    ("declare-blocks-set", "idle", lambda c: c.declare_step([0, 0], owner_blocks={(0, 2)}),
     TypeError, "owner_blocks"),
    ("prepare-positions-dict", "declared", lambda c: c.prepare_step({2: 0}), TypeError,
     "positions"),
    ("prepare-positions-set", "declared", lambda c: c.prepare_step({2}), TypeError,
     "positions"),
    ("attend-scale-nan", "prepared", lambda c: c.attend(0, Q, KV, KV, scale=float("nan")),
     ValueError, "scale"),
    ("attend-scale-inf", "prepared", lambda c: c.attend(0, Q, KV, KV, scale=float("inf")),
     ValueError, "scale"),
    ("attend-scale-np-nan", "prepared",
     lambda c: c.attend(0, Q, KV, KV, scale=np.float32("nan")), ValueError, "scale"),
    ("attend-scale-0", "prepared", lambda c: c.attend(0, Q, KV, KV, scale=0.0), ValueError,
     "scale"),
    ("attend-scale-negative", "prepared", lambda c: c.attend(0, Q, KV, KV, scale=-0.5),
     ValueError, "scale"),
]
ALL_FACADE_CASES = FACADE_CASES + FACADE_BUG_CASES + ENTRY_CASES


@pytest.mark.parametrize("phase, call, error, match", [c[1:] for c in ALL_FACADE_CASES],
                         ids=[c[0] for c in ALL_FACADE_CASES])
def test_facade_bad_argument_raises_and_changes_nothing(phase, call, error, match):
  cache = _cache(phase)
  before = snapshot(cache.state)
  with pytest.raises(error, match=match):
    call(cache)
  assert_same_state(before, snapshot(cache.state))


def test_facade_accepts_owner_blocks_as_an_int_array():
  """CONTRACT §6.2: owner_blocks lists (start, length) pairs; a NumPy [k, 2] int array is one.

  Regression (fixed in 07fe30d): `_block_rows` evaluates `owner_blocks or ()`, and the truth value of a
  multi-element array raises ValueError ("The truth value of an array with more
  than one element is ambiguous"), naming no argument.
  """
  cache = _cache("idle")
  blocks = np.array([[2, 2]], np.int64)
  assert cache.declare_step([0, 0, 0, 0], owner_blocks=blocks) is True
  assert np.asarray(cache.prepare_step().seq_info)[:2].tolist() == [[0, 2, 0, 2, 0],
                                                                    [2, 2, 0, 4, 1]]


def test_facade_huge_ints_are_clamped_not_wrapped():
  """Python ints beyond int32 are clamped (CONTRACT §10.5), so they stay invalid instead of wrapping.

  2**32 + 1 would wrap to the live id 1, and 2**32 + 2 to a valid rewind target.
  """
  cache = _cache("idle")
  before = snapshot(cache.state)
  assert cache.is_live(2**32) is False and cache.pos(2**32 + 1) == 0
  assert cache.seq_rm(2**32 + 1) is False
  assert cache.seq_clone(2**32) is None
  assert cache.rewind(0, 2**32 + 1) is False
  assert cache.rewind(2**32, 1) is False
  assert cache.rewind(0, -(2**32) + 1) is False
  assert cache.declare_step([2**32 + 1]) is False
  assert cache.declare_step([0], owner_blocks=[(2**32, 1)]) is False
  assert cache.declare_step([0], owner_blocks=[(0, 2**32 + 1)]) is False
  assert_same_state(before, snapshot(cache.state))
  # A huge `upto` is clamped to pos(src) (CONTRACT §5), not wrapped to 1.
  f = cache.seq_clone(0, 2**32 + 1)
  assert f == 2 and cache.pos(f) == 2


# --------------------------------------------------------------------------- pure verbs


def _pure_state():
  """A pure state with sequence 0 at position 2 and sequence 1 new, phase IDLE."""
  state = jaxkv.init_state(CONFIG)
  state, _, _ = pure.seq_new(CONFIG, state)
  state, _, _ = pure.seq_new(CONFIG, state)
  ids = jnp.asarray([0, 0, 3, 3], jnp.int32)
  state, status = pure.declare_step(CONFIG, state, ids, jnp.int32(2), jnp.zeros((W, 2), jnp.int32))
  state, status = pure.prepare_step(CONFIG, state)
  for layer in range(CONFIG.num_layers):   # a commit needs every layer attended
    state, _, _ = pure.attend(CONFIG, state, layer, jnp.ones((W, 4, 4)), jnp.ones((W, 2, 4)),
                              jnp.ones((W, 2, 4)), implementation="reference")
  state, status = pure.commit_step(CONFIG, state)
  assert int(status) == 0 and np.asarray(state.pos).tolist() == [2, 0, 0]
  return state


def _declared(state):
  ids = jnp.asarray([0, 3, 3, 3], jnp.int32)
  state, status = pure.declare_step(CONFIG, state, ids, jnp.int32(1), jnp.zeros((W, 2), jnp.int32))
  assert int(status) == 0
  return state


I32 = lambda *x: jnp.asarray(x, jnp.int32)
IDS = jnp.asarray([0, 3, 3, 3], jnp.int32)
BLOCKS = jnp.zeros((W, 2), jnp.int32)
N = jnp.int32(1)

# (id, declared?, verb, args after (config, state), error types, match): run under
# jax.jit with the state donated; must raise at trace time and change nothing.
PURE_CASES = [
    ("attend-layer", True, pure.attend, (2, jnp.ones((W, 4, 4)), jnp.ones((W, 2, 4)),
                                         jnp.ones((W, 2, 4))), ValueError, "layer"),
    ("attend-T", True, pure.attend, (0, jnp.ones((1, 4, 4)), jnp.ones((1, 2, 4)),
                                     jnp.ones((1, 2, 4))), ValueError, "T="),
    ("attend-q-int", True, pure.attend, (0, jnp.ones((W, 4, 4), jnp.int32),
                                         jnp.ones((W, 2, 4)), jnp.ones((W, 2, 4))),
     ValueError, "q"),
    ("attend-q-heads", True, pure.attend, (0, jnp.ones((W, 3, 4)), jnp.ones((W, 2, 4)),
                                           jnp.ones((W, 2, 4))), ValueError, "heads"),
    ("attend-k-heads", True, pure.attend, (0, jnp.ones((W, 4, 4)), jnp.ones((W, 1, 4)),
                                           jnp.ones((W, 2, 4))), ValueError, "k and v"),
]

# Regressions, fixed in 07fe30d (CONTRACT §10.3 "Static misuse (wrong shapes ...)
# raises ValueError at trace time"; STYLE habit 7). Before it, the pure verbs
# other than attend validated no argument: wrong shapes broadcast silently or
# failed deep inside with errors naming no argument, float ids and positions
# were truncated to int32, and a state of another config was used as is. The
# comments give the behaviour before the fix.
PURE_BUG_CASES = [
    # Silently broadcast: one id for all n tokens (status OK).
    ("declare-ids-shape-1", False, pure.declare_step, (I32(0), I32(3)[0], BLOCKS), ValueError,
     "seq_ids"),
    # TypeError "and got incompatible shapes for broadcasting: (4, 4), (4, 5)".
    ("declare-ids-shape-W+1", False, pure.declare_step, (I32(0, 3, 3, 3, 3), N, BLOCKS),
     ValueError, "seq_ids"),
    # Truncated to int32 silently (0.7 -> 0, status OK).
    ("declare-ids-float", False, pure.declare_step,
     (jnp.asarray([0.7, 3, 3, 3], jnp.float32), N, BLOCKS), ValueError, "seq_ids"),
    # TypeError "lt got incompatible shapes for broadcasting: (4,), (2,)".
    ("declare-n-shape", False, pure.declare_step, (IDS, I32(1, 1), BLOCKS), ValueError, "n"),
    # IndexError "Too many indices".
    ("declare-blocks-rank1", False, pure.declare_step, (IDS, N, jnp.zeros((W,), jnp.int32)),
     ValueError, "blocks"),
    # Accepted silently (status OK): a third column is ignored.
    ("declare-blocks-3-columns", False, pure.declare_step,
     (IDS, N, jnp.zeros((W, 3), jnp.int32)), ValueError, "blocks"),
    # Truncated silently (0.5 -> 0): seq_clone(0.5) clones sequence 0.
    ("clone-src-float", False, pure.seq_clone, (jnp.float32(0.5), I32(5)[0]), ValueError,
     "src"),
    # ValueError "Cannot broadcast to shape with fewer dimensions", naming nothing.
    ("rm-id-shape", False, pure.seq_rm, (I32(0, 1),), ValueError, "seq_id"),
    # Truncated silently (1.9 -> 1): removes sequence 1.
    ("rm-id-float", False, pure.seq_rm, (jnp.float32(1.9),), ValueError, "seq_id"),
    # Truncated silently (1.5 -> 1): rewinds to 1.
    ("rewind-position-float", False, pure.rewind, (I32(0)[0], jnp.float32(1.5)), ValueError,
     "position"),
    # Silently broadcast: one position compared with every token (status OK).
    ("prepare-positions-scalar", True, pure.prepare_step, (I32(2)[0],), ValueError,
     "positions"),
    # TypeError "eq got incompatible shapes for broadcasting: (5,), (4,)".
    ("prepare-positions-W+1", True, pure.prepare_step, (I32(2, 0, 0, 0, 0),), ValueError,
     "positions"),
]


def _run_pure(verb, state, args):
  static = (0, 2) if verb is pure.attend else (0,)
  return jax.jit(verb, static_argnums=static, donate_argnums=1)(CONFIG, state, *args)


@pytest.mark.parametrize("declared, verb, args, error, match",
                         [c[1:] for c in PURE_CASES + PURE_BUG_CASES],
                         ids=[c[0] for c in PURE_CASES + PURE_BUG_CASES])
def test_pure_bad_argument_raises_at_trace_time(declared, verb, args, error, match):
  state = _pure_state()
  if declared:
    state = _declared(state)
  state = jax.tree.map(jnp.copy, state)
  before = snapshot(state)
  with pytest.raises(error, match=match):
    _run_pure(verb, state, args)
  assert not any(x.is_deleted() for x in jax.tree.leaves(state)), "state donated by a failed call"
  assert_same_state(before, snapshot(state))


def test_pure_verbs_reject_a_state_of_another_config():
  """A state built for another config must not be used as is (CONTRACT §10.3 static misuse).

  Regression (fixed in 07fe30d): `pure.seq_rm(config, state_of_another_config, 0)` returns OK; the verbs
  never compare the state's shapes (live [3] here, max_seqs 5 in the config)
  with the config.
  """
  other = CacheConfig([LayerConfig(flat(), 2, 4)], capacity=24, max_seqs=5, max_write=4)
  state = _pure_state()
  with pytest.raises(ValueError, match="state"):
    jax.jit(pure.seq_rm, static_argnums=0)(other, state, jnp.int32(0))


def test_pure_verbs_reject_the_wrong_kind_of_object():
  """A non-CacheConfig config or a non-CacheState state is a TypeError naming it (STYLE habit 8).

  Regression (fixed in 07fe30d): both raise AttributeError ("'NoneType' object has no attribute
  'max_seqs'" / "... 'live'").
  """
  state = _pure_state()
  with pytest.raises(TypeError, match="config"):
    pure.seq_rm(None, state, jnp.int32(0))
  with pytest.raises(TypeError, match="state"):
    pure.seq_rm(CONFIG, None, jnp.int32(0))


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**40], ids=["2**31", "-2**31-1", "2**40"])
def test_pure_verbs_name_python_ints_beyond_int32(value):
  """Huge Python ints passed to a pure verb are a ValueError naming the argument.

  Regression (fixed in 07fe30d): `_i32` (jnp.asarray(x, int32)) raises OverflowError ("Python integer
  2147483648 out of bounds for int32"), which is not a ValueError.
  """
  state = _pure_state()
  with pytest.raises(ValueError, match="position"):
    pure.rewind(CONFIG, state, 0, value)


# --------------------------------------------------------------------------- configs


CONFIG_CASES = [
    ("ring-0", lambda: ring(0), ValueError, "window=0"),
    ("ring-negative", lambda: ring(-1), ValueError, "window=-1"),
    ("ring-float", lambda: ring(2.0), TypeError, "window"),
    ("ring-bool", lambda: ring(True), TypeError, "window"),
    ("ring-array", lambda: ring(jnp.int32(2)), TypeError, "window"),
    ("flat-window", lambda: jaxkv.LayerPolicy(kind="flat", window=3), ValueError, "window=3"),
    ("kind", lambda: jaxkv.LayerPolicy(kind="paged"), ValueError, "kind"),
    ("kind-none", lambda: jaxkv.LayerPolicy(kind=None), ValueError, "kind"),
    ("policy-str", lambda: LayerConfig("flat", 1, 4), TypeError, "policy"),
    ("heads-0", lambda: LayerConfig(flat(), 0, 4), ValueError, "n_kv_heads"),
    ("heads-float", lambda: LayerConfig(flat(), 2.0, 4), TypeError, "n_kv_heads"),
    ("dim-0", lambda: LayerConfig(flat(), 1, 0), ValueError, "head_dim"),
    ("dim-str", lambda: LayerConfig(flat(), 1, "4"), TypeError, "head_dim"),
    ("layers-empty", lambda: CacheConfig([], 8, 1, 1), ValueError, "layers"),
    ("layers-none", lambda: CacheConfig(None, 8, 1, 1), TypeError, "layers"),
    ("layers-one", lambda: CacheConfig(LayerConfig(flat(), 1, 4), 8, 1, 1), TypeError, "layers"),
    ("layers-policy", lambda: CacheConfig([flat()], 8, 1, 1), TypeError, r"layers\[0\]"),
    ("capacity-0", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 0, 1, 1), ValueError,
     "capacity"),
    ("capacity-2**31", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 2**31, 1, 1),
     ValueError, "capacity"),
    ("capacity-float", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8.0, 1, 1), TypeError,
     "capacity"),
    ("capacity-array", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], jnp.int32(8), 1, 1),
     TypeError, "capacity"),
    ("max_seqs-0", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8, 0, 1), ValueError,
     "max_seqs"),
    ("max_seqs-2**31-1", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8, 2**31 - 1, 1),
     ValueError, "max_seqs"),
    ("max_write-0", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8, 1, 0), ValueError,
     "max_write"),
    ("window+max_write", lambda: CacheConfig([LayerConfig(ring(2**31 - 7), 1, 4)], 8, 1, 8),
     ValueError, "max_write"),
    ("initial-0", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8, 1, 1,
                                      initial_capacity=0), ValueError, "initial_capacity"),
    ("kv_dtype-int", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8, 1, 1,
                                         kv_dtype=jnp.int32), ValueError, "kv_dtype"),
    ("kv_dtype-f64", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8, 1, 1,
                                         kv_dtype=np.float64), ValueError, "kv_dtype"),
    ("kv_dtype-bogus", lambda: CacheConfig([LayerConfig(flat(), 1, 4)], 8, 1, 1,
                                           kv_dtype="bogus"), ValueError, "kv_dtype"),
    ("init_state-none", lambda: jaxkv.init_state(None), TypeError, "config"),
]


@pytest.mark.parametrize("make, error, match", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_bad_field_raises(make, error, match):
  with pytest.raises(error, match=match):
    make()


@pytest.mark.parametrize("kwargs, layer", [
    (dict(capacity=2**31 - 1, max_seqs=3, max_write=8), ring(2**31 - 8)),
    (dict(capacity=2**31 - 1, max_seqs=2**31 - 2, max_write=1), flat()),
    (dict(capacity=2**31 - 1, max_seqs=2, max_write=2**31 - 1), flat()),
    (dict(capacity=1, max_seqs=1, max_write=1), ring(1)),
], ids=["window-at-limit", "max_seqs-at-limit", "max_write-at-limit", "all-ones"])
def test_configs_at_their_limits_trace(kwargs, layer):
  """Configs at the edge of CONTRACT §2 build, and init_state plus every pure verb trace.

  Traced with jax.eval_shape, so nothing of the (huge) storage is allocated.
  """
  config = CacheConfig([LayerConfig(layer, 1, 2)], initial_capacity=4, **kwargs)
  _trace_every_verb(config)


def test_config_accepting_max_write_2_31_must_trace():
  """CONTRACT §2 allows `w + max_write - 1 < 2**31`, i.e. max_write = 2**31 for flat-only layers.

  Regression (fixed in 07fe30d): CacheConfig accepts it, but `declare_step` cannot trace (OverflowError:
  "Python integer 2147483648 out of bounds for int32", from `n > step_width`);
  decl_n is int32 (CONTRACT §10.2), so W = 2**31 cannot be represented. Either the
  config refuses max_write >= 2**31 with a ValueError or the verbs trace.
  """
  try:
    config = CacheConfig([LayerConfig(flat(), 1, 2)], capacity=2**31 - 1, max_seqs=2,
                         max_write=2**31, initial_capacity=4)
  except ValueError as e:
    assert "max_write" in str(e)
    return
  _trace_every_verb(config)


def _trace_every_verb(config):
  S = jax.ShapeDtypeStruct
  width = config.max_write
  state = jax.eval_shape(lambda: jaxkv.init_state(config))
  i32 = S((), jnp.int32)
  for l in range(config.num_layers):
    assert state.k[l].shape == config.layer_shape(l, config.initial_flat_rows)
  calls = [
      (pure.seq_new, ()), (pure.seq_clone, (i32, i32)), (pure.seq_rm, (i32,)),
      (pure.rewind, (i32, i32)), (pure.clear, ()),
      (pure.declare_step, (S((width,), jnp.int32), i32, S((width, 2), jnp.int32))),
      (pure.prepare_step, ()), (pure.prepare_step, (S((width,), jnp.int32),)),
      (pure.commit_step, ()), (pure.floor, (i32,)), (pure.rows_needed, ()),
  ]
  lc = config.layers[0]
  attend = lambda config, s, q, k, v: pure.attend(config, s, 0, q, k, v,
                                                  implementation="reference")
  calls.append((attend, (S((width, lc.n_kv_heads, lc.head_dim), jnp.float32),
                         S((width, lc.n_kv_heads, lc.head_dim), jnp.float32),
                         S((width, lc.n_kv_heads, lc.head_dim), jnp.float32))))
  for verb, args in calls:
    out = jax.eval_shape(lambda s, *a: verb(config, s, *a), state, *args)
    if isinstance(out, tuple) and isinstance(out[0], jaxkv.CacheState):
      assert jax.tree.map(lambda x: (x.shape, x.dtype), out[0]) == jax.tree.map(
          lambda x: (x.shape, x.dtype), state), verb


# --------------------------------------------------------------------------- fuzz


JUNK = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=3), st.none(),
    st.booleans(), st.lists(st.integers(-3, 5), max_size=10),
    st.lists(st.tuples(st.integers(-3, 10), st.integers(-3, 10)), max_size=3),
    st.sampled_from([np.int32(1), np.int64(2**40), np.float32(1.0), np.zeros((2, 2), np.int32),
                     (), [()], [[0, 1, 2]], {"a": 1}]))
ARRAYS = st.sampled_from([
    np.ones((1, 4, 4), np.float32), np.ones((W, 4, 4), np.float32),
    np.zeros((1, 2, 4), np.float32), np.zeros((W, 2, 4), np.float32),
    np.zeros((1, 2, 4), np.float16), np.ones((2, 4, 4), np.float32),
    np.ones((1, 4, 4), np.int32), np.ones((1, 4), np.float32), np.ones((1, 8, 4), np.float32)])

_FUZZ_CACHES: dict[str, jaxkv.BatchedSequenceCache] = {}


@settings(max_examples=H.stateful_runs(200, tests=1, steps_per_run=10.0), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(phase=st.sampled_from(["idle", "declared", "prepared"]),
       method=st.sampled_from(["is_live", "pos", "seq_clone", "seq_rm", "rewind",
                               "declare_step", "prepare_step", "attend", "commit_step"]),
       data=st.data())
def test_facade_fuzz_raises_only_value_or_type_errors(phase, method, data):
  """Junk arguments to any facade method give a result, ValueError or TypeError, nothing else.

  After an exception the state is bitwise unchanged.
  """
  cache = _cache(phase)
  if method == "attend":
    args = [data.draw(st.one_of(st.integers(-1, 2), JUNK))] + [
        data.draw(st.one_of(ARRAYS, ARRAYS, JUNK)) for _ in range(3)]
    kwargs = {"scale": data.draw(st.one_of(st.none(), st.floats(0.1, 2.0), JUNK))}
  elif method == "declare_step":
    args = [data.draw(st.one_of(st.lists(st.integers(-2, 4), max_size=W + 1), JUNK))]
    kwargs = {"owner_blocks": data.draw(JUNK)}
  elif method == "prepare_step":
    args, kwargs = [data.draw(st.one_of(st.none(), st.lists(st.integers(-1, 4), max_size=3),
                                        JUNK))], {}
  elif method == "commit_step":
    args, kwargs = [], {}
  else:
    arity = {"is_live": 1, "pos": 1, "seq_clone": 2, "seq_rm": 1, "rewind": 2}[method]
    args, kwargs = [data.draw(JUNK) for _ in range(arity)], {}
  before = snapshot(cache.state)
  try:
    result = getattr(cache, method)(*args, **kwargs)
  except (TypeError, ValueError):
    assert_same_state(before, snapshot(cache.state))
    return
  # Success must look like the method's contract: its documented result, a valid state.
  dynamic_validate_state(cache.config, cache.state)
  if method in ("is_live", "seq_rm", "rewind", "declare_step"):
    assert isinstance(result, bool), (method, result)
  elif method == "pos":
    assert isinstance(result, int) and 0 <= result <= cache.config.seq_len_limit, result
  elif method == "seq_clone":
    assert result is None or (isinstance(result, int) and cache.is_live(result)), result
  elif method == "attend":
    assert result.shape == np.shape(args[1]) and np.isfinite(np.asarray(result)).all()
  refused = result is False or (method == "seq_clone" and result is None)
  if method in ("is_live", "pos") or refused:
    assert_same_state(before, snapshot(cache.state))   # queries and refusals change nothing
