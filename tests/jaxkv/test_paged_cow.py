"""Copy on write at `rewind`, never at a step (CONTRACT §3.1, issue 13).

Every page a sequence holds from its first write slot `pos // P` on is its own, so a
step never writes a shared page and `prepare_step` copies nothing: it has no loop with
a traced trip count (on a GPU the loop reads its predicate back to the host every
step). Only `rewind` can end a sequence inside a shared page, and it copies that page
there. Here: the compiled `prepare_step` has no loop or branch; a rewind into a shared
page copies it and a write after it leaves the sharer's rows alone, with the same
attention outputs as column storage; a rewind that needs a page the pool lacks refuses
with NO_ROOM and changes nothing; and the paged engine's prefix-cache adoption (and
every other verb its loop runs) keeps the invariant.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drivers import check_page_invariants
import hlo_walk
import jaxkv
from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.loop import serve_loop
from jaxkv.serve.state import init_loop_state, pack_queue
from scenario_utils import Harness
from scenario_utils import assert_same_state
from scenario_utils import default_config
from scenario_utils import snapshot
from scenario_utils import stored_rows

pure = jaxkv.pure
FLAT = jaxkv.LayerPolicy.flat()
P = 3


def config_of(page_size=P, **overrides):
  kwargs = dict(layers=[FLAT, jaxkv.LayerPolicy.ring(4), FLAT], capacity=24, max_seqs=3,
                max_write=4, kv_dtype=jnp.float32, page_size=page_size)
  kwargs.update(overrides)
  return default_config(**kwargs)


def pages_of(state, col) -> list[int]:
  scratch = state.page_refs.shape[0] - 1
  return [int(p) for p in np.asarray(state.page_table)[col] if p != scratch]


def test_the_compiled_prepare_step_has_no_loop_and_no_branch():
  """A `while` with a traced trip count or a conditional costs a device-to-host read of its
  predicate on every step on a GPU; the paged `prepare_step` has neither, in its StableHLO
  and after XLA's optimisations (the column one neither)."""
  for page_size in (None, 8):
    config = config_of(page_size, capacity=96, max_seqs=4, max_write=16)
    state = jax.eval_shape(lambda config=config: jaxkv.init_state(config))
    lowered = jax.jit(pure.prepare_step, static_argnums=0, donate_argnums=1).lower(config, state)
    assert not re.findall(r"stablehlo\.(?:while|case|if)\b", lowered.as_text()), page_size
    hlo = lowered.compile().as_text()
    assert not re.findall(r"\s(?:while|conditional)\(", hlo), page_size


def test_a_rewind_into_a_shared_page_copies_it_and_a_write_leaves_the_sharer_alone():
  """a holds 7 positions (pages of 3: slots 0..2); b = clone(a, 6) shares slots 0 and 1.
  rewind(b, 4) ends inside slot 1: b gets a private copy there (the copy holds row 3 of
  the shared page, bitwise) and the shared page keeps a only. Steps that write b's
  positions 4.. and a's 7.. change none of a's rows nor the shared page, and every
  attention output equals a column-storage run of the same verbs and contents."""
  outputs = {}
  for storage, page_size in (("columns", None), ("paged", P)):
    h = Harness(config_of(page_size), driver="pure-poisoned")
    a = h.new()
    h.step([a] * 4)
    h.step([a] * 3)
    b = h.clone(a, 6)
    state = h.cache.state
    if page_size:
      shared = pages_of(state, a)[1]
      assert pages_of(state, b) == pages_of(state, a)[:2]
      a_rows = [x.copy() for layer in (0, 2)
                for x in stored_rows(state, h.config, layer, a, range(7))]
      shared_page = [np.asarray(pool[shared]).copy() for pool in state.k + state.v
                     if pool.ndim == 4 and pool.shape[0] == h.config.num_pages]
    assert h.rewind(b, 4)
    state = h.cache.state
    if page_size:
      copied = pages_of(state, b)[1]
      assert copied not in pages_of(state, a) and pages_of(state, b)[0] == pages_of(state, a)[0]
      refs = np.asarray(state.page_refs)
      assert refs[shared] == 1 and refs[copied] == 1
      for layer in (0, 2):
        got = stored_rows(state, h.config, layer, b, [3])
        want = stored_rows(state, h.config, layer, a, [3])
        assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
      check_page_invariants(h.config, state)
    outputs[storage] = [h.step([b, b, a]), h.step([a, b, b, b]), h.step([b, a])]
    state = h.cache.state
    if page_size:
      assert pages_of(state, a)[1] == shared
      got = [x for layer in (0, 2) for x in stored_rows(state, h.config, layer, a, range(7))]
      assert all(g.tobytes() == w.tobytes() for g, w in zip(got, a_rows))
      pools = [pool for pool in state.k + state.v
               if pool.ndim == 4 and pool.shape[0] == h.config.num_pages]
      assert all(np.asarray(pool[shared]).tobytes() == before.tobytes()
                 for pool, before in zip(pools, shared_page))
  for got, want in zip(outputs["paged"], outputs["columns"]):
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)


