"""Speculative decoding inside the engine (issue 54): draft, verify in one step, rewind the rest.

The oracle is the same engine without `speculative=` (itself checked against a host greedy
loop in test_serve.py): every greedy output must be equal token for token, whatever the
drafter proposes. One model geometry for the module (ring layers whose floors bound
`k`), few compiled loops: each `(k, drafter, storage)` is one (k = 3 and 8 on columns, 1 on
pages), and the general (sampling) loop is compiled for one `k` only.
"""

from __future__ import annotations

import dataclasses
import os

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings

import hlo_walk
from drivers import PureCache
from jaxkv import CacheConfig, LayerConfig, LayerPolicy, Status, pure, serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.speculative import max_speculative_tokens, ngram_draft, pause_after

MODEL = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           layer_types=("sliding", "full"), num_heads=2,
                           num_kv_heads=1, head_dim=16, sliding_window=4,
                           query_pre_attn_scalar=16.0)
CAPACITY, MAX_SEQS, WIDTH, MAX_LEN = 256, 4, 16, 64
# Random mixes per run (each two runs on compiled engines); JAXKV_SPECULATIVE_EXAMPLES=N for more.
EXAMPLES = int(os.environ.get("JAXKV_SPECULATIVE_EXAMPLES", "20"))


# ----------------------------------------------------------------------------- the verb


def _stepped(config, *steps, seed=0):
  """A `PureCache` whose sequences took `steps` (each: tokens per sequence; random K/V)."""
  rng = np.random.default_rng(seed)
  cache = PureCache(config)
  for _ in steps[0]:
    cache.seq_new()
  for lengths in steps:
    ids = [s for s, n in enumerate(lengths) for _ in range(n)]
    cache.declare_step(ids)
    cache.prepare_step()
    for layer, lc in enumerate(config.layers):
      q = jnp.asarray(rng.normal(size=(len(ids), 2, lc.head_dim)), jnp.float32)
      kv = jnp.asarray(rng.normal(size=(len(ids), lc.n_kv_heads, lc.head_dim)), jnp.float32)
      cache.attend(layer, q, kv, kv)
    cache.commit_step()
  return cache


def _control(state):
  return {name: np.asarray(getattr(state, name)).tolist()
          for name in ("pos", "held", "hw", "page_table", "page_refs")
          if getattr(state, name, None) is not None}


@pytest.mark.parametrize("page_size", [None, 4])
def test_rewind_many_is_every_rewind_at_once(page_size):
  """Equal to one `rewind` per changed sequence; a bad target anywhere refuses the whole call,
  changing nothing."""
  layers = (LayerConfig(LayerPolicy.ring(3), 1, 8), LayerConfig(LayerPolicy.flat(), 1, 8))
  config = CacheConfig(layers=layers, capacity=64, max_seqs=4, max_write=16,
                       **({} if page_size is None else {"page_size": page_size}))
  jitted = jax.jit(pure.rewind_many, static_argnums=0)

  def call(cache, changes):
    positions = np.asarray(cache.state.pos).copy()
    for s, p in changes.items():
      positions[s] = p
    before = _control(cache.state)
    state, status = jitted(config, cache.state, jnp.asarray(positions))
    return state, Status(int(status)), before

  # Sequence 0 wrote 30 positions: its window-3 ring of 18 rows wrapped, floor 30 - 18 + 2 = 14.
  steps = ((15, 1), (15, 1))
  state, status, _ = call(_stepped(config, *steps), {0: 14, 1: 1})
  assert status == Status.OK
  one_by_one = _stepped(config, *steps)
  assert one_by_one.rewind(0, 14) and one_by_one.rewind(1, 1)
  assert _control(state) == _control(one_by_one.state)
  refusals = [({0: 13}, Status.BELOW_FLOOR), ({0: 31}, Status.BAD_TARGET),
              ({1: -1}, Status.BAD_TARGET), ({3: 1}, Status.BAD_TARGET),
              ({0: 20, 1: 3}, Status.BAD_TARGET)]
  for changes, want in refusals:
    state, status, before = call(_stepped(config, *steps), changes)
    assert status == want and _control(state) == before, changes
  if page_size is not None:   # a target inside a page a fork shares would need a copy
    cache = _stepped(config, *steps)
    assert cache.seq_clone(0) is not None
    state, status, before = call(cache, {0: 17})
    assert status == Status.NO_ROOM and _control(state) == before
    state, status, _ = call(cache, {0: 24})   # a page boundary: nothing to copy
    assert status == Status.OK


