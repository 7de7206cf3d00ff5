"""Paged storage (CONTRACT §3.1, issue 13): config, page life cycle, refusals, poison, references.

Every contract scenario also runs with paged storage (the `storage` fixture of
conftest); this file covers what only paged storage has: the pool geometry, which
pages a verb takes, shares, copies and releases, that refusals leave the page
table and reference counts bitwise unchanged, the NaN poison of pages nobody
owns, the paged references against the column ones, and the donated loop.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drivers import check_page_invariants
from drivers import kept_page_rows
from drivers import poison_free_storage
import jaxkv
import pallas_kernels
from scenario_utils import Harness
from scenario_utils import assert_same_state
from scenario_utils import default_config
from scenario_utils import snapshot
from scenario_utils import stored_rows

pure = jaxkv.pure
FLAT = jaxkv.LayerPolicy.flat()
P = 3


def paged_config(**overrides):
  kwargs = dict(layers=[FLAT, jaxkv.LayerPolicy.ring(2)], capacity=16, max_seqs=3, max_write=4,
                kv_dtype=jnp.float32, page_size=P)
  kwargs.update(overrides)
  return default_config(**kwargs)


def pages_of(state, col) -> list[int]:
  table = np.asarray(state.page_table)
  scratch = state.page_refs.shape[0] - 1
  return [int(p) for p in table[col] if p != scratch]


def refs(state) -> np.ndarray:
  return np.asarray(state.page_refs)


# --------------------------------------------------------------------------- config


def test_page_size_is_validated_and_sizes_the_pool():
  config = paged_config()
  assert (config.max_pages_per_seq, config.num_pages) == (6, 6 + 3 + 1)   # ceil(16/3) + S + 1
  assert config.layer_shape(0, 999) == (10, P, 2, 8)          # flat: the pool, rows ignored
  assert config.layer_shape(1, 999) == (min(16, 2 + 4 - 1), 4, 2, 8)   # ring: columns
  for bad in ("3", 3.0, True, jnp.int32(3)):
    with pytest.raises(TypeError, match="page_size"):
      paged_config(page_size=bad)
  for bad in (0, -1, 17):
    with pytest.raises(ValueError, match="page_size"):
      paged_config(page_size=bad)
  with pytest.raises(ValueError, match="page_size=2 needs a flat layer"):
    default_config(layers=[jaxkv.LayerPolicy.ring(2)], page_size=2)
  assert paged_config(page_size=16).num_pages == 1 + 3 + 1
  assert default_config(page_size=None).num_pages == 0


def test_initial_capacity_is_ignored_and_the_pool_never_grows():
  small, large = paged_config(initial_capacity=1), paged_config(initial_capacity=16)
  shapes = [jax.eval_shape(lambda c=c: jaxkv.init_state(c)) for c in (small, large)]
  assert [x.shape for x in shapes[0].k] == [x.shape for x in shapes[1].k]
  state = jaxkv.init_state(small)
  assert np.all(np.asarray(state.page_table) == small.scratch_page)
  assert state.page_table.shape == (4, 6) and not np.any(refs(state))
  with pytest.raises(ValueError, match="page_size"):
    pure.grow(small, state, 8)


def test_implementation_plan_serves_paged_layers_with_the_paged_kernels(monkeypatch):
  """On a Hopper default the plan runs the paged kernels' own checks: a page size that is a
  multiple of a compiled K/V tile, or a multiple of 8 dividing one, is served; any other
  falls back, with the reason."""
  implementation_module = jaxkv._implementation   # pylint: disable=protected-access
  monkeypatch.setattr(implementation_module, "default_implementation", lambda: "mosaic_gpu")
  layers = [jaxkv.LayerConfig(FLAT, 2, 128), jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(8), 2, 128)]
  config = jaxkv.CacheConfig(layers, capacity=512, max_seqs=2, max_write=4,
                             kv_dtype=jnp.bfloat16, page_size=64)
  plan = jaxkv.implementation_plan(config, 8)
  assert [p.implementation for p in plan] == ["mosaic_gpu", "mosaic_gpu"]
  assert "page table" in plan[0].reason and "page table" not in plan[1].reason
  plan = jaxkv.implementation_plan(dataclasses.replace(config, page_size=32), 8)
  assert [p.implementation for p in plan] == ["mosaic_gpu", "mosaic_gpu"]   # 2 pages a tile
  plan = jaxkv.implementation_plan(dataclasses.replace(config, page_size=48), 8)
  assert plan[0].implementation == "reference" and plan[1].implementation == "mosaic_gpu"
  assert re.search(r"page_size=48 is served by no K/V tile", plan[0].reason)


def test_explicit_kernels_refuse_a_page_size_no_tile_serves():
  """The compiled kernels' refusal reaches an explicit `implementation="mosaic_gpu"` (CONTRACT
  §10.7); checked on shapes, so it runs on any machine."""
  q = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=r"page_size=96 is served by no K/V tile"):
    pallas_kernels.check_paged(q, jax.ShapeDtypeStruct((9, 96, 2, 128), jnp.bfloat16))
  pallas_kernels.check_paged(q, jax.ShapeDtypeStruct((9, 128, 2, 128), jnp.bfloat16))
  pallas_kernels.check_paged(q, jax.ShapeDtypeStruct((9, 16, 2, 128), jnp.bfloat16))
  # The interpreter shrinks its tile to divide any page size.
  pallas_kernels.check_paged(q, jax.ShapeDtypeStruct((9, 7, 2, 128), jnp.bfloat16),
                             interpret=True)


# --------------------------------------------------------------------------- life cycle


def test_pages_follow_the_verbs():
  """Allocation, sharing, copy on write and release, with the oracle checking every step
  and every page nobody owns NaN-poisoned before each step."""
  h = Harness(paged_config(capacity=24), driver="pure-poisoned")
  a = h.new()
  h.step([a] * 4)
  h.step([a] * 3)                                   # pos 7: slots 0..2
  state = h.cache.state
  assert len(pages_of(state, a)) == 3 and refs(state).sum() == 3

  b = h.clone(a, 5)                                 # shares slot 0, copies partial slot 1
  state = h.cache.state
  assert pages_of(state, b)[0] == pages_of(state, a)[0]
  assert pages_of(state, b)[1] not in pages_of(state, a)
  assert refs(state)[pages_of(state, a)[0]] == 2 and refs(state).sum() == 5
  for got, want in zip(stored_rows(state, h.config, 0, b, range(5)),
                       stored_rows(state, h.config, 0, a, range(5))):
    assert got.tobytes() == want.tobytes()           # the copied rows, bitwise
  check_page_invariants(h.config, state)

  c = h.clone(a, 6)                                 # a page boundary: nothing copied
  state = h.cache.state
  assert pages_of(state, c) == pages_of(state, a)[:2] and refs(state).sum() == 7
  a_rows = [x.copy() for x in stored_rows(state, h.config, 0, a, range(7))]

  assert h.rewind(c, 4)                             # into the shared slot 1: copy on write
  state = h.cache.state
  assert pages_of(state, c)[0] == pages_of(state, a)[0]
  assert pages_of(state, c)[1] not in pages_of(state, a) + pages_of(state, b)
  assert refs(state)[pages_of(state, a)[1]] == 1 and refs(state).sum() == 7
  assert (stored_rows(state, h.config, 0, c, [3])[0].tobytes()
          == a_rows[0][3:4].tobytes())                # the copied row came along, bitwise
  check_page_invariants(h.config, state)
  table = np.asarray(state.page_table).copy()
  h.step([c, c])                                    # writes c's own page: nothing copied
  state = h.cache.state
  assert np.array_equal(np.asarray(state.page_table)[c, :2], table[c, :2])
  for got, want in zip(stored_rows(state, h.config, 0, a, range(7)), a_rows):
    assert got.tobytes() == want.tobytes()           # the source is untouched

  shared = pages_of(state, a)[0]
  assert h.rm(a)
  state = h.cache.state
  assert refs(state)[shared] == 2 and len(np.nonzero(refs(state))[0]) == 3   # b, c: slots 0 and 1
  h.step([b, c, b])
  assert h.rm(b) and h.rm(c)
  assert not np.any(refs(h.cache.state))
  assert np.all(np.asarray(h.cache.state.page_table) == h.config.scratch_page)


def test_abandoned_step_pages_are_released_by_the_next_verb():
  """A prepared step that is never committed took pages; the next verb gives them back."""
  h = Harness(paged_config(max_write=8), driver="pure-poisoned")
  a, b = h.new(), h.new()
  h.step([a] * 2)
  cache = h.cache
  assert cache.declare_step([a] * 8)
  cache.prepare_step()
  assert len(pages_of(cache.state, a)) == 4         # positions 2..9 need slots 0..3
  assert h.rewind(b, 0)                              # invalidates the step
  assert len(pages_of(cache.state, a)) == 1
  check_page_invariants(h.config, cache.state)
  h.step([a, b])


def test_refusals_leave_page_tables_and_counts_unchanged():
  config = paged_config(capacity=9, max_seqs=2)
  h = Harness(config)
  cache = h.cache
  a = h.new()
  h.step([a] * 4)
  h.step([a] * 3)
  for refused in (lambda: cache.seq_clone(a, 8 - 9),            # EMPTY
                  lambda: cache.seq_clone(a),                    # NO_ROOM: 7 + 7 > 9
                  lambda: cache.rewind(a, 8),                    # BAD_TARGET
                  lambda: cache.seq_rm(1),                       # NOT_LIVE
                  lambda: cache.declare_step([a] * 3)):          # NO_ROOM
    before = snapshot(cache.state)
    assert refused() in (None, False)
    assert_same_state(before, snapshot(cache.state))
  b = h.clone(a, 2)
  before = snapshot(cache.state)
  assert cache.seq_clone(a, 1) is None                          # NO_FREE_ID
  assert_same_state(before, snapshot(cache.state))
  del b


def _exhausted(config, state):
  """`state` with every free page marked used: a state no verb produces, which makes
  the defensive out-of-pages refusal reachable."""
  scratch = config.scratch_page
  counts = np.asarray(state.page_refs).copy()
  counts[:scratch] = np.maximum(counts[:scratch], 1)
  return dataclasses.replace(state, page_refs=jnp.asarray(counts))


def test_running_out_of_pages_refuses_and_changes_nothing():
  config = paged_config()
  state = jaxkv.init_state(config)
  state, _, a = pure.seq_new(config, state)
  state, _ = pure.declare_step(config, state, jnp.full((4,), a, jnp.int32), 2,
                               jnp.zeros((4, 2), jnp.int32))
  state = _exhausted(config, state)
  before = snapshot(state)
  state, status = jax.jit(pure.prepare_step, static_argnums=0)(config, state)
  assert jaxkv.Status(int(status)) == jaxkv.Status.NO_ROOM
  assert_same_state(before, snapshot(state))


# --------------------------------------------------------------------------- poison


def test_poison_covers_every_page_row_nobody_keeps():
  h = Harness(paged_config(), driver="pure-poisoned")
  a = h.new()
  h.step([a] * 4)
  h.step([a] * 2)                                   # pos 6: two full pages
  b = h.clone(a)
  assert h.rewind(b, 4)                              # b keeps 1 row of slot 1, in its own copy
  state = h.cache.state
  keep = kept_page_rows(state, h.config)
  assert keep[pages_of(state, a)].all()              # a's two full pages (one shared with b)
  copied = pages_of(state, b)[1]
  assert copied not in pages_of(state, a) and keep[copied].tolist() == [True, False, False]
  assert keep.sum() == 7 and not keep[h.config.scratch_page].any()
  poisoned = poison_free_storage(state, h.config)
  pool = np.asarray(poisoned.k[0])
  assert np.all(np.isnan(pool[~keep])) and not np.any(np.isnan(pool[keep]))
  h.step([b, a])                                     # still exact after the poison


# --------------------------------------------------------------------------- references


def test_paged_references_match_the_column_references(rng):
  """The same logical K/V in columns and in shuffled pages (NaN elsewhere) attend alike."""
  cols, size, heads, dim, lengths = 3, 4, 2, 8, [7, 12, 1]
  slots = 3
  num_pages = cols * slots + 1
  order = rng.permutation(num_pages - 1)
  table = np.full((cols + 1, slots), num_pages - 1, np.int32)
  k_cols = np.full((slots * size, cols + 1, heads, dim), np.nan, np.float32)
  v_cols = k_cols.copy()
  pool_k = np.full((num_pages, size, heads, dim), np.nan, np.float32)
  pool_v = pool_k.copy()
  for c, n in enumerate(lengths):
    for j in range(-(-n // size)):
      table[c, j] = order[c * slots + j]
    for p in range(n):
      k, v = rng.standard_normal((2, heads, dim), dtype=np.float32)
      k_cols[p, c], v_cols[p, c] = k, v
      pool_k[table[c, p // size], p % size], pool_v[table[c, p // size], p % size] = k, v
  # A step: the last 2 tokens of column 1 (already written) and 1 new token of column 0.
  width = 4
  q = jnp.asarray(rng.standard_normal((width, 4, dim), dtype=np.float32))
  info = np.array([[0, 2, 1, 10, 0], [2, 1, 0, 6, 0], [3, 0, cols, 0, 0], [3, 0, cols, 0, 0]],
                  np.int32)
  new_k, new_v = (jnp.asarray(rng.standard_normal((width, heads, dim), dtype=np.float32))
                  for _ in range(2))
  seq_cols = jnp.asarray([1, 1, 0, cols], jnp.int32)
  rows = jnp.asarray([10, 11, 6, 0], jnp.int32)
  kc, vc = pallas_kernels.kv_write_reference(jnp.asarray(k_cols), jnp.asarray(v_cols), new_k,
                                             new_v, seq_cols, rows, jnp.int32(3))
  kp, vp = pallas_kernels.paged_kv_write_reference(jnp.asarray(pool_k), jnp.asarray(pool_v),
                                                   new_k, new_v, seq_cols, rows, jnp.int32(3),
                                                   jnp.asarray(table))
  for t in range(3):
    page, off = table[int(seq_cols[t]), int(rows[t]) // size], int(rows[t]) % size
    assert np.asarray(kp)[page, off].tobytes() == np.asarray(kc)[int(rows[t]), int(seq_cols[t])].tobytes()
  assert np.all(np.isnan(np.asarray(kp)[num_pages - 1]))   # padding wrote nothing
  kwargs = dict(window=None, scale=0.3)
  want = pallas_kernels.varlen_attention_reference(q, kc, vc, jnp.asarray(info), jnp.int32(2),
                                                   **kwargs)
  got = pallas_kernels.paged_varlen_attention_reference(q, kp, vp, jnp.asarray(table),
                                                        jnp.asarray(info), jnp.int32(2), **kwargs)
  assert np.all(np.isfinite(np.asarray(got)[:3]))
  np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match="flat layers only"):
    pallas_kernels.paged_varlen_attention_reference(q, kp, vp, jnp.asarray(table),
                                                    jnp.asarray(info), jnp.int32(2),
                                                    window=2, scale=0.3)


# --------------------------------------------------------------------------- donation


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s(?P<op>[\w\-]+)\(")
_ARRAY_SHAPE = re.compile(r"\b\w+\[([\d,]*)\]")


def _copies_of(hlo_text: str, shapes) -> list[str]:
  """HLO `copy`/`copy-start` lines whose result has one of `shapes`."""
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match and match["op"] in ("copy", "copy-start"):
      if any(tuple(int(d) for d in dims.split(",") if d) in shapes
             for dims in _ARRAY_SHAPE.findall(match["shape"])):
        found.append(line.strip())
  return found


def test_paged_jitted_loop_updates_the_pool_in_place():
  """A donated jitted loop (clone, rewind into a shared page with its copy on write, decode,
  removal) copies no K/V-shaped array and aliases every K/V byte."""
  config = paged_config(kv_dtype=jnp.bfloat16)
  width = config.max_write

  def loop(config, state, q, k, v):
    state, _, a = pure.seq_new(config, state)
    ids = jnp.full((width,), a, jnp.int32)
    no_blocks = jnp.zeros((width, 2), jnp.int32)

    def step(state, ids, n):
      state, _ = pure.declare_step(config, state, ids, n, no_blocks)
      state, _ = pure.prepare_step(config, state)
      for layer in range(config.num_layers):
        state, _, _ = pure.attend(config, state, layer, q, k, v, implementation="reference")
      state, _ = pure.commit_step(config, state)
      return state

    state = step(state, ids, 4)
    state, _, b = pure.seq_clone(config, state, a)
    state, _ = pure.rewind(config, state, b, 2)
    decode = jnp.full((width,), config.max_seqs, jnp.int32).at[0].set(b).at[1].set(a)
    state = jax.lax.fori_loop(0, 3, lambda _, s: step(s, decode, 2), state)
    state, _ = pure.seq_rm(config, state, a)
    return state

  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((width, h, 8), dtype=np.float32))
             for h in (4, 2, 2))
  state = jaxkv.init_state(config)
  kv_shapes = {tuple(x.shape) for x in state.k}
  kv_bytes = sum(x.nbytes for x in state.k + state.v)
  jitted = jax.jit(loop, static_argnums=0, donate_argnums=1)
  compiled = jitted.lower(config, jax.tree.map(jnp.copy, state), q, k, v).compile()
  assert not _copies_of(compiled.as_text(), kv_shapes)
  assert compiled.memory_analysis().alias_size_in_bytes >= kv_bytes
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = jax.block_until_ready(jitted(config, state, q, k, v))
  assert not [w for w in caught if "donated" in str(w.message)]
  check_page_invariants(config, out)
  assert np.asarray(out.pos)[:2].tolist() == [0, 5] and np.asarray(out.live)[:2].tolist() == [0, 1]


def test_the_page_life_cycle_through_each_implementation(implementation):
  """Prefill across a page boundary, a fork sharing a full page, copy on write after a rewind
  into it and a removal, served by each implementation over NaN-poisoned free storage; the
  oracle checks every output. The compiled kernels get page 64 (bf16, head_dim 128, K/V
  tiles of 64); the CPU variants run the same script with page 8."""
  p = 64 if implementation == "mosaic_gpu" else 8
  layers = [jaxkv.LayerConfig(FLAT, 2, 128),
            jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(4), 2, 128)]
  config = default_config(layers=layers, capacity=3 * p, max_seqs=3, max_write=8,
                          kv_dtype=jnp.bfloat16, page_size=p)
  h = Harness(config, implementation=implementation, n_q_heads=4, driver="pure-poisoned")
  a = h.new()
  for _ in range(p // 8):
    h.step([a] * 8)
  h.step([a] * 3)                                   # pos p + 3: into page slot 1
  b = h.clone(a, p)                                 # shares slot 0, copies nothing
  assert pages_of(h.cache.state, b) == pages_of(h.cache.state, a)[:1]
  h.step([a, a, b, b, b])
  assert h.rewind(b, p - 2)                         # into the shared slot 0: b copies it
  assert pages_of(h.cache.state, b)[0] != pages_of(h.cache.state, a)[0]   # copy on write
  h.step([b, a, b])
  assert h.rm(a)
  h.step([b] * 8)
  check_page_invariants(h.config, h.cache.state)