def _exhausted(config, state):
  """`state` with every free page marked used: a state no verb produces."""
  counts = np.asarray(state.page_refs).copy()
  counts[:config.scratch_page] = np.maximum(counts[:config.scratch_page], 1)
  return dataclasses.replace(state, page_refs=jnp.asarray(counts))


def test_a_rewind_that_needs_a_page_the_pool_lacks_refuses_with_no_room():
  """With every free page marked used, a rewind ending inside a shared page refuses with
  NO_ROOM, after the other checks, and changes nothing (page table, counts and every pool
  byte). A rewind that needs no copy (to a page boundary, or inside a page its sequence
  holds alone) is accepted, and so is one whose own releases free the page it needs."""
  config = config_of()
  h = Harness(config, driver="pure-poisoned")
  a = h.new()
  h.step([a] * 4)
  h.step([a] * 3)                                   # pos 7: slots 0..2
  b = h.clone(a, 6)                                 # shares slots 0 and 1
  real = h.cache.state
  state = _exhausted(config, real)
  fake = np.asarray(state.page_refs) - np.asarray(real.page_refs)
  rewind = jax.jit(pure.rewind, static_argnums=0)
  for seq_id, position, status in ((b, 4, "NO_ROOM"), (b, 1, "NO_ROOM"),
                                   (b, 7, "BAD_TARGET"), (2, 4, "NOT_LIVE")):
    before = snapshot(state)
    out, got = rewind(config, state, seq_id, position)
    assert jaxkv.Status(int(got)) == jaxkv.Status[status], (seq_id, position)
    assert_same_state(before, snapshot(out))
  for seq_id, position in ((b, 3), (a, 7), (a, 6), (a, 2)):
    out, got = rewind(config, state, seq_id, position)
    assert jaxkv.Status(int(got)) == jaxkv.Status.OK, (seq_id, position)
    check_page_invariants(config, dataclasses.replace(
        out, page_refs=jnp.asarray(np.asarray(out.page_refs) - fake)))
  # rewind(a, 2) freed a's own slot 2 (slot 1 is b's too) and copied slot 0 into it.
  assert pages_of(out, a) == [pages_of(real, a)[2]]
  for layer in (0, 2):
    got = stored_rows(out, config, layer, a, [0, 1])
    want = stored_rows(real, config, layer, a, [0, 1])
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))


MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)