# ----------------------------------------------------------------------------- the drafter


def test_ngram_draft_proposes_what_followed_the_latest_longest_match():
  tokens = jnp.asarray([[5, 6, 7, 1, 5, 6, 9, 2, 5, 6, 0, 0],    # "5 6" last seen before 9
                        [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0],    # no earlier occurrence of 4
                        [3, 4, 8, 3, 4, 9, 9, 4, 3, 4, 0, 0]],   # "3 4" beats the later "4"
                       jnp.int32)
  draft, count = ngram_draft(tokens, jnp.asarray([10, 4, 10], jnp.int32), 3, 1, 2)
  assert np.asarray(count).tolist() == [3, 0, 3]
  assert np.asarray(draft)[0].tolist() == [9, 2, 5]
  assert np.asarray(draft)[2].tolist() == [9, 9, 4]
  # Only known tokens are proposed: a match right before the end has one follower.
  draft, count = ngram_draft(jnp.asarray([[7, 7, 0, 0]], jnp.int32), jnp.asarray([2], jnp.int32),
                             3, 1, 1)
  assert np.asarray(count).tolist() == [1] and int(draft[0, 0]) == 7


@pytest.mark.parametrize("max_pause", [0, 1, 5, 64])
def test_the_pause_doubles_after_each_round_that_accepts_nothing(max_pause, rng):
  """Against a host model of the rule: a miss (drafts verified, none accepted) pauses
  1, 2, 4, ... steps up to `max_pause`; a hit ends the misses; other steps count down."""
  left = misses = 0
  pause = jnp.zeros((2,), jnp.int32)
  step = jax.jit(pause_after, static_argnums=4)
  for _ in range(200):
    verified, ok = int(rng.choice([0, 0, 3])), bool(rng.random() < 0.9)
    kept = int(rng.choice([0, 0, 0, 1])) if verified else 0
    pause = step(pause, jnp.int32(verified), jnp.int32(kept), jnp.asarray(ok), max_pause)
    if max_pause and ok and verified and not kept:
      misses += 1
      left = min(2 ** (misses - 1), max_pause)
    elif max_pause:
      misses = 0 if ok and verified else misses
      left = max(left - ok, 0)
    assert int(pause[0]) == left


def _lookup(tokens, length, k, ngram_min, ngram_max, window):
  """Host prompt lookup: scan back from the end for the last `n` tokens, longest `n` first."""
  start = max(0, length - window)
  for n in range(ngram_max, ngram_min - 1, -1):
    if length <= n:
      continue
    tail = tokens[length - n:length]
    for e in range(length - 1, start + n - 1, -1):   # continuation start, latest first
      if tokens[e - n:e] == tail:
        follow = tokens[e:min(e + k, length)]
        return follow, len(follow)
  return [], 0


def test_ngram_draft_equals_a_host_lookup_within_its_window(rng):
  lookup = jax.jit(ngram_draft, static_argnums=(2, 3, 4, 5))
  for window in (None, 6, 12):
    for _ in range(6):
      tokens = rng.integers(0, 3, (5, 20)).astype(np.int32)
      length = rng.integers(0, 21, 5).astype(np.int32)
      draft, count = lookup(jnp.asarray(tokens), jnp.asarray(length), 4, 1, 3, window)
      for row in range(5):
        want, n = _lookup(tokens[row].tolist(), int(length[row]), 4, 1, 3, window or 20)
        assert int(count[row]) == n, (window, tokens[row], length[row])
        assert np.asarray(draft)[row, :n].tolist() == want


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def model():
  cache = MODEL.cache_config(capacity=CAPACITY, max_seqs=MAX_SEQS, max_write=WIDTH)
  return Decoder(MODEL, cache, rngs=nnx.Rngs(0))


