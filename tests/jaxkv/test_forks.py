"""Forks, snapshots and the ring floor (CONTRACT §4.2, §5; §11 scenarios 14–21).

Fork results are checked three ways: every step against the float64 oracle
(`tests/oracle.py`, through `scenario_utils.Harness`); clones of snapshots in
the dependent model against a cold single-token run of the same tokens (the
model's later layers read earlier layers' outputs, so one wrong row spreads);
and probe content against exact values derived here from the §8 visibility
table. Every refusal also checks that the state is bitwise unchanged.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from drivers import PureCache
from fork_utils import advance
from fork_utils import assert_causal_probe
from fork_utils import floor_of
from fork_utils import host_positions
from fork_utils import hw_of
import jaxkv
from oracle import expected_probe
from oracle import tol
from scenario_utils import Harness
from scenario_utils import assert_same_state
from scenario_utils import default_config
from scenario_utils import snapshot

# Every scenario runs with column and paged storage (CONTRACT §3.1).
pytestmark = pytest.mark.usefixtures("storage")

FLAT = jaxkv.LayerPolicy.flat()
DRIVERS = ["facade", "pure-poisoned"]  # pure-poisoned: NaN in every row no live sequence owns


def ring(window):
  return jaxkv.LayerPolicy.ring(window)


# --------------------------------------------------------------------------- 14, 15


def _decode_ring_w4_w1():
  """Scenarios 14–15: `ring(4)`, `max_write = 1` (R = 4); a decodes 0..9 (hw 10, floor 9)."""
  config = default_config(layers=[ring(4)], max_write=1)
  h = Harness(config)
  a = h.new()
  for _ in range(10):
    last = h.step([a])
  assert h.cache.pos(a) == 10 and hw_of(h.cache, a) == 10
  assert floor_of(config, h.cache.state, a) == 9
  return config, h, a, last


def test_partial_fork_of_wrapped_ring():
  """14: a clone below the floor is refused; one at the floor continues a's history."""
  _, h, a, a_last = _decode_ring_w4_w1()

  before = snapshot(h.cache.state)
  assert h.clone(a, 6) is None
  assert h.clone(a, 8) is None
  assert_same_state(before, snapshot(h.cache.state))

  f = h.clone(a, 9)
  assert f is not None
  assert h.cache.pos(f) == 9 and hw_of(h.cache, f) == 10
  outs = h.step([f], tags=[h.tags[a]])  # a's own token 9, checked against a's oracle forked at 9
  np.testing.assert_allclose(outs[-1], a_last[-1], atol=tol(h.kv_dtype), rtol=0)
  assert h.cache.pos(a) == 10 and h.cache.pos(f) == 10


def test_fork_of_fork_keeps_floor():
  """15: a fork inherits hw 10, so it refuses 8 for both clone and rewind."""
  config, h, a, _ = _decode_ring_w4_w1()
  b = h.clone(a, 9)
  assert b is not None
  assert h.cache.pos(b) == 9 and hw_of(h.cache, b) == 10
  assert floor_of(config, h.cache.state, b) == 9

  before = snapshot(h.cache.state)
  assert h.clone(b, 8) is None
  assert h.rewind(b, 8) is False
  assert_same_state(before, snapshot(h.cache.state))
  assert h.cache.pos(b) == 9
  h.step([b])  # b still continues its own history at 9


# --------------------------------------------------------------------------- 16, 17


def _snapshot_config():
  return default_config(layers=[FLAT, ring(4)], max_write=3, capacity=256, max_seqs=8,
                        initial_capacity=2)


def _snapshot_setup(driver):
  """src prefills 21 tokens in chunks of 3, snap = clone at 21, src runs on to 42 and leaves."""
  config = _snapshot_config()
  h = Harness(config, dependent=True, driver=driver)
  src = h.new()
  advance(h, src, 21, 3)
  snap = h.clone(src, 21, tag=h.tags[src])
  assert snap is not None
  assert h.cache.pos(snap) == 21 and hw_of(h.cache, snap) == 21
  advance(h, src, 42, 3)  # R = 6: src rewrites its ring column three more times
  assert h.cache.pos(snap) == 21
  assert h.rm(src)
  return config, h, snap


def _cold(config, tags):
  """A cold single-token run (fresh cache, `max_seqs = 1`) of tokens with these tags; last-layer rows."""
  cold = Harness(dataclasses.replace(config, max_seqs=1), dependent=True)
  s = cold.new()
  return np.concatenate([cold.step([s], tags=[t])[-1] for t in tags])


