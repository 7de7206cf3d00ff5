"""The page bookkeeping of `prepare_step` and `rewind` (CONTRACT §3.1) against a NumPy model.

`prepare_step` only looks at a window of table slots from each column's first write
slot (jaxkv/_pages.py); the model here re-derives the contract's rules over the whole
table with Python loops and no jaxkv code: each live column holds exactly the slots up
to the end of its step tokens, new pages are the lowest free ones in row-major order
of the table, and a step never copies a page; a rewind that ends inside a page
another column holds gives the rewound column the lowest free page for it (copy on
write). Random verb sequences (wide steps crossing several pages, abandoned steps,
forks, rewinds into shared pages, removals) compare the two after every prepare and
every rewind, check the page invariants after every verb, and check every attention
output against the oracle over NaN-poisoned free pages.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drivers import check_page_invariants
from drivers import floors
import jaxkv
import pallas_kernels.common
from scenario_utils import Harness
from scenario_utils import default_config

pure = jaxkv.pure
P = 3


def small_config(**overrides):
  kwargs = dict(layers=[jaxkv.LayerPolicy.flat(), jaxkv.LayerPolicy.ring(12)], capacity=60,
                max_seqs=6, max_write=8, kv_dtype=jnp.float32, page_size=P)
  kwargs.update(overrides)
  return default_config(**kwargs)


def model_prepare(config, state, step_ends):
  """`(table, refs)` the contract's rule gives for a step ending at `step_ends[c]` per column."""
  table = np.asarray(state.page_table).copy()
  refs = np.asarray(state.page_refs).copy()
  live, pos = np.asarray(state.live), np.asarray(state.pos)
  scratch, size = config.scratch_page, config.page_size
  missing = []
  for c in range(config.max_seqs):
    extent = max(int(pos[c]), step_ends.get(c, 0)) if live[c] else 0
    need = -(-extent // size)
    for j in range(table.shape[1]):
      page = table[c, j]
      if page != scratch and j >= need:
        refs[page] -= 1
        table[c, j] = scratch
    missing += [(c, j) for j in range(need) if table[c, j] == scratch]
  free = [p for p in range(config.num_pages - 1) if refs[p] == 0]
  assert len(missing) <= len(free)
  for (c, j), page in zip(sorted(missing), free):
    table[c, j] = page
    refs[page] += 1
  return table, refs


def model_rewind(config, state, s, position):
  """`(table, refs)` the contract's rule gives for `rewind(s, position)` (accepted).

  Every live column keeps `ceil(pos / P)` slots (`s`: `ceil(position / P)`); when
  `position` ends inside a page that another column also holds, `s` takes the lowest
  free page for that slot and the shared page loses `s`'s reference.
  """
  table = np.asarray(state.page_table).copy()
  refs = np.asarray(state.page_refs).copy()
  live, pos = np.asarray(state.live), np.asarray(state.pos)
  scratch, size = config.scratch_page, config.page_size
  for c in range(config.max_seqs):
    keep = -(-(position if c == s else int(pos[c]) if live[c] else 0) // size)
    for j in range(keep, table.shape[1]):
      if table[c, j] != scratch:
        refs[table[c, j]] -= 1
        table[c, j] = scratch
  slot = position // size
  if position % size and refs[table[s, slot]] > 1:
    page = min(p for p in range(config.num_pages - 1) if refs[p] == 0)
    refs[table[s, slot]] -= 1
    table[s, slot] = page
    refs[page] += 1
  return table, refs


def rewind_checked(h, s, position) -> bool:
  """`h.rewind(s, position)`, checking the pages against the model when accepted;
  returns whether it copied a page (ended inside a shared page)."""
  state, size = h.cache.state, h.config.page_size
  want = model_rewind(h.config, state, s, position)
  shared = (position % size != 0 and
            np.asarray(state.page_refs)[np.asarray(state.page_table)[s, position // size]] > 1)
  assert h.rewind(s, position)
  np.testing.assert_array_equal(np.asarray(h.cache.state.page_table), want[0])
  np.testing.assert_array_equal(np.asarray(h.cache.state.page_refs), want[1])
  return bool(shared)


def step_ends_of(state, ids) -> dict[int, int]:
  pos = np.asarray(state.pos)
  ends = {}
  for s in ids:
    ends[s] = ends.get(s, int(pos[s])) + 1
  return ends


def prepare_checked(h, ids) -> None:
  """Declares and prepares `ids` (not committed), checking the pages against the model."""
  cache = h.cache
  want = model_prepare(h.config, cache.state, step_ends_of(cache.state, ids))
  assert cache.declare_step(ids)
  cache.prepare_step()
  np.testing.assert_array_equal(np.asarray(cache.state.page_table), want[0])
  np.testing.assert_array_equal(np.asarray(cache.state.page_refs), want[1])


def random_ids(rng, live, room, width) -> list[int]:
  """A step of up to `width` tokens (at most `room`) over a few live columns, spans mixed."""
  n = int(rng.integers(1, min(width, room) + 1))
  cols = rng.choice(live, size=min(len(live), int(rng.integers(1, 3))), replace=False)
  ids = [int(c) for c in rng.choice(cols, size=n)]
  return sorted(ids, key=lambda s: (s, rng.random()))[::-1] if rng.random() < 0.5 else ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_verbs_match_the_whole_table_model(seed):
  run_random_verbs(seed, small_config(), steps=60)


def test_the_cumsum_rank_path_matches_the_model_too(monkeypatch):
  """Wide windows rank their new pages with a cumsum instead of compare-and-sum (past
  `pallas_kernels.common.COMPARE_ELEMENTS`); forced here on a config of its own (so it is traced afresh with the lowered threshold)."""
  monkeypatch.setattr(pallas_kernels.common, "COMPARE_ELEMENTS", 0)   # `prefix_sum`'s bound
  run_random_verbs(3, small_config(capacity=57), steps=40)


def run_random_verbs(seed, config, *, steps):
  rng = np.random.default_rng(seed)
  h = Harness(config, driver="pure-poisoned")
  width, capacity = h.config.max_write, h.config.capacity
  seen = {"cow": 0, "multi": 0, "abandoned": 0}
  for _ in range(steps):
    state = h.cache.state
    live = [int(c) for c in np.nonzero(np.asarray(state.live))[0]]
    room = capacity - int(np.asarray(state.held))
    action = rng.choice(["step"] * 5 + ["abandon", "new", "clone", "clone", "rewind", "rm"])
    if action == "new" or not live:
      if len(live) < h.config.max_seqs:
        h.new()
    elif action in ("step", "abandon") and room > 0:
      ids = random_ids(rng, live, room, width)
      ends = step_ends_of(state, ids)
      pos = np.asarray(state.pos)
      seen["multi"] += any(-(-e // P) - int(pos[c]) // P > 1 for c, e in ends.items())
      prepare_checked(h, ids)
      if action == "abandon":
        seen["abandoned"] += 1
        check_page_invariants(h.config, h.cache.state)
        continue                      # the next verb gives the step's pages back
      h.step(ids)                     # prepares again (a no-op) ... and checks every output
    elif action == "clone" and len(live) < h.config.max_seqs:
      src = int(rng.choice(live))
      low = max(1, floors(h.config, state)[src])   # a wrapped ring layer raises the floor
      if low <= h.pos(src) and room >= low:
        keep = int(rng.integers(low, min(h.pos(src), room) + 1))
        dst = h.clone(src, keep)
        if dst is not None and keep // P * P > low:
          # Into a shared full page (copy on write when it ends inside it), then write.
          s = int(rng.choice([src, dst]))
          seen["cow"] += rewind_checked(h, s, int(rng.integers(low, keep // P * P)))
          room = capacity - int(np.asarray(h.cache.state.held))
          ids = [s] * int(rng.integers(1, min(width, room) + 1))
          prepare_checked(h, ids)
          h.step(ids)
    elif action == "rewind":
      s = int(rng.choice(live))
      seen["cow"] += rewind_checked(h, s, int(rng.integers(floors(h.config, state)[s],
                                                           h.pos(s) + 1)))
    elif action == "rm":
      h.rm(int(rng.choice(live)))
    check_page_invariants(h.config, h.cache.state)
  assert seen["multi"] > 0 and seen["abandoned"] > 0 and seen["cow"] > 0, seen


def test_a_wide_step_takes_several_pages_per_column_and_an_abandoned_one_gives_them_back():
  """W = 8 over pages of 3: one step takes three new pages for one column and two for
  another; a narrower step declared over the abandoned one keeps only what it needs."""
  h = Harness(small_config(), driver="pure-poisoned")
  a, b = h.new(), h.new()
  h.step([a, b])                                # pos 1 each: one page each
  prepare_checked(h, [a] * 6 + [b] * 2)         # a: positions 1..6 -> slots 0..2; b: 1..2 -> 0
  table = np.asarray(h.cache.state.page_table)
  assert (table[a, :3] != h.config.scratch_page).all()
  prepare_checked(h, [b] * 5 + [a])             # abandoned: a back to 1 slot, b to 2 slots
  table = np.asarray(h.cache.state.page_table)
  assert (table[a, 1:] == h.config.scratch_page).all()
  assert (table[b, :2] != h.config.scratch_page).all()
  h.step([b] * 5 + [a])                         # the same step, attended and checked
  check_page_invariants(h.config, h.cache.state)


def test_two_sharers_rewound_into_one_page():
  """a and its fork b share pages 0 and 1; both rewind into page 1 and write in one step.
  The first rewind copies (the page is still shared), the second finds itself its last
  holder and keeps it; both read their own rows, over NaN-poisoned free pages."""
  h = Harness(small_config(), driver="pure-poisoned")
  a = h.new()
  h.step([a] * 7)                               # pos 7: slots 0..2
  b = h.clone(a, 6)                             # shares slots 0 and 1, copies nothing
  shared = int(np.asarray(h.cache.state.page_table)[a, 1])
  assert rewind_checked(h, a, 4)                # a copies slot 1: the shared page keeps b only
  assert not rewind_checked(h, b, 5)            # b's slot 1 is its own now: nothing copied
  assert np.asarray(h.cache.state.page_refs)[shared] == 1
  assert np.asarray(h.cache.state.page_table)[b, 1] == shared
  prepare_checked(h, [a, b, b])
  table = np.asarray(h.cache.state.page_table)
  assert table[a, 1] != table[b, 1] and table[a, 0] == table[b, 0]
  h.step([a, b, b])
  h.step([b, a])
  check_page_invariants(h.config, h.cache.state)


def test_prepare_step_touches_no_whole_page_table():
  """Compiled, the paged `prepare_step` produces one array as large as the page table,
  the in-place scatter of its window; no other instruction is
  `[max_seqs, M]`-sized or larger, and none is a cumsum's reduce-window over the pool."""
  config = small_config(capacity=600, max_seqs=6, max_write=16, page_size=8,
                        layers=[jaxkv.LayerPolicy.flat()])
  state = jax.eval_shape(lambda: jaxkv.init_state(config))
  text = jax.jit(pure.prepare_step, static_argnums=0, donate_argnums=1).lower(
      config, state).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  big, pool_scans = [], []
  table_size = config.max_seqs * config.max_pages_per_seq
  for line in entry.splitlines():
    match = re.match(r"\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\w+)\[([\d,]*)\]\S*\s([\w\-]+)\(", line)
    if not match or match[3] in ("parameter", "get-tuple-element", "tuple", "bitcast"):
      continue
    size = int(np.prod([int(d) for d in match[2].split(",") if d] or [1]))
    if size >= table_size and match[2] != f"{config.num_pages},{config.page_size},2,8":
      big.append(line.strip()[:120])
    if "reduce-window" in line and str(config.num_pages) in match[2]:
      pool_scans.append(line.strip()[:120])
  assert len(big) == 1 and "scatter" in big[0], big
  assert not pool_scans, pool_scans


def test_a_one_row_page_step_takes_a_page_per_token():
  """Pages of one row under W = 8 (the window is then W + 1 slots wide): every token of a
  step takes its own page, lowest first, as the whole-table model says."""
  h = Harness(small_config(page_size=1, capacity=24), driver="pure-poisoned")
  a, b = h.new(), h.new()
  prepare_checked(h, [a] * 5 + [b] * 3)
  h.step([a] * 5 + [b] * 3)
  b2 = h.clone(b, 2)
  assert not rewind_checked(h, b, 1)            # pages of one row: never ends inside one
  prepare_checked(h, [b, b, b2, a])
  h.step([b, b, b2, a])
  check_page_invariants(h.config, h.cache.state)
