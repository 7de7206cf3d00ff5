"""Storage: flat growth, failed growth, columns, the scratch column and commit rules.

CONTRACT §3, §6.5, §7; §11 scenarios 37, 38, 40–44 (39, configuration validation,
lives in test_config.py). Outputs are checked against the float64 oracle through
`scenario_utils.Harness` or against probe values derived from §8 here; storage
is compared bit by bit, scratch column excluded.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from drivers import PureCache
from drivers import poison_free_storage
from fork_utils import assert_causal_probe
from fork_utils import assert_probe
from fork_utils import bits
from fork_utils import floor_of
from fork_utils import hw_of
from fork_utils import kv_bits
from fork_utils import nan_scratch
from fork_utils import prepared
from fork_utils import probe_step
from fork_utils import state_copy
import jaxkv
from oracle import expected_probe
from oracle import tol
from scenario_utils import Harness
from scenario_utils import assert_same_state
from scenario_utils import default_config
from scenario_utils import layer_windows
from scenario_utils import snapshot

# Every scenario runs with column and paged storage (CONTRACT §3.1).
pytestmark = pytest.mark.usefixtures("storage")

FLAT = jaxkv.LayerPolicy.flat()


def ring(window):
  return jaxkv.LayerPolicy.ring(window)


def _flat_rows(state) -> int:
  return int(state.k[0].shape[0])


# --------------------------------------------------------------------------- 37


@pytest.mark.columns_only   # the page pool never grows (CONTRACT §3.1)
def test_growth_preserves_contents():
  """37: F grows 4 → 8 → 16 → 32 keeping old rows' bytes, zeroing new ones, leaving the ring alone."""
  config = default_config(layers=[FLAT, ring(4)], capacity=32, initial_capacity=4, max_write=8)
  h = Harness(config)
  cache = h.cache
  x, y = h.new(), h.new()
  assert _flat_rows(cache.state) == 4
  assert cache.state.k[1].shape == (11, 5, 2, 8)  # R = min(32, 4 + 8 − 1)

  def grow_then_step(ids, want_rows):
    assert cache.declare_step(ids) is True
    old_rows = _flat_rows(cache.state)
    flat_before = [bits(cache.state.k[0]), bits(cache.state.v[0])]
    ring_before = [bits(cache.state.k[1]), bits(cache.state.v[1])]
    cache.prepare_step()  # growth happens here, before any write (§3)
    state = cache.state
    assert _flat_rows(state) == want_rows, ids
    for before, after in zip(flat_before, (state.k[0], state.v[0])):
      after = bits(after)[:, :config.max_seqs]
      np.testing.assert_array_equal(after[:old_rows], before[:, :config.max_seqs])
      assert not after[old_rows:].any(), "new rows must be zero"
    for before, after in zip(ring_before, (state.k[1], state.v[1])):
      assert after.shape == before.shape
      np.testing.assert_array_equal(bits(after)[:, :config.max_seqs],
                                    before[:, :config.max_seqs])
    h.step(ids)  # re-declares (§6.1), then writes, attends and commits, checked by the oracles

  grow_then_step([x] * 5 + [y] * 2, 8)
  grow_then_step([x] * 8, 16)
  grow_then_step([x] * 8, 32)  # 21 required: min(32, max(21, 32))
  grow_then_step([x] * 8, 32)  # 29 required: no growth
  grow_then_step([y], 32)
  assert int(cache.state.held) == 32

  before = snapshot(cache.state)
  assert cache.declare_step([x]) is False
  assert_same_state(before, snapshot(cache.state))

  cache.clear()
  assert _flat_rows(cache.state) == 32
  assert int(cache.state.held) == 0


# --------------------------------------------------------------------------- 38


class InjectedAllocationError(RuntimeError):
  """The fault `_allocate_rows` raises in scenario 38."""