def _assert_cold(got, cold, what):
  assert np.isfinite(got).all(), what
  np.testing.assert_allclose(got, cold, atol=tol(jnp.float16), rtol=0, err_msg=what)


@pytest.mark.parametrize("driver", DRIVERS)
def test_snapshot_survives_source_and_fork_writes(driver):
  """16: clones of a snapshot equal cold runs after the source rewrote its ring and left."""
  config, h, snap = _snapshot_setup(driver)
  src_tag = h.tags[snap]

  c1 = h.clone(snap, 21)
  assert c1 is not None and h.cache.pos(c1) == 21
  got = advance(h, c1, 28, 1)
  cold = _cold(config, [src_tag] * 21 + [h.tags[c1]] * 7)
  _assert_cold(got, cold[21:], "clone at 21 plus 7 tokens")

  c2 = h.clone(snap, 20)
  assert c2 is not None and h.cache.pos(c2) == 20
  got = h.step([c2], tags=[src_tag])[-1]
  _assert_cold(got, cold[20:21], "clone at 20 replaying token 20")

  c3 = h.clone(snap, 21)
  assert c3 is not None
  assert h.rm(snap)
  got = advance(h, c3, 24, 1)
  cold3 = _cold(config, [src_tag] * 21 + [h.tags[c3]] * 3)
  _assert_cold(got, cold3[21:], "clone at 21 after the snapshot left")


@pytest.mark.parametrize("driver", DRIVERS)
def test_retained_boundary_and_older_snapshot(driver):
  """17: snap21 (floor 18) serves 18 but refuses 17; an older snap17 (floor 14) serves 17."""
  config, h, snap21 = _snapshot_setup(driver)
  src_tag = h.tags[snap21]
  assert floor_of(config, h.cache.state, snap21) == 18

  for _ in range(2):  # two clones at 18 with different tokens 18
    d = h.clone(snap21, 18)
    assert d is not None and h.cache.pos(d) == 18
    got = advance(h, d, 21, 1)
    _assert_cold(got, _cold(config, [src_tag] * 18 + [h.tags[d]] * 3)[18:], "clone at 18")

  before = snapshot(h.cache.state)
  assert h.clone(snap21, 17) is None
  assert_same_state(before, snapshot(h.cache.state))
  assert h.cache.pos(snap21) == 21

  src2 = h.new()
  advance(h, src2, 17, 3)  # chunks 3, 3, 3, 3, 3, 2
  snap17 = h.clone(src2, 17, tag=h.tags[src2])
  assert snap17 is not None
  assert h.rm(src2)
  assert hw_of(h.cache, snap17) == 17
  assert floor_of(config, h.cache.state, snap17) == 14

  before = snapshot(h.cache.state)
  assert h.clone(snap21, 17) is None
  assert_same_state(before, snapshot(h.cache.state))

  e = h.clone(snap17, 17)
  assert e is not None and h.cache.pos(e) == 17
  got = advance(h, e, 21, 1)
  cold = _cold(config, [h.tags[snap17]] * 17 + [h.tags[e]] * 4)
  _assert_cold(got, cold[17:], "clone of snap17 at 17 with a divergent suffix")


# --------------------------------------------------------------------------- 18, 19, 21 (probe)

WIDTHS = [1, 3, 5]


def _probe_harness(width, cache=None, driver="facade"):
  config = default_config(layers=[FLAT, ring(4)], capacity=128, max_write=width,
                          kv_dtype=jnp.float32)
  return config, Harness(config, content="probe", cache=cache, driver=driver)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"W{w}")
