"""DFlash owner blocks: declarations, attention and bookkeeping (CONTRACT §9; §11 scenarios 45–46).

Probe values are derived here from the §8 table (a block query sees the
owner's history plus the whole block); toy content is checked against the
float64 oracle through `scenario_utils.Harness`. Refusals check that the state
is bitwise unchanged and that the earlier declaration still stands.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from fork_utils import assert_causal_probe
from fork_utils import assert_probe
from fork_utils import bits
from fork_utils import floor_of
from fork_utils import hw_of
from fork_utils import prepared
from fork_utils import probe_rows
from fork_utils import probe_step
from fork_utils import step_fields
import jaxkv
from oracle import expected_probe
from scenario_utils import Harness
from scenario_utils import assert_same_state
from scenario_utils import default_config
from scenario_utils import snapshot
from scenario_utils import tok

# Every scenario runs with column and paged storage (CONTRACT §3.1).
pytestmark = pytest.mark.usefixtures("storage")

FLAT = jaxkv.LayerPolicy.flat()
RING_W = 2
R = 9  # min(64, 2 + 8 − 1)


def _setup(implementation):
  """Layers flat + ring(2), capacity 64, W 8, 4 ids, F 8; x and y hold 6 probe tokens each."""
  config = default_config(layers=[FLAT, jaxkv.LayerPolicy.ring(RING_W)], capacity=64,
                          max_write=8, max_seqs=4, initial_capacity=8, kv_dtype=jnp.float32)
  h = Harness(config, implementation=implementation, content="probe")
  x, y = h.new(), h.new()
  h.step([x] * 6)
  h.step([y] * 6)
  if config.page_size is None:
    assert h.cache.state.k[0].shape[0] == 8
  return config, h, x, y


def _first_step(x, y):
  return dict(
      n_tokens=8, n_segments=2,
      seq_cols=[x] * 4 + [y] * 4,
      positions=[6, 7, 8, 9] * 2,
      write_rows=[[6, 7, 8, 9] * 2, [6 % R, 7 % R, 8 % R, 9 % R] * 2],
      seq_info=[[0, 4, x, 6, 1], [4, 4, y, 6, 1]] + [[8, 0, 4, 0, 0]] * 6)


REFUSED = [  # (ids as "x"/"y" letters, blocks, why)
    ("xxyxx", [(0, 5)], "split by y"),
    ("xxyxx", [(0, 2), (3, 2)], "two blocks for x"),
    ("xxx", [(0, 2)], "x continues after its block"),
    ("xx", [(1, 2)], "outside the step"),
    ("xx", [(0, 0)], "empty"),
    ("x", [(0, 1), (0, 1)], "same owner twice"),
]


def test_block_declarations(implementation):
  """45: malformed blocks are refused, leaving the first declaration standing."""
  _, h, x, y = _setup(implementation)
  cache = h.cache
  assert cache.declare_step([x] * 4 + [y] * 4, owner_blocks=[(0, 4), (4, 4)]) is True
  before = snapshot(cache.state)
  for letters, blocks, why in REFUSED:
    ids = [{"x": x, "y": y}[c] for c in letters]
    assert cache.declare_step(ids, owner_blocks=blocks) is False, why
    assert_same_state(before, snapshot(cache.state))
  assert step_fields(cache.prepare_step()) == _first_step(x, y)


def test_block_after_context_is_accepted(implementation):
  """45: on a fresh setup, a block that is x's last run after y's token is accepted."""
  _, h, x, y = _setup(implementation)
  fields = prepared(h.cache, [x, x, y, x, x], owner_blocks=[(3, 2)])
  assert fields["positions"][:5] == [6, 7, 6, 8, 9]  # x's context 6, 7; y 6; x's block 8, 9
  assert fields["n_segments"] == 3
  assert fields["seq_info"][:3] == [[0, 2, x, 6, 0], [2, 1, y, 6, 0], [3, 2, x, 8, 1]]
  h.step([x, x, y, x, x], owner_blocks=[(3, 2)])  # oracles: x causal 6, 7, block 8, 9; y 6


def test_block_attention_and_bookkeeping(implementation):
  """46: block queries see the whole block, blocks commit nothing but raise hw, F and the floor."""
  config, h, x, y = _setup(implementation)
  cache = h.cache
  ids = [x] * 4 + [y] * 4
  blocks = [(0, 4), (4, 4)]
  assert prepared(cache, ids, owner_blocks=blocks) == _first_step(x, y)
  if config.page_size is None:
    assert cache.state.k[0].shape[0] == 16  # flat rows grew 8 → 16 for b0 + B = 10

  # Probe content: every block query reads positions 0..9 (flat) and 5..9 (ring),
  # where a causal query at 6 would read 6.5 on the ring.
  probe_q, probe_k, probe_v = probe_rows([6, 7, 8, 9] * 2)
  for layer, want in ((0, 5.5), (1, 8.0)):
    out = np.asarray(cache.attend(layer, jnp.asarray(probe_q), jnp.asarray(probe_k),
                                  jnp.asarray(probe_v)))
    window = None if layer == 0 else RING_W
    expected = [expected_probe(p, window, block=(6, 4)) for p in [6, 7, 8, 9] * 2]
    np.testing.assert_allclose([expected[0][0], expected_probe(6, RING_W)[0]], [want, 6.5], rtol=1e-6)
    assert_probe(out, expected, f"block probe layer {layer}")

  # Toy content: token 3 (x's last block token) reaches x's first query, never y's rows.
  for layer in range(len(config.layers)):
    q, k, v = (np.stack(part) for part in zip(*[tok(7, p, layer) for p in [6, 7, 8, 9] * 2]))
    first = np.asarray(cache.attend(layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    k2, v2 = k.copy(), v.copy()
    k2[3] += 1.0
    v2[3] -= 1.0
    second = np.asarray(cache.attend(layer, jnp.asarray(q), jnp.asarray(k2), jnp.asarray(v2)))
    assert np.isfinite(first).all() and np.isfinite(second).all()
    assert (first[0] != second[0]).any(), f"layer {layer}: block query 0 ignores token 3"
    np.testing.assert_array_equal(bits(first[4:]), bits(second[4:]))

  cache.commit_step()
  assert cache.pos(x) == 6 and cache.pos(y) == 6
  assert hw_of(cache, x) == 10 and hw_of(cache, y) == 10
  if config.page_size is None:
    assert cache.state.k[0].shape[0] == 16
  assert floor_of(config, cache.state, x) == 10 - R + RING_W - 1 == 2

  before = snapshot(cache.state)
  assert h.rewind(x, 1) is False
  assert_same_state(before, snapshot(cache.state))
  assert h.rewind(x, 2) is True

  # Mixed step: y's context at 6, 7 is causal, its block covers 8..10.
  fields = prepared(cache, [y] * 5, owner_blocks=[(2, 3)])
  assert fields["n_segments"] == 2
  assert fields["seq_info"][:2] == [[0, 2, y, 6, 0], [2, 3, y, 8, 1]]
  positions, outs = probe_step(cache, [y] * 5, owner_blocks=[(2, 3)])
  assert positions == [6, 7, 8, 9, 10]
  assert_causal_probe([o[:2] for o in outs], positions[:2], [None, RING_W], "y context")
  for layer, window in enumerate([None, RING_W]):
    assert_probe(outs[layer][2:], [expected_probe(p, window, block=(8, 3)) for p in (8, 9, 10)],
                 f"y block layer {layer}")
  assert cache.pos(y) == 8 and hw_of(cache, y) == 11
