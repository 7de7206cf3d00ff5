"""The engine over paged storage (issue 13 item 4): sizing by bytes, admission by claims, preemption.

The oracle is the column engine (`page_size=None`, capacity large enough that
nothing is ever preempted): a paged engine too small for the queue must preempt
and still give the same tokens, greedy and seeded, forks included. Page tables
and counts are checked against `drivers.check_page_invariants` (no jaxkv code),
and every page nobody owns is NaN-poisoned before each loop entry.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from drivers import assert_serve_loop_in_place, check_page_invariants, poison_free_storage
from jaxkv import CacheConfig, LayerConfig, LayerPolicy, init_state, serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.state import init_loop_state, pack_queue

FLAT = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16)
RINGS = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           layer_types=("sliding", "full"), num_heads=2, num_kv_heads=1,
                           head_dim=16, sliding_window=4, query_pre_attn_scalar=16.0)
MAX_SEQS, WIDTH, MAX_LEN, SMALL, LARGE, PAGE = 4, 8, 32, 72, 160, 4
ENGINE = dict(max_len=MAX_LEN, widths=(WIDTH,))


def _model(model_config, capacity, page_size=None):
  cache = model_config.cache_config(capacity=capacity, max_seqs=MAX_SEQS, max_write=WIDTH)
  return Decoder(model_config, dataclasses.replace(cache, page_size=page_size),
                 rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def flat():
  return {"columns": _model(FLAT, LARGE), "paged": _model(FLAT, SMALL, PAGE)}


def _requests(rng, count=8):
  """Prompts of 5-15 tokens, 6-13 new tokens, greedy and seeded, some with n = 2."""
  out = []
  for i in range(count):
    prompt = tuple(int(t) for t in rng.integers(0, 64, int(rng.integers(5, 16))))
    params = serve.SamplingParams(max_tokens=int(rng.integers(6, 14)),
                                  temperature=0.0 if i % 2 else 0.9, seed=int(rng.integers(99)),
                                  n=2 if i % 3 == 0 else 1)
    out.append(serve.Request(prompt, params, request_id=i))
  return out


def _tokens(completions):
  return {(c.request_id, c.index): (c.tokens, c.finish_reason) for c in completions}


def test_preemption_gives_the_unpreempted_tokens(flat, rng):
  """Capacity 72 for eight requests of up to 2 x 27 positions: admission by claims runs
  several at once, decoding outgrows the room, the latest admitted is preempted and
  recomputed; greedy and seeded tokens (forks included) equal the column engine's."""
  requests = _requests(rng)
  want = _tokens(serve.Engine(flat["columns"], **ENGINE).run(requests))
  engine = serve.Engine(flat["paged"], **ENGINE)
  assert _tokens(engine.run(requests)) == want
  assert engine.stats.preemptions > 0
  assert engine.stats.peak_rows <= SMALL
  # Recomputation costs steps: more tokens fed than the column engine's, never fewer.
  assert engine.stats.generated == sum(len(t) for t, _ in want.values())


def test_admission_runs_more_requests_than_reservations_allow(flat, rng):
  """Reserving prompt + max_tokens - 1 = 30 positions each would run two of these at a time
  in 72 positions; claims admit all four at once, then preempt as they grow."""
  requests = [serve.Request(tuple(int(t) for t in rng.integers(0, 64, 6)),
                            serve.SamplingParams(max_tokens=25), request_id=i) for i in range(4)]
  # Four one-token requests of two samples behind them: the queue then has the shapes of
  # `_requests` (8 requests, 16 output rows), so the loop compiled above is reused.
  requests += [serve.Request((i,), serve.SamplingParams(max_tokens=2, n=2), request_id=4 + i)
               for i in range(4)]
  engine = serve.Engine(flat["paged"], max_steps=2, **ENGINE)
  running = []
  on_progress = lambda stats, _: running.append(int(np.asarray(engine.state.cols.active).sum()))
  got = _tokens(engine.run(requests, on_progress=on_progress))
  assert got == _tokens(serve.Engine(flat["columns"], **ENGINE).run(requests))
  assert running[0] == 4 and engine.stats.preemptions > 0


def test_free_pages_are_never_read(flat, rng):
  """Before every loop entry (one step each) every page row no live sequence keeps is NaN:
  preempted sequences' pages included. Tokens stay exact and the page tables consistent."""
  requests = _requests(rng)
  want = _tokens(serve.Engine(flat["columns"], **ENGINE).run(requests))
  engine = serve.Engine(flat["paged"], max_steps=1, **ENGINE)
  config, loop, entries = engine.config, engine.core._loop, []   # pylint: disable=protected-access

  def poisoned_loop(params, ls, max_steps):
    check_page_invariants(config, ls.cache)
    entries.append(int(ls.preemptions))
    ls = dataclasses.replace(ls, cache=poison_free_storage(ls.cache, config))
    return loop(params, ls, max_steps)

  engine.core._loop = poisoned_loop   # pylint: disable=protected-access
  assert _tokens(engine.run(requests)) == want
  assert entries[-1] > 0   # entries ran after preemptions freed pages


def test_rings_preempt_and_cache_prefixes_exactly(rng):
  """Sliding-window layers keep their columns; preempted sequences are recomputed into
  fresh ring columns, and a prefix is adopted only above the source's floor."""
  system = tuple(int(t) for t in rng.integers(0, 64, 12))
  requests = [serve.Request(system + tuple(int(t) for t in rng.integers(0, 64, 1 + i % 4)),
                            serve.SamplingParams(max_tokens=6 + i, temperature=0.7 * (i % 2),
                                                 seed=i, n=1 + (i == 2)), request_id=i)
              for i in range(6)]
  want = _tokens(serve.Engine(_model(RINGS, LARGE), **ENGINE).run(requests))
  engine = serve.Engine(_model(RINGS, 64, PAGE), prefix_cache=True, **ENGINE)
  assert _tokens(engine.run(requests)) == want
  assert engine.stats.preemptions > 0