def test_clones_of_snapshot_are_exact(width, driver):
  """18: clones of a hw-21 snapshot at 21, 21 − W, 20 and 21 again give exact probe values."""
  config, h = _probe_harness(width, driver=driver)
  src = h.new()
  advance(h, src, 21, width, "src")
  snap = h.clone(src, 21)
  assert snap is not None
  assert floor_of(config, h.cache.state, snap) == 21 - width
  advance(h, src, 40, width, "src after the snapshot")

  for upto in (21, 21 - width, 20, 21):
    c = h.clone(snap, upto)
    assert c is not None, upto
    assert h.cache.pos(c) == upto and hw_of(h.cache, c) == 21
    advance(h, c, 24, width, f"clone at {upto}")
    assert h.rm(c)

  before = snapshot(h.cache.state)
  c = h.clone(snap, 19)
  if width == 1:  # floor 20
    assert c is None
    assert_same_state(before, snapshot(h.cache.state))
  else:  # floors 18 and 16
    assert c is not None and h.cache.pos(c) == 19
    advance(h, c, 24, width, "clone at 19")


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"W{w}")
def test_older_snapshot_reaches_further_back(width, driver):
  """19: a hw-9 snapshot accepts 8 (floors 8/6/4) where the hw-21 one refuses it."""
  config, h = _probe_harness(width, driver=driver)
  src = h.new()
  advance(h, src, 9, width, "src")
  old = h.clone(src, 9)
  assert old is not None
  advance(h, src, 21, width, "src")
  new = h.clone(src, 21)
  assert new is not None
  assert floor_of(config, h.cache.state, old) == {1: 8, 3: 6, 5: 4}[width]
  assert floor_of(config, h.cache.state, new) == 21 - width

  before = snapshot(h.cache.state)
  assert h.clone(new, 8) is None
  assert_same_state(before, snapshot(h.cache.state))

  f = h.clone(old, 8)
  assert f is not None and h.cache.pos(f) == 8 and hw_of(h.cache, f) == 9
  advance(h, f, 15, width, "clone of old at 8")


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"W{w}")
def test_rewind_at_floor(width):
  """21 (first half): 20 − W is refused by rewind and clone; 21 − W is accepted and exact."""
  config, h = _probe_harness(width)
  src = h.new()
  advance(h, src, 21, width, "src")
  assert floor_of(config, h.cache.state, src) == 21 - width

  before = snapshot(h.cache.state)
  assert h.rewind(src, 20 - width) is False
  assert h.clone(src, 20 - width) is None
  assert_same_state(before, snapshot(h.cache.state))
  assert h.cache.pos(src) == 21

  assert h.rewind(src, 21 - width) is True
  assert h.cache.pos(src) == 21 - width and hw_of(h.cache, src) == 21
  advance(h, src, 30, width, "after a rewind to the floor")


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"W{w}")
def test_forced_rewind_below_floor_reads_stale_rows(width):
  """21 (second half): forcing pos = 20 − W past the refusal makes ring probe values wrong.

  This proves the floor check matters. The ring (R = W + 3) then holds position
  20 in the row of position 17 − W, which the first query at 20 − W needs. A
  control forced to the floor itself (21 − W) through the same pure-API loop is
  exact, so the loop is sound.
  """
  config, h = _probe_harness(width, cache=PureCache(
      default_config(layers=[FLAT, ring(4)], capacity=128, max_write=width,
                     kv_dtype=jnp.float32)))
  src = h.new()
  advance(h, src, 21, width, "src")
  state = h.cache.state  # PureCache does not donate, so this stays valid

  def force(position):
    h.cache.state = dataclasses.replace(
        state, pos=state.pos.at[src].set(position), held=jnp.asarray(position, jnp.int32))
    h.oracles[src] = h.oracles[src].fork(position)

  force(21 - width)
  advance(h, src, 24, width, "forced to the floor")

  force(20 - width)
  positions = host_positions(h.cache, [src] * width)
  assert positions[0] == 20 - width
  outs = h.step([src] * width, check=False)
  assert_causal_probe(outs[:1], positions, h.windows[:1], "flat layer below the floor")
  ring_ch0 = outs[1][:, :, 0].astype(np.float64)  # [W, H_q]
  want_ch0 = np.array([expected_probe(p, 4)[0] for p in positions])
  wrong = np.abs(ring_ch0 - want_ch0[:, None]) > tol(jnp.float32) * want_ch0[:, None]
  assert wrong[0].all(), (ring_ch0, want_ch0)
  # The stale row holds position 20 (V = 21) where position 17 − W belongs.
  stale = np.mean([p + 1 for p in range(18 - width, 21 - width)] + [21])
  np.testing.assert_allclose(ring_ch0[0], stale, rtol=tol(jnp.float32))


# --------------------------------------------------------------------------- 20


def test_positions_not_tokens():
  """20: a fork at 20 continues with any content after src's tokens 0..19."""
  config = default_config(capacity=64)  # 21 + 20 held tokens
  h = Harness(config)
  src = h.new()
  advance(h, src, 21, config.max_write)
  f = h.clone(src, 20)
  assert f is not None and h.cache.pos(f) == 20
  h.step([f])  # f's own tag: the oracle holds src's 0..19, then this content at 20