def test_the_paged_engine_keeps_every_write_page_private(monkeypatch):
  """Prefix-cache adoption (`paged_claims.adopt`: `seq_clone(source, m)` with `m` a multiple
  of the page size), forks, retirement's `rewind` to full prompt pages and removals keep
  CONTRACT §3.1's invariants: after every such verb and every commit inside the jitted
  serving loop, a host callback finds no shared page at or past a sequence's `pos // P`.
  Adoption and forks must both have happened."""
  cache = MODEL.cache_config(capacity=160, max_seqs=4, max_write=8)
  model = Decoder(MODEL, dataclasses.replace(cache, page_size=4), rngs=nnx.Rngs(0))
  config = model.cache_config
  failures, seen = [], collections.Counter()

  def checked(name, verb):
    def run(config_, state, *args):
      out = verb(config_, state, *args)

      def check(new_state, status):
        seen[name, int(status) == 0] += 1
        try:
          check_page_invariants(config, new_state)
        except AssertionError as error:   # raised on the host: reported after the run
          failures.append(f"{name}: {error}")
      jax.debug.callback(check, out[0], out[1])
      return out
    return run

  for name in ("seq_clone", "rewind", "seq_rm", "commit_step"):
    monkeypatch.setattr(pure, name, checked(name, getattr(pure, name)))
  rng = np.random.default_rng(7)
  system = tuple(int(t) for t in rng.integers(0, 64, 10))
  requests = [serve.Request(system + tuple(int(t) for t in rng.integers(0, 64, 1 + i % 3)),
                            serve.SamplingParams(max_tokens=3 + i % 3, n=1 + i % 2, seed=i),
                            request_id=i) for i in range(6)]
  # Widths no other engine of the test session uses: a fresh trace that sees the patch.
  engine = serve.Engine(model, prefix_cache=True, max_len=32, widths=(8, 3))
  completions = engine.run(requests)
  assert len(completions) == sum(r.params.n for r in requests)
  assert not failures, failures[:3]
  assert engine.stats.cached_tokens >= 8 and seen["seq_clone", True] > 0, seen
  assert seen["rewind", True] > 0 and seen["commit_step", True] > 0, seen


def _step_loop_whiles(hlo: str) -> list[str]:
  """The `while` instructions inside the step loops of a compiled serving loop.

  A step loop is a while loop whose body runs the model: a `dot` reached from the body
  through fusions and calls, not through a nested while loop (the outer loop reaches the
  model only through its step loops).
  """
  comps, _ = hlo_walk.computations(hlo)
  found, step_loops = [], 0
  for line in hlo_walk.whiles([line for lines in comps.values() for line in lines]):
    # What the loop's body reaches without entering a nested while (a `while` line has no `dot`).
    body = hlo_walk.reached(comps, hlo_walk.LOOP.search(line).group(2))
    if any(" dot(" in body_line for body_line in body):
      step_loops += 1
      found += hlo_walk.whiles(body)
  # Else the walk missed the model and an empty list would compare equal to anything.
  assert step_loops, "no while loop whose body runs the model"
  return found


def test_the_paged_serving_step_runs_no_loop_the_column_step_does_not():
  """One step of the compiled serving loop (a tiny model, both storages): the paged step's
  body holds exactly as many `while` loops as the column one (the sampler's random-bits
  loop, a static trip count) and none of them carries a page pool (the page-copy loop
  that `prepare_step` had)."""
  queue = pack_queue([(1, 2, 3)], [serve.SamplingParams(max_tokens=4)], max_len=16,
                     max_stop=2)
  found = {}
  for page_size in (None, 8):
    cache = MODEL.cache_config(capacity=256, max_seqs=4, max_write=16)
    model = Decoder(MODEL, dataclasses.replace(cache, page_size=page_size), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    ls = init_loop_state(model.cache_config, queue, num_widths=1)
    hlo = jax.jit(serve_loop, static_argnums=(0, 1, 2), donate_argnums=4).lower(
        graphdef, model.cache_config, (16,), params, ls, jnp.int32(4)).compile().as_text()
    found[page_size] = _step_loop_whiles(hlo)
    if page_size:
      pool = ",".join(str(d) for d in (model.cache_config.num_pages, page_size,
                                       MODEL.num_kv_heads, MODEL.head_dim))
      assert not [line for line in found[page_size] if f"[{pool}]" in line], found[page_size]
  # At least the sampler's random-bits loop, in both.
  assert len(found[8]) == len(found[None]) >= 1, found