def _inject(monkeypatch, fail_on):
  """Makes call `fail_on` (1-based; None: every call) of jaxkv's growth allocation raise.

  CONTRACT §10.5: all growth goes through one internal allocation function, which
  tests use to inject failures; jaxkv names it `jaxkv._host._allocate_rows`.
  This is the only private name the tests touch.
  """
  import jaxkv._host as host  # pylint: disable=g-import-not-at-top
  real = host._allocate_rows  # pylint: disable=protected-access
  calls = []

  def allocate(array, rows):
    calls.append(rows)
    if fail_on is None or len(calls) == fail_on:
      raise InjectedAllocationError(f"injected allocation failure at call {len(calls)}")
    return real(array, rows)

  monkeypatch.setattr(host, "_allocate_rows", allocate)
  return calls


def _growth_setup():
  """Layers flat, flat, ring(4), initial_capacity 4; x holds 3 tokens."""
  config = default_config(layers=[FLAT, FLAT, ring(4)], initial_capacity=4)
  h = Harness(config)
  x = h.new()
  h.step([x] * 3)
  assert _flat_rows(h.cache.state) == 4
  return config, h, x


@pytest.mark.parametrize("fail_on", [1, 2, 3], ids=lambda c: f"call{c}")
@pytest.mark.columns_only   # the page pool never grows (CONTRACT §3.1)
def test_failed_growth_is_transactional(monkeypatch, fail_on):
  """38: a failed allocation leaves shapes, bytes, control values and the declaration as before."""
  _, h, x = _growth_setup()
  cache = h.cache
  calls = _inject(monkeypatch, fail_on)
  assert cache.declare_step([x] * 3) is True  # needs 6 rows > F = 4
  before = snapshot(cache.state)
  with pytest.raises(InjectedAllocationError, match="injected allocation failure"):
    cache.prepare_step()
  assert len(calls) == fail_on
  assert_same_state(before, snapshot(cache.state))
  assert _flat_rows(cache.state) == 4 and cache.state.k[1].shape[0] == 4
  assert int(cache.state.phase) == jaxkv.Phase.DECLARED
  assert cache.pos(x) == 3 and hw_of(cache, x) == 3

  monkeypatch.undo()
  step = cache.prepare_step()  # the standing declaration, retried without the fault
  assert np.asarray(step.positions)[:3].tolist() == [3, 4, 5]
  assert _flat_rows(cache.state) == 8
  h.step([x] * 3)  # and the rows are usable: outputs match the oracle


@pytest.mark.columns_only   # the page pool never grows (CONTRACT §3.1)
def test_step_without_growth_needs_no_allocation(monkeypatch):
  """38: after a failed growth, a 1-token step needs no rows and succeeds with the fault still on."""
  _, h, x = _growth_setup()
  calls = _inject(monkeypatch, None)
  assert h.cache.declare_step([x] * 3) is True
  with pytest.raises(InjectedAllocationError, match="injected allocation failure"):
    h.cache.prepare_step()
  assert len(calls) == 1
  h.step([x])  # pos 3 + 1 = 4 = F
  assert len(calls) == 1
  assert h.cache.pos(x) == 4 and _flat_rows(h.cache.state) == 4


# --------------------------------------------------------------------------- 40