def _engine(model, **spec):
  """An engine of one width (one phase loop a compile: the module's cost is compiles)."""
  speculative = serve.SpeculativeConfig(**spec) if spec else None
  return serve.Engine(model, max_len=MAX_LEN, widths=(WIDTH,), speculative=speculative)


@pytest.fixture(scope="module")
def plain(model):
  return _engine(model)


@pytest.fixture(scope="module")
def ngram3(model):
  return _engine(model, k=3)


def _key(completions):
  return [(c.request_id, c.index, c.tokens, c.finish_reason) for c in completions]


def _queue(stops=None):
  """Greedy requests over 4 columns (distinct first tokens: the oracle drafter's key):
  repetitive and random prompts, limits, `n = 2`, and with `stops` each third request's
  stop token (one its greedy continuation meets, so stops land inside accepted drafts)."""
  rng = np.random.default_rng(5)
  reqs = []
  for i in range(7):
    cycle = [int(t) for t in rng.integers(0, MODEL.vocab_size, 4)]
    body = cycle * 3 if i % 2 else [int(t) for t in rng.integers(0, 64, 3 + i)]
    stop = () if stops is None or i % 3 else (stops[i], int(rng.integers(0, 64)))
    reqs.append(serve.Request((i,) + tuple(body), serve.SamplingParams(
        max_tokens=int(rng.integers(8, 40)), n=1 + (i == 3), stop_tokens=stop)))
  return reqs


@pytest.fixture(scope="module")
def queue(plain):
  """`(requests, plain completions, plain steps)`: stops picked from the plain run's
  continuations."""
  base = plain.run(_queue())
  tokens = {c.request_id: c.tokens for c in base if c.index == 0}
  requests = _queue(stops={i: t[min(6, len(t) - 1)] for i, t in tokens.items()})
  want = plain.run(requests)
  assert any(c.finish_reason == "stop" for c in want)
  return requests, want, plain.stats.steps


def test_ngram_greedy_equals_plain_decoding(ngram3, queue):
  requests, want, _ = queue
  assert _key(ngram3.run(requests)) == _key(want)
  assert ngram3.stats.accepted_tokens > 0   # the repetitive prompts are looked up