def test_abort_of_a_preempted_request(flat, rng):
  """The incremental API aborts a parked (preempted) sample without touching the cache;
  the other requests finish with the tokens `run` gives them."""
  requests = _requests(rng)
  want = _tokens(serve.Engine(flat["columns"], **ENGINE).run(requests))
  engine = serve.Engine(flat["paged"], **ENGINE)
  for r in requests:
    engine.add_request(r)
  got, aborted = {}, None
  while engine.has_unfinished():
    for d in engine.step(1):
      tokens, _ = got.get((d.request_id, d.index), ([], None))
      got[(d.request_id, d.index)] = (tokens + list(d.tokens), d.finish_reason)
    parked = np.asarray(engine.state.cols.parked) == 1
    if aborted is None and parked.any():
      row = int(np.asarray(engine.state.cols.out_row)[np.argmax(parked)])
      aborted = _sample_of_row(engine, row)
      assert engine.abort(*aborted)
  assert aborted is not None and got[aborted][1] == "abort"
  for key, value in want.items():
    if key != aborted:
      assert got[key] == value, key


def _sample_of_row(engine, row):
  """`(request_id, index)` of the sample writing output row `row`."""
  live = engine._live   # pylint: disable=protected-access
  return next((rid, row - t.base) for rid, t in live.ledger.tracked.items()   # pylint: disable=protected-access
              if t.base <= row < t.base + t.n)


def test_refusals_are_unchanged(flat):
  """A request no cache of this capacity can hold is refused before anything runs."""
  engine = serve.Engine(flat["paged"], **ENGINE)
  too_big = serve.Request(tuple(range(20)), serve.SamplingParams(max_tokens=10, n=3))
  with pytest.raises(ValueError, match="must be <= capacity=72"):
    engine.run([too_big])
  with pytest.raises(ValueError, match="prefix_cache=True needs paged storage"):
    serve.Engine(flat["columns"], prefix_cache=True, **ENGINE)
  with pytest.raises(TypeError, match="prefix_cache=1 must be a bool"):
    serve.Engine(flat["paged"], prefix_cache=1, **ENGINE)


# --------------------------------------------------------------------------- sizing


def _pool_bytes(config: CacheConfig) -> int:
  """K/V bytes restated from CONTRACT §3.1 with plain integers (no jaxkv formula)."""
  item, total = np.dtype(config.kv_dtype).itemsize, 0
  pages = -(-config.capacity // config.page_size) + config.max_seqs + 1
  for layer in config.layers:
    per_row = 2 * layer.n_kv_heads * layer.head_dim * item
    if layer.policy.kind == "flat":
      total += per_row * pages * config.page_size
    else:
      rows = min(config.capacity, layer.policy.window + config.max_write - 1)
      total += per_row * rows * (config.max_seqs + 1)
  return total


@pytest.mark.parametrize("budget", [30_000, 123_456, 2**24])
def test_paged_cache_config_fills_the_budget(budget):
  layers = (LayerConfig(LayerPolicy.ring(16), 2, 8), LayerConfig(LayerPolicy.flat(), 2, 8))
  template = CacheConfig(layers, capacity=8, max_seqs=3, max_write=4, kv_dtype=np.float32)
  config = serve.paged_cache_config(template, budget, page_size=8)
  assert config.page_size == 8 and config.capacity % 8 == 0
  assert _pool_bytes(config) <= budget
  assert _pool_bytes(dataclasses.replace(config, capacity=config.capacity + 8)) > budget
  cache = jax.eval_shape(lambda: init_state(config))
  assert sum(int(np.prod(a.shape)) * 4 for a in cache.k + cache.v) == _pool_bytes(config)


def test_paged_cache_config_refuses_a_budget_below_one_page():
  template = CacheConfig((LayerConfig(LayerPolicy.flat(), 2, 8),), capacity=8, max_seqs=3,
                         max_write=4, kv_dtype=np.float32)
  # One page per sequence, one for capacity and the scratch page: 5 x 4 x 2 x 2 x 8 x 4 bytes.
  with pytest.raises(ValueError, match=r"kv_budget_bytes=2,559 .* 2,560 bytes = 1 layers x "
                                       r"2 \(K, V\) x 5 pages"):
    serve.paged_cache_config(template, 2559, page_size=4)
  assert serve.paged_cache_config(template, 2560, page_size=4).capacity == 4
  with pytest.raises(TypeError, match="kv_budget_bytes=True must be an int"):
    serve.paged_cache_config(template, True)
  with pytest.raises(ValueError, match="page_size=0 must be >= 1"):
    serve.paged_cache_config(template, 10**6, page_size=0)


def test_paged_loop_updates_the_pool_in_place(flat):
  """Preemption, eviction and adoption run inside the donated loop: the compiled loop aliases
  the pool and copies no K/V-sized buffer (a refused or masked verb copies no page)."""
  model = flat["paged"]
  config = model.cache_config
  graphdef, params = nnx.split(model)
  queue = pack_queue([(1, 2, 3)], [serve.SamplingParams(max_tokens=4)], max_len=MAX_LEN,
                     max_stop=4)
  ls = init_loop_state(config, queue, num_widths=1, prefix_cache=True)
  assert_serve_loop_in_place(graphdef, config, (WIDTH,), params, ls)
