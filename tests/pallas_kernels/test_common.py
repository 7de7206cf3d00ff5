"""The compare-and-sum replacements of `cumsum`, `argsort` and small scatters (`pallas_kernels.common`).

Each is checked against the formulation it replaces (NumPy's cumsum and stable
argsort) on random keys with many ties, a padding key shared by a long tail
(as the item table's inactive rows share one), and sizes on both sides of
`COMPARE_ELEMENTS` (past it the helpers fall back to `cumsum` / `argsort`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common

# Both paths: the compare-and-sum (up to 2,048 entries) and the fallback past it.
SIZES = [1, 2, 7, 64, 580, 2048, 2049]


def _keys(rng, n):
  """int32 keys with ties: a few distinct values, some rows sharing a padding key."""
  keys = rng.integers(-4, 4, size=n).astype(np.int32)
  keys[rng.random(n) < 0.3] = 1   # the padding rows' key, interleaved with real ones
  return keys


@pytest.mark.parametrize("n", SIZES)
def test_prefix_sum_is_cumsum(n, rng):
  x = rng.integers(-50, 50, size=n).astype(np.int32)
  np.testing.assert_array_equal(common.prefix_sum(jnp.asarray(x)), np.cumsum(x))
  mask = rng.random(n) < 0.5
  got = common.prefix_sum(jnp.asarray(mask))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.cumsum(mask))


@pytest.mark.parametrize("n", SIZES)
def test_sort_rows_is_a_stable_argsort_gather(n, rng):
  keys = _keys(rng, n)
  rows = rng.integers(0, 1000, size=(n, 3)).astype(np.int32)
  rows[:, 0] = np.arange(n)   # ties must keep their index order
  got = common.sort_rows(jnp.asarray(keys), jnp.asarray(rows))
  np.testing.assert_array_equal(got, rows[np.argsort(keys, kind="stable")])


@pytest.mark.parametrize("n", SIZES)
def test_sorted_prefix_sum_is_sort_cumsum_scatter(n, rng):
  keys = _keys(rng, n)
  values = rng.integers(0, 9, size=n).astype(np.int32)
  values[rng.random(n) < 0.2] = 0   # masked entries add nothing
  order = np.argsort(keys, kind="stable")
  want = np.zeros_like(values)
  want[order] = np.cumsum(values[order])
  np.testing.assert_array_equal(common.sorted_prefix_sum(jnp.asarray(keys), jnp.asarray(values)),
                                want)


@pytest.mark.parametrize("max_elements", [0, 3000 * 3000])
def test_max_elements_moves_the_bound(max_elements, rng):
  """`max_elements` (the attention plan's `PLAN_COMPARE_ELEMENTS`): 0 takes every
  fallback, 3000^2 compares 3,000 entries (past the default bound); same values."""
  n = 3000
  keys = _keys(rng, n)
  values = rng.integers(0, 9, size=n).astype(np.int32)
  rows = np.stack([np.arange(n), values], axis=1).astype(np.int32)
  order = np.argsort(keys, kind="stable")
  want = np.zeros_like(values)
  want[order] = np.cumsum(values[order])
  kw = dict(max_elements=max_elements)
  np.testing.assert_array_equal(common.prefix_sum(jnp.asarray(values), **kw), np.cumsum(values))
  np.testing.assert_array_equal(common.sort_rows(jnp.asarray(keys), jnp.asarray(rows), **kw),
                                rows[order])
  np.testing.assert_array_equal(
      common.sorted_prefix_sum(jnp.asarray(keys), jnp.asarray(values), **kw), want)


def test_compare_paths_are_taken_up_to_the_bound():
  """The sizes above straddle the bound (else the fallback would be all that is tested)."""
  assert 2048 * 2048 <= common.COMPARE_ELEMENTS < 2049 * 2049


def test_prefix_sum_of_rows(rng):
  """Rows are summed independently, in one compare-and-sum or past the bound in `cumsum`."""
  for shape in [(2, 64), (3, 5), (4, 1100)]:
    x = rng.integers(0, 3, size=shape).astype(np.int32)
    np.testing.assert_array_equal(common.prefix_sum(jnp.asarray(x)), np.cumsum(x, axis=-1))


@pytest.mark.parametrize("num_cols,n", [(1, 1), (5, 7), (64, 2048), (9, 580), (2048, 2049),
                                        (65, 2048)])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_per_column_is_a_dropping_scatter_into_zeros(num_cols, n, op, rng):
  """Against a NumPy loop: out-of-range columns (the scratch column, the commit's
  `max_seqs + 1`, negatives) count nowhere, columns without an entry get 0, and
  bools are counted as 0/1. (65, 2048) and (2048, 2049) take the scatter past the bound."""
  cols = rng.integers(-2, num_cols + 2, size=n).astype(np.int32)
  values = rng.integers(0, 3000, size=n).astype(np.int32)
  want = np.zeros((num_cols,), np.int64)
  for c, v in zip(cols, values):
    if 0 <= c < num_cols:
      want[c] = want[c] + v if op == "sum" else max(want[c], v)
  got = common.per_column(jnp.asarray(cols), jnp.asarray(values), num_cols, op=op)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, want)
  mask = rng.random(n) < 0.5
  want = np.zeros((num_cols,), np.int64)
  for c, m in zip(cols, mask):
    if 0 <= c < num_cols:
      want[c] = want[c] + m if op == "sum" else max(want[c], m)
  np.testing.assert_array_equal(
      common.per_column(jnp.asarray(cols), jnp.asarray(mask), num_cols, op=op), want)


def test_per_column_refuses_an_unknown_op():
  with pytest.raises(ValueError, match="op="):
    common.per_column(jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32), 2, op="min")


@pytest.mark.parametrize("n, m", [(1, 1), (100, 37), (2048, 2048), (8192, 8192), (40000, 20000)],
                         ids=str)
def test_searchsorted_right_is_numpys_on_both_sides_of_the_compare_bound(n, m, rng):
  # 8192 x 8192 and 40000 x 20000 pass `searchsorted_right`'s 2^25-pair bound (the
  # sort method); the rest take the one-compare path. Ties and out-of-range queries.
  values = np.sort(rng.integers(0, max(1, n // 3), size=n)).astype(np.int32)
  queries = rng.integers(-2, n // 3 + 2, size=m).astype(np.int32)
  got = common.searchsorted_right(jnp.asarray(values), jnp.asarray(queries))
  np.testing.assert_array_equal(got, np.searchsorted(values, queries, side="right"))


@pytest.mark.parametrize("size, n", [(1, 1), (64, 100), (2048, 2048), (4152, 4500), (16384, 17664)],
                         ids=str)
def test_searchsorted_iota_is_numpys_on_both_sides_of_the_compare_bound(size, n, rng,
                                                                         monkeypatch):
  # Up to (2048, 2048) every pair is compared; the larger ones pass SEARCH_COMPARE_PAIRS
  # (the scatter and running max). Ties, values below 0 (they count for every query),
  # values at or past `n` (for none) and the int32 maximum of padded segment starts.
  assert 2048 * 2048 <= common.SEARCH_COMPARE_PAIRS < 4152 * 4500
  values = rng.integers(-3, n + 4, size=size).astype(np.int32)
  values[rng.random(size) < 0.1] = np.iinfo(np.int32).max
  values = np.sort(values)
  want = np.searchsorted(values, np.arange(n), side="right")
  for bound in (common.SEARCH_COMPARE_PAIRS, 0):   # as configured; linear at every size
    monkeypatch.setattr(common, "SEARCH_COMPARE_PAIRS", bound)
    got = common.searchsorted_iota(jnp.asarray(values), n)
    assert got.dtype == jnp.int32 and got.shape == (n,)
    np.testing.assert_array_equal(got, want)