def _oracle_drafter(requests, completions, p: float, seed: int = 0):
  """A test-only drafter that knows each request's greedy continuation and corrupts each
  proposed token with probability `p` (a hash of position and seed): a controllable
  acceptance rate without trained weights."""
  table = np.zeros((len(requests), MAX_LEN), np.int32)
  for c in completions:
    full = list(requests[c.request_id].prompt) + c.tokens
    table[c.request_id, :len(full)] = full
  table, vocab = jnp.asarray(table), MODEL.vocab_size

  def drafter(tokens, length, k):
    row = jnp.clip(tokens[:, 0], 0, len(requests) - 1)   # the first prompt token is the id
    at = length[:, None] + jnp.arange(k)[None, :]
    truth = table[row[:, None], jnp.clip(at, 0, MAX_LEN - 1)]
    h = (at.astype(jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(seed * 40503 + 1))
    h = (h ^ (h >> 15)) * jnp.uint32(2246822519)
    corrupt = (h >> 8).astype(jnp.float32) / 2.0**24 < p
    wrong = (truth + 1 + (h % jnp.uint32(vocab - 1)).astype(jnp.int32)) % vocab
    return jnp.where(corrupt, wrong, truth), jnp.full(length.shape, k, jnp.int32)
  return drafter


@pytest.fixture(scope="module")
def oracle8(model, queue):
  """k = 8 with a drafter right 3 times in 4."""
  requests, want, _ = queue
  spec = serve.SpeculativeConfig(method="custom", k=8,
                                 drafter=_oracle_drafter(requests, want, p=0.25))
  return serve.Engine(model, max_len=MAX_LEN, widths=(WIDTH,), speculative=spec)


def test_oracle_drafter_accepts_and_stays_exact(oracle8, queue):
  """Long accepted runs, stops and limits inside them, rejections after them: the tokens
  are plain decoding's, in fewer steps."""
  requests, want, plain_steps = queue
  engine = oracle8
  assert _key(engine.run(requests)) == _key(want)
  stats = engine.stats
  assert 0 < stats.accepted_tokens < stats.draft_tokens
  # Per sample: what the engine's counters sum.
  done = engine.completions
  assert sum(c.speculation.accepted_tokens for c in done) == stats.accepted_tokens
  assert sum(c.speculation.draft_tokens for c in done) == stats.draft_tokens
  assert all(c.speculation.rounds <= c.speculation.draft_tokens for c in done)
  assert max(c.speculation.mean_accepted_length for c in done) > 1
  assert stats.steps < plain_steps
  print(f"oracle drafter k=8 p=0.25: acceptance {stats.acceptance_rate:.2f}, "
        f"{stats.generated} tokens in {stats.steps} steps (plain: {plain_steps})")


def test_rejected_rounds_pause_drafting(plain, oracle8, queue):
  """Requests the oracle's table does not know (their first token is past its rows, so it
  proposes another request's future): nearly every round is rejected, and drafting pauses
  for longer and longer; the tokens are still plain decoding's."""
  requests, _, _ = queue
  strangers = [serve.Request((60 - i,) + r.prompt[1:], r.params) for i, r in enumerate(requests)]
  want = plain.run(strangers)
  assert _key(oracle8.run(strangers)) == _key(want)
  stats = oracle8.stats
  # Without the pause every step would verify up to 8 tokens per running column.
  assert 0 < stats.draft_tokens < 2 * stats.generated, (stats.draft_tokens, stats.generated)
  assert stats.acceptance_rate < 0.25


@st.composite
def _greedy_mix(draw):
  """Greedy requests over a small alphabet (so prompt lookup finds matches): prompts,
  `max_tokens`, `n`, stop tokens, opt-outs; at most 8 samples, the `queue` fixture's size
  class (a queue of more output rows would compile the loops again)."""
  alphabet = draw(st.integers(2, 8))
  token = st.integers(0, alphabet - 1)
  requests, rows = [], draw(st.integers(1, 8))
  while rows > 0:
    prompt = tuple(draw(st.lists(token, min_size=1, max_size=16)))
    n = draw(st.integers(1, min(2, rows)))
    rows -= n
    requests.append(serve.Request(prompt, serve.SamplingParams(
        max_tokens=draw(st.integers(1, MAX_LEN - len(prompt))), n=n,
        stop_tokens=tuple(draw(st.lists(token, max_size=2))),
        speculative=draw(st.booleans()) or draw(st.booleans()))))
  return requests


@settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests=_greedy_mix())
def test_random_greedy_mixes_equal_plain_decoding(plain, ngram3, requests):
  assert _key(ngram3.run(requests)) == _key(plain.run(requests))


def test_sampled_and_opted_out_requests_decode_beside_drafting_ones(plain, ngram3, queue):
  """The general loop: a sampled request, one with logprobs, one with a penalty, one that
  opts out and one holding a stop token back (`min_tokens`) decode one token a step beside
  drafting columns; every token is plain's."""
  requests, plain_done, _ = queue
  # Met at its second token alone: held back until the fifth.
  want_stop = (next(c for c in plain_done if c.request_id == 5).tokens[1],)
  extra = [serve.SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2),
           serve.SamplingParams(max_tokens=10, logprobs=2),
           serve.SamplingParams(max_tokens=10, repetition_penalty=1.3),
           serve.SamplingParams(max_tokens=20, speculative=False),
           serve.SamplingParams(max_tokens=12, min_tokens=5, stop_tokens=want_stop)]
  mixed = requests[:4] + [serve.Request(requests[5].prompt, p) for p in extra]
  want, got = plain.run(mixed), ngram3.run(mixed)
  assert _key(got) == _key(want)
  assert ngram3.stats.draft_tokens > 0
  logprobs = lambda run: next([t.logprob for t in c.logprobs] for c in run if c.request_id == 5)
  # Rows of different steps: equal up to rounding, not bit for bit.
  np.testing.assert_allclose(logprobs(got), logprobs(want), rtol=1e-5, atol=1e-5)
  # Opted out, a repetitive prompt drafts nothing.
  quiet = [serve.Request(r.prompt, dataclasses.replace(r.params, speculative=False))
           for r in requests]
  assert _key(ngram3.run(quiet)) == _key(plain.run(quiet))
  assert ngram3.stats.draft_tokens == 0
  assert {c.speculation for c in ngram3.completions} == {serve.Speculation(0, 0, 0)}


