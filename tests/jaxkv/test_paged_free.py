"""The free list of `prepare_step` without a sort (`_pages.lowest_free`), against NumPy.

`plan_step_pages` hands a step's takes the lowest free pages in row-major order;
`lowest_free` finds them by bit-counted ranks and one scatter instead of sorting the
pool. The oracle here sorts: the ids of the pages with count 0 (the scratch page
never), in increasing order, cut or padded with `num_pages` to the length asked.
Pools of many sizes (below, at and above one 32-page word, not multiples of it)
with empty, full, one-free and random count vectors, and lengths below and above
the number of free pages. `step_takes` is checked against the most takes a step of
random token counts can need, counted page by page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import _pages


def config_with(capacity, max_seqs, page_size, max_write=8):
  max_write = min(max_write, capacity)   # a step carries at most capacity tokens
  layer = jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), 1, 8)
  return jaxkv.CacheConfig([layer], capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                           kv_dtype=jnp.float32, page_size=page_size)


def oracle(refs: np.ndarray, scratch: int, length: int) -> np.ndarray:
  free = [p for p in range(len(refs)) if refs[p] == 0 and p != scratch]
  free = sorted(free)[:length]
  return np.asarray(free + [len(refs)] * (length - len(free)), np.int32)


def ref_vectors(num_pages: int, scratch: int, rng) -> list[np.ndarray]:
  """Empty, full, one-free (lowest, highest, middle) and random count vectors."""
  empty = np.zeros(num_pages, np.int32)
  full = np.ones(num_pages, np.int32)
  full[scratch] = 0
  out = [empty, full]
  for p in {0, scratch - 1, (scratch - 1) // 2}:
    one = full.copy()
    one[p] = 0
    out.append(one)
  for density in (0.02, 0.5, 0.98):
    refs = (rng.random(num_pages) >= density).astype(np.int32) * rng.integers(1, 4, num_pages)
    refs[scratch] = 0
    out.append(refs.astype(np.int32))
  return out


# (capacity, max_seqs, page_size): num_pages = ceil(capacity / P) + max_seqs + 1.
POOLS = [(1, 1, 1),          # 3 pages: one usable besides the one-per-sequence spare
         (29, 2, 1),         # 32: exactly one word
         (30, 2, 1),         # 33: one word and one page
         (100, 6, 3),        # 41
         (4000, 64, 32),     # 190
         (155_000, 64, 32),  # 4,909: the pages-of-32 pool of the profiled mix
         (70_000, 1, 1)]     # 70,002: past 2**16 pages, word offsets by cumsum


@pytest.mark.parametrize("capacity,max_seqs,page_size", POOLS)
def test_lowest_free_equals_the_sorted_free_pages(capacity, max_seqs, page_size):
  config = config_with(capacity, max_seqs, page_size)
  n, scratch = config.num_pages, config.scratch_page
  rng = np.random.default_rng(n)
  lengths = sorted({1, 2, max(1, n // 3), n - 1 if n > 1 else 1, n, n + 5})
  fns = {length: jax.jit(lambda refs, length=length: _pages.lowest_free(config, refs, length))
         for length in lengths}
  for refs in ref_vectors(n, scratch, rng):
    for length, fn in fns.items():
      got = np.asarray(fn(jnp.asarray(refs)))
      np.testing.assert_array_equal(got, oracle(refs, scratch, length),
                                    err_msg=f"num_pages={n} length={length}")


def most_takes(config, rng, trials: int) -> int:
  """The most pages a step took in `trials` random splits of up to `W` tokens over columns.

  Page by page: a column at `pos` holding its `ceil(pos / P)` slots takes the
  slots it lacks up to `ceil((pos + n) / P)`. Positions are mostly page-aligned
  (a column at a page start takes a page for its first token), the worst case.
  """
  s, w, p = config.max_seqs, config.step_width, config.page_size
  best = 0
  for _ in range(trials):
    m = int(rng.integers(1, min(s, w) + 1))
    total = int(rng.integers(m, w + 1))
    cuts = np.sort(rng.choice(np.arange(1, total), size=m - 1, replace=False)) if m > 1 else []
    counts = np.diff(np.concatenate([[0], cuts, [total]]).astype(int))
    takes = 0
    for n in counts:
      pos = int(rng.integers(0, 4)) * p + (0 if rng.random() < 0.7 else int(rng.integers(p)))
      takes += -(-(pos + int(n)) // p) - -(-pos // p)
    best = max(best, takes)
  return best


@pytest.mark.parametrize("max_seqs,max_write,page_size", [(4, 8, 3), (6, 8, 1), (8, 64, 8),
                                                         (64, 2048, 128), (3, 16, 16)])
def test_step_takes_bounds_every_step(max_seqs, max_write, page_size):
  config = config_with(4 * max_write * max_seqs, max_seqs, page_size, max_write=max_write)
  seen = most_takes(config, np.random.default_rng(max_seqs * max_write), 300)
  assert seen <= _pages.step_takes(config)


def test_a_step_taking_the_most_pages_is_accepted():
  """Four columns at position 0, `W` 8, pages of 3: one column carries 5 tokens (2 pages),
  the others 1 each (1 page each): 5 takes, `step_takes`. A shorter free list would refuse."""
  config = config_with(60, 4, 3)
  assert _pages.step_takes(config) == 5
  pure = jaxkv.pure
  state = jaxkv.init_state(config)
  for _ in range(4):
    state, status, _ = pure.seq_new(config, state)
    assert int(status) == int(jaxkv.Status.OK)
  ids = jnp.asarray([0, 0, 0, 0, 0, 1, 2, 3], jnp.int32)
  state, status = pure.declare_step(config, state, ids, jnp.int32(8),
                                    jnp.zeros((8, 2), jnp.int32))
  assert int(status) == int(jaxkv.Status.OK)
  state, status = pure.prepare_step(config, state)
  assert int(status) == int(jaxkv.Status.OK)
  table = np.asarray(state.page_table)
  scratch = config.scratch_page
  want = [[0, 1], [2], [3], [4]]   # lowest free pages in row-major order of the table
  for col, pages in enumerate(want):
    row = table[col]
    np.testing.assert_array_equal(row[:len(pages)], pages)
    assert (row[len(pages):] == scratch).all()
  refs = np.zeros(config.num_pages, np.int32)
  refs[:5] = 1
  np.testing.assert_array_equal(np.asarray(state.page_refs), refs)