def test_max_seqs_exhaustion_and_reuse():
  """40: ids run out at max_seqs, come back after removal; a step touches only its column."""
  config = default_config(max_seqs=2)
  h = Harness(config)
  cache = h.cache
  assert h.new() == 0 and h.new() == 1
  if config.page_size is None:
    assert cache.state.k[0].shape == (32, 3, 2, 8)

  before = snapshot(cache.state)
  assert cache.seq_new() is None
  assert_same_state(before, snapshot(cache.state))

  h.step([0, 0])
  before = snapshot(cache.state)
  assert h.clone(0) is None  # NO_FREE_ID
  assert_same_state(before, snapshot(cache.state))

  assert h.rm(0)
  assert h.new() == 0

  h.step([1])
  before = kv_bits(cache.state, config.max_seqs)
  h.step([1])  # writes row 1 of column 1
  after = kv_bits(cache.state, config.max_seqs)
  # Columns: row 1 of column 1. Paged: row 1 % page_size of the page column 1's
  # slot 1 // page_size names (the paged storage's "column" axis is the row in the page).
  where = [[1, 1]]
  if config.page_size is not None:
    page = int(np.asarray(cache.state.page_table)[1, 1 // config.page_size])
    where = [[page, 1 % config.page_size]]
  for b, a in zip(before, after):
    changed = np.argwhere((a != b).any(axis=(2, 3)))
    assert changed.tolist() == where, changed


# --------------------------------------------------------------------------- 41


def test_scratch_column_with_padded_width(implementation):
  """41: padded tokens go to the scratch column, change nothing else, and are never read."""
  config = default_config(layers=[FLAT, ring(2)], max_seqs=2, max_write=4)  # R = 5
  h = Harness(config, implementation=implementation)
  cache = h.cache
  x, y = h.new(), h.new()
  assert prepared(cache, [x, x, y]) == dict(
      n_tokens=3, n_segments=2,
      seq_cols=[0, 0, 1, 2], positions=[0, 1, 0, 0], write_rows=[[0, 1, 0, 0], [0, 1, 0, 0]],
      seq_info=[[0, 2, 0, 0, 0], [2, 1, 1, 0, 0], [3, 0, 2, 0, 0], [3, 0, 2, 0, 0]])
  before = kv_bits(cache.state, config.max_seqs)
  outs = h.step([x, x, y], T=4)  # row 3 of q, k, v is NaN; rows 0–2 finite and match the oracles
  after = kv_bits(cache.state, config.max_seqs)
  for b, a in zip(before, after):
    changed = np.argwhere((a != b).any(axis=(2, 3)))
    assert changed.tolist() == [[0, 0], [0, 1], [1, 0]], changed

  # Fresh sequences in the used storage, through the pure API: as is, with a NaN
  # scratch column, and with every free row NaN. Real outputs must not change.
  tags = [h.tags[x], h.tags[y]]
  assert h.rm(x) and h.rm(y)
  state = state_copy(cache)
  variants = [state, nan_scratch(state, config.max_seqs), poison_free_storage(state, config)]
  results = []
  pure = PureCache(config, implementation=implementation)  # one instance: one compilation
  for variant in variants:
    pure.state = variant
    hp = Harness(config, implementation=implementation, cache=pure)
    assert [hp.new(tag=t) for t in tags] == [0, 1]
    results.append(hp.step([0, 0, 1], T=4))  # checked against fresh oracles
  for poisoned in results[1:]:
    for plain, layer_out in zip(results[0], poisoned):
      np.testing.assert_array_equal(bits(plain), bits(layer_out))
  for out, again in zip(outs, results[0]):
    np.testing.assert_allclose(out, again, atol=tol(config.kv_dtype), rtol=0)


# --------------------------------------------------------------------------- 42


def test_worked_example_step(implementation):
  """42: the §7.3 worked example's exact Step and probe values, and its wrap case."""
  config = default_config(layers=[FLAT, ring(4)], capacity=64, max_write=8,
                          kv_dtype=jnp.float32)  # R = 11
  cache = jaxkv.BatchedSequenceCache(config, implementation=implementation)
  a = cache.seq_new()
  probe_step(cache, [a] * 5)
  b = cache.seq_new()
  assert prepared(cache, [a, a, b, a]) == dict(
      n_tokens=4, n_segments=3,
      positions=[5, 6, 0, 7, 0, 0, 0, 0],
      seq_cols=[0, 0, 1, 0, 4, 4, 4, 4],
      write_rows=[[5, 6, 0, 7, 0, 0, 0, 0], [5, 6, 0, 7, 0, 0, 0, 0]],
      seq_info=[[0, 2, 0, 5, 0], [2, 1, 1, 0, 0], [3, 1, 0, 7, 0]] + [[4, 0, 4, 0, 0]] * 5)
  positions, outs = probe_step(cache, [a, a, b, a])
  assert positions == [5, 6, 0, 7]
  assert_causal_probe(outs, positions, layer_windows(config), "worked example")
  for layer, want in ((0, [3.5, 4, 1, 4.5]), (1, [4.5, 5.5, 1, 6.5])):  # §11 scenario 42
    got = outs[layer][:, :, 0]
    np.testing.assert_allclose(got, np.broadcast_to(np.array(want)[:, None], got.shape),
                               rtol=tol(jnp.float32), atol=0)

  wrap = default_config(layers=[FLAT, ring(4)], capacity=64, max_write=2,
                        kv_dtype=jnp.float32)  # R = 5
  cache = jaxkv.BatchedSequenceCache(wrap, implementation=implementation)
  a = cache.seq_new()
  while cache.pos(a) < 9:
    probe_step(cache, [a] * min(2, 9 - cache.pos(a)))
  fields = prepared(cache, [a, a])
  assert fields["positions"] == [9, 10]
  assert fields["write_rows"] == [[9, 10], [4, 0]]
  positions, outs = probe_step(cache, [a, a])
  assert_causal_probe(outs, positions, layer_windows(wrap), "wrap case")
  assert_probe(outs[1], [(8.5, expected_probe(9, 4)[1]), (9.5, expected_probe(10, 4)[1])],
               "wrap case ring")


# --------------------------------------------------------------------------- 43


def test_clamped_ring():
  """43: capacity 6 clamps ring(4) with W = 4 to R = 6; it never wraps and its floor stays 0."""
  config = default_config(layers=[ring(4)], capacity=6, max_write=4)
  h = Harness(config)
  cache = h.cache
  assert cache.state.k[0].shape == (6, 5, 2, 8)  # R = 6, not 7
  a = h.new()
  assert prepared(cache, [a] * 4)["write_rows"] == [[0, 1, 2, 3]]
  h.step([a] * 4)
  assert prepared(cache, [a] * 2)["write_rows"] == [[4, 5, 0, 0]]
  h.step([a] * 2)
  assert hw_of(cache, a) == 6
  assert floor_of(config, cache.state, a) == 0
  assert h.rewind(a, 1) is True
  h.step([a] * 4)  # continues from 1, checked against the rewound oracle


# --------------------------------------------------------------------------- 44


def test_commit_rules():
  """44: a second commit is a no-op; commit in DECLARED and prepare after commit raise."""
  config = default_config()
  h = Harness(config)
  cache = h.cache
  x = h.new()
  h.step([x, x])
  before = snapshot(cache.state)
  cache.commit_step()  # COMMITTED: no-op, no error
  assert_same_state(before, snapshot(cache.state))
  with pytest.raises(jaxkv.StepError, match="prepare_step"):
    cache.prepare_step()
  assert_same_state(before, snapshot(cache.state))

  assert cache.declare_step([x]) is True
  before = snapshot(cache.state)
  with pytest.raises(jaxkv.StepError, match="commit_step"):
    cache.commit_step()
  assert_same_state(before, snapshot(cache.state))
  assert int(cache.state.phase) == jaxkv.Phase.DECLARED
  assert cache.pos(x) == 2


def test_redeclare_drops_prepared_step():
  """44: a new declaration over a served, prepared step commits nothing but keeps its hw."""
  config = default_config()
  h = Harness(config)
  cache = h.cache
  x = h.new()
  assert cache.declare_step([x, x]) is True
  cache.prepare_step()
  for layer in range(len(config.layers)):
    q = jnp.ones((2, 4, 8), jnp.float32)
    cache.attend(layer, q, jnp.ones((2, 2, 8), jnp.float32), jnp.ones((2, 2, 8), jnp.float32))
  assert cache.declare_step([x]) is True
  assert cache.pos(x) == 0 and hw_of(cache, x) == 2
  before = snapshot(cache.state)
  with pytest.raises(jaxkv.StepError, match="commit_step"):
    cache.commit_step()
  assert_same_state(before, snapshot(cache.state))
  assert np.asarray(cache.prepare_step().positions)[:1].tolist() == [0]
  h.step([x])  # position 0 again, with new content; the stale position 1 is never read
  assert cache.pos(x) == 1
