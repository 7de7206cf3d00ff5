"""The serving loop's step schedule (`loop._schedule`) equals the cumsum form it replaced.

`_schedule` derives every prefix sum from those of the wanted tokens and of their
first ones (one compare-and-sum). The oracle below is the earlier formulation
(three `cumsum`s, one after another); they must agree on every column mix: idle
columns, decodes, prefill chunks cut by the width or by a paged `room` (also one
smaller than the decode tokens, which the loop never lets run).
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.serve import loop


def _cumsum_schedule(width, want, room=None):
  one = np.minimum(want, 1)
  first = np.where(np.cumsum(one) <= width, one, 0)
  rest = want - first
  budget = (width if room is None else min(width, room)) - first.sum()
  more = np.clip(budget - (np.cumsum(rest) - rest), 0, rest)
  alloc = first + more
  return alloc, np.cumsum(alloc) - alloc


def _columns(want):
  """A loop state's fields `_wanted` reads, for columns that want `want` tokens."""
  s = want.shape[0]
  active = (want > 0) | (np.arange(s) % 3 == 0)   # some active columns want nothing
  fed = np.full((s,), 5, np.int32)
  return types.SimpleNamespace(active=jnp.asarray(active, jnp.int32),
                               length=jnp.asarray(fed + want, jnp.int32),
                               hold=jnp.full((s,), 10**6, jnp.int32), fed=jnp.asarray(fed),
                               draft=jnp.zeros((s,), jnp.int32))


@pytest.mark.parametrize("num_cols", [1, 5, 64])
@pytest.mark.parametrize("paged", [False, True])
def test_schedule_matches_the_cumsum_schedule(num_cols, paged, rng):
  for _ in range(40):
    kind = rng.random(num_cols)
    want = np.where(kind < 0.3, 0, np.where(kind < 0.7, 1, rng.integers(1, 200, num_cols)))
    want = want.astype(np.int32)
    width = int(rng.choice([1, 3, 8, 64, 2048]))
    room = int(rng.integers(0, 2 * width + 1)) if paged else None
    alloc, start = loop._schedule(width, _columns(want), room)   # pylint: disable=protected-access
    want_alloc, want_start = _cumsum_schedule(width, want, room)
    np.testing.assert_array_equal(alloc, want_alloc, err_msg=f"{want=} {width=} {room=}")
    np.testing.assert_array_equal(start, want_start, err_msg=f"{want=} {width=} {room=}")


def test_column_totals_are_the_separate_sums(rng):
  """The step's and the phase condition's sums, stacked into one reduction, are the sums."""
  want = rng.integers(0, 5, 64).astype(np.int32)
  ls = _columns(want)
  flags = jnp.asarray(rng.random(64) < 0.5)
  totals = loop._column_totals(ls.active == 1, flags, want, jnp.where(flags, want, 0))   # pylint: disable=protected-access
  np.testing.assert_array_equal(totals, [int(np.sum(np.asarray(ls.active) == 1)),
                                         int(np.sum(np.asarray(flags))), int(want.sum()),
                                         int(np.where(np.asarray(flags), want, 0).sum())])
  widths = (64, 16, 8)
  for total in (totals[2], jnp.int32(12), jnp.int32(3)):
    ls = _columns(np.array([int(total)] + [0] * 63, np.int32))
    assert int(loop.width_index(widths, ls, total)) == int(loop.width_index(widths, ls))


@pytest.mark.parametrize("num_cols", [1, 7, 64])
def test_the_phase_condition_counts_the_paged_step_need(num_cols, rng):
  """The phase condition sums `wanted > 0` with its other column totals in place of
  `paged_claims.step_need` (its own reduction): the two counts agree, with `hold`
  below, at and above `length` and inactive columns that still have tokens to feed."""
  from jaxkv.serve import paged_claims   # pylint: disable=g-import-not-at-top
  for _ in range(30):
    fed = rng.integers(0, 50, num_cols)
    ls = types.SimpleNamespace(
        active=jnp.asarray(rng.random(num_cols) < 0.7, jnp.int32),
        length=jnp.asarray(fed + rng.integers(-3, 6, num_cols), jnp.int32),
        hold=jnp.asarray(fed + rng.integers(-3, 6, num_cols), jnp.int32),
        fed=jnp.asarray(fed, jnp.int32), draft=jnp.zeros((num_cols,), jnp.int32))
    want = np.minimum(np.asarray(ls.length), np.asarray(ls.hold)) > fed
    expected = int((want & (np.asarray(ls.active) == 1)).sum())
    assert int(paged_claims.step_need(ls)) == expected
    assert int((loop._wanted(ls) > 0).sum()) == expected   # pylint: disable=protected-access