def test_refusals_name_the_argument_and_change_nothing(model, ngram3, queue):
  for kwargs, match in (({"method": "draft"}, "speculative.method"), ({"k": 0}, "speculative.k"),
                        ({"ngram_min": 3, "ngram_max": 2}, "speculative.ngram_min"),
                        ({"method": "custom"}, "speculative.drafter"),
                        ({"max_pause": -1}, "speculative.max_pause"),
                        ({"ngram_window": 3}, "speculative.ngram_window")):
    with pytest.raises(ValueError, match=match):
      serve.SpeculativeConfig(**kwargs)
  with pytest.raises(TypeError, match="speculative=1 must be a bool"):
    serve.SamplingParams(speculative=1)
  bound = max_speculative_tokens(model.cache_config)
  assert bound == WIDTH - 1   # a column's token and draft fit one step
  with pytest.raises(ValueError, match=f"speculative.k={bound + 1} must be <= {bound}"):
    serve.Engine(model, max_len=MAX_LEN, speculative=serve.SpeculativeConfig(k=bound + 1))
  with pytest.raises(TypeError, match="speculative="):
    serve.Engine(model, max_len=MAX_LEN, speculative="ngram")
  # A queue holding a request that cannot fit is refused before anything is served: the
  # last run's state and completions stay.
  requests, _, _ = queue
  ngram3.run(requests[:2])
  state, completions = ngram3.state, list(ngram3.completions)
  too_long = serve.Request(requests[0].prompt, serve.SamplingParams(max_tokens=MAX_LEN))
  with pytest.raises(ValueError, match="max_tokens"):
    ngram3.run(requests[:1] + [too_long])
  assert ngram3.completions == completions and not ngram3.has_unfinished()
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), ngram3.state, state))


def test_paged_storage_preempts_and_caches_prefixes_exactly(queue):
  """Over pages (a pool small enough to preempt, prefix caching on), `k = 1` (`k` 3 and 8 run
  on columns above): drafts are cut to the room a step has, rejected tails give their pages
  back (`rewind_many`), a preempted column recomputes its tokens and its draft; the tokens
  are the column engine's."""
  requests, want, _ = queue
  cache = dataclasses.replace(MODEL.cache_config(capacity=96, max_seqs=MAX_SEQS, max_write=WIDTH),
                              page_size=4)
  paged = Decoder(MODEL, cache, rngs=nnx.Rngs(0))
  engine = serve.Engine(paged, max_len=MAX_LEN, widths=(WIDTH,), prefix_cache=True,
                        speculative=serve.SpeculativeConfig(k=1))
  again = [serve.Request(requests[1].prompt, requests[1].params, request_id=7)]
  got = engine.run(requests + again)
  assert _key(got[:-1]) == _key(want) and got[-1].tokens == want[1].tokens
  stats = engine.stats
  assert stats.preemptions > 0 and stats.cached_tokens > 0 and stats.accepted_tokens > 0


def _stream(engine, requests, step, speculation=None):
  """`{(position in requests, index): (tokens, finish reason)}` of `requests` served by
  `step()` calls; with a dict `speculation`, each sample's `Delta.speculation` lands there
  (it must come on the finishing delta only)."""
  position = {engine.add_request(r): i for i, r in enumerate(requests)}
  got: dict = {}
  while engine.has_unfinished() or engine.live.has_work():
    for d in step():
      key = (position[d.request_id], d.index)
      got[key] = (got.get(key, ((), None))[0] + tuple(d.tokens), d.finish_reason)
      if speculation is not None:
        assert (d.speculation is not None) == (d.finish_reason is not None), d
        if d.speculation is not None:
          speculation[key] = d.speculation
  return got


def test_incremental_api_streams_the_same_tokens(oracle8, queue):
  """Single steps queued ahead of the device (`serve_step`: drafts verified with no branch),
  each read back while the next is in flight, from a snapshot that holds `k + 1 = 9` tokens
  a row (more than the smallest snapshot): each sample's tokens are plain decoding's."""
  requests, want, _ = queue
  expected = {(c.request_id, c.index): (tuple(c.tokens), c.finish_reason) for c in want}
  live = oracle8.live
  before = (oracle8.stats.draft_tokens, oracle8.stats.accepted_tokens)
  speculation = {}
  assert _stream(oracle8, requests, lambda: live.step(1, overlap=True, stepwise=True),
                 speculation) == expected
  stats = oracle8.stats
  assert stats.accepted_tokens > 0
  # Each sample's counters, read from the snapshot the finishing delta came from, add up to
  # what the engine's totals added over the stream.
  assert set(speculation) == set(expected)
  assert (sum(v.draft_tokens for v in speculation.values()),
          sum(v.accepted_tokens for v in speculation.values())) == (
              stats.draft_tokens - before[0], stats.accepted_tokens - before[1]), before
  assert all(0 < v.rounds <= v.draft_tokens for v in speculation.values() if v.draft_tokens)
  # One request alone: its own row's counters are the totals' increase.
  alone = next(r for r in requests if r.params.n == 1 and len(set(r.prompt)) < len(r.prompt))
  before = (stats.draft_tokens, stats.accepted_tokens)
  speculation = {}
  _stream(oracle8, [alone], lambda: live.step(1, overlap=True, stepwise=True), speculation)
  (got,) = speculation.values()
  assert got.accepted_tokens > 0 and (got.draft_tokens, got.accepted_tokens) == (
      oracle8.stats.draft_tokens - before[0], oracle8.stats.accepted_tokens - before[1])
  # What lets the host run ahead: verifying, rolling back and drafting add no loop and no
  # branch to the compiled step (each would read a predicate back on a GPU).
  core = oracle8.core   # pylint: disable=protected-access
  hlo = core._verbs.steps[0, True].lower(core._param_leaves, core._packed).compile().as_text()
  comps, entry = hlo_walk.computations(hlo)
  lines = hlo_walk.reached(comps, entry, branches=True)
  assert hlo_walk.whiles(lines) == [] and not [l for l in lines if " conditional(" in l]


def test_cli_flags_name_the_config():
  from jaxkv import cli   # pylint: disable=g-import-not-at-top
  parse = lambda *flags: cli._parser().parse_args(["serve", "m", *flags])   # pylint: disable=protected-access
  assert cli.speculative_config(parse()) is None
  assert cli.speculative_config(parse("--speculative-method", "ngram", "--num-speculative-tokens",
                                      "5", "--prompt-lookup-max", "4")) == serve.SpeculativeConfig(
                                          k=5, ngram_max=4)
  with pytest.raises(ValueError, match="--num-speculative-tokens needs --speculative-method"):
    cli.speculative_config(parse("--num-speculative-tokens", "2"))
  from jaxkv.serve.speculative import describe   # pylint: disable=g-import-not-at-top
  assert describe(None) == "speculative decoding: off"
  line = describe(serve.SpeculativeConfig(k=5, ngram_max=4, max_pause=0))
  assert "up to 5 draft tokens" in line and "1..4 tokens" in line and "never pausing" in line


def test_metrics_count_drafts_from_the_engines_totals():
  """`/metrics`' draft counters add what the engine's totals added since the last step, and
  count on when the totals restart (a new cache)."""
  import types   # pylint: disable=g-import-not-at-top
  from jaxkv.http.metrics import Metrics   # pylint: disable=g-import-not-at-top
  metrics = Metrics(capacity=64, model_name="m")
  stats = serve.EngineStats()
  engine = types.SimpleNamespace(counts=lambda: (0, 0), held=0, stats=stats)

  def scrape(name):
    return next(float(l.split()[-1]) for l in metrics.render().decode().splitlines()
                if l.startswith(name + "{") or l.startswith(name + "_total{"))
  for drafted, accepted in ((0, 0), (8, 6), (20, 9), (4, 1)):   # the last: a new cache
    stats.draft_tokens, stats.accepted_tokens = drafted, accepted
    metrics.after_step(engine, [])
  assert scrape("jaxkv_spec_decode_num_draft_tokens") == 24
  assert scrape("jaxkv_spec_decode_num_accepted_tokens") == 10
  assert scrape("jaxkv_spec_decode_acceptance_rate") == pytest.approx(0.25)
