"""`jaxkv.serve`: the jitted continuous-batching loop, sampling, admission, retirement, forks."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drivers import assert_serve_loop_in_place
from jaxkv.serve.decoding import greedy_generate
from jaxkv.models import Decoder, ModelConfig
from jaxkv import serve
from jaxkv import CacheConfig, LayerConfig, LayerPolicy
import jaxkv.serve.core  # noqa: F401  (monkeypatched below)
from jaxkv.serve.loop import serve_loop
from jaxkv.serve.sampling import sample
from jaxkv.serve.state import init_loop_state, pack_queue

MODEL = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                           layer_types=("sliding", "full", "sliding"), num_heads=2,
                           num_kv_heads=1, head_dim=16, sliding_window=4,
                           query_pre_attn_scalar=16.0)
CAPACITY, MAX_SEQS, WIDTH = 160, 4, 8


def _model(initial_capacity=None, seed=0):
  cache = MODEL.cache_config(capacity=CAPACITY, max_seqs=MAX_SEQS, max_write=WIDTH,
                             initial_capacity=initial_capacity)
  return Decoder(MODEL, cache, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def model():
  return _model()


def _prompts(rng, count, lo=1, hi=20):
  return [tuple(int(t) for t in rng.integers(0, MODEL.vocab_size, size=int(rng.integers(lo, hi))))
          for _ in range(count)]


def _greedy(model, prompt, max_new):
  return greedy_generate(serve.ModelRunner(model), [list(prompt)], max_new)[0]


def test_greedy_batch_equals_one_by_one_and_traces_once(model, rng, monkeypatch):
  """Ten requests over four columns: admission, mixed prefill/decode, retirement, ring wraps.

  The loop (two widths) is compiled once (chex), and the whole queue, longer than the
  column count, is admitted inside it: one loop entry.
  """
  monkeypatch.setattr(serve.core, "serve_loop", chex.assert_max_traces(serve_loop, n=1))
  engine = serve.Engine(model, max_len=48, widths=(WIDTH, 4))
  prompts = _prompts(rng, 10)
  limits = [int(rng.integers(1, 14)) for _ in prompts]
  requests = [serve.Request(p, serve.SamplingParams(max_tokens=m)) for p, m in zip(prompts, limits)]
  results = engine.run(requests)
  assert [r.request_id for r in results] == list(range(10))
  for r, p, m in zip(results, prompts, limits):
    assert r.finish_reason == "length" and len(r.tokens) == m
    assert r.tokens == _greedy(model, p, m), r.request_id
  stats = engine.stats
  assert stats.generated == sum(limits)
  assert stats.step_tokens == sum(len(p) + m - 1 for p, m in zip(prompts, limits))
  assert stats.loop_entries == 1            # admission and retirement happen in the loop
  assert stats.width_steps[4] > 0 and stats.width_steps[WIDTH] > 0
  assert stats.occupancy > stats.steps      # steps mix several sequences
  # A second queue of the same size class (queues pad to powers of two) reuses the compiled
  # loop: the chex wrapper would raise on a retrace.
  again = engine.run(requests[:9])
  assert [r.tokens for r in again] == [r.tokens for r in results[:9]]


def test_bucketed_model_serves_the_same_tokens(model, rng):
  """A Decoder whose small steps run the dense layers on 2 rows gives the same greedy tokens."""
  cache = MODEL.cache_config(capacity=CAPACITY, max_seqs=MAX_SEQS, max_write=WIDTH)
  bucketed = Decoder(MODEL, cache, bucket=2, rngs=nnx.Rngs(0))
  requests = [serve.Request(p, serve.SamplingParams(max_tokens=5)) for p in _prompts(rng, 3)]
  got = serve.Engine(bucketed, max_len=48).run(requests)
  want = serve.Engine(model, max_len=48).run(requests)
  assert [r.tokens for r in got] == [r.tokens for r in want]


def test_growth_before_the_loop(rng):
  """Flat rows start at 8 and are grown once on the host for the whole queue; results are unchanged."""
  small, big = _model(initial_capacity=8), _model()
  prompts = _prompts(rng, 3, 10, 30)
  requests = [serve.Request(p, serve.SamplingParams(max_tokens=6)) for p in prompts]
  grown = serve.Engine(small, max_len=48)
  got = grown.run(requests)
  want = serve.Engine(big, max_len=48).run(requests)
  assert [r.tokens for r in got] == [r.tokens for r in want]
  flat = [l for l, c in enumerate(small.cache_config.layers) if not c.policy.is_ring][0]
  assert grown.state.cache.k[flat].shape[0] > 8


def test_sampling_seeds_topk_topp(model, rng):
  engine = serve.Engine(model, max_len=48)
  prompt = _prompts(rng, 1, 5, 6)[0]
  greedy = _greedy(model, prompt, 8)
  params = lambda **kw: serve.SamplingParams(max_tokens=8, **kw)
  runs = engine.run([
      serve.Request(prompt, params(temperature=1.0, top_k=1, seed=3)),      # top-1 = greedy
      serve.Request(prompt, params(temperature=1.0, top_p=1e-6, seed=4)),   # tiny nucleus = greedy
      serve.Request(prompt, params(temperature=2.0, seed=7)),
      serve.Request(prompt, params(temperature=2.0, seed=7)),
      serve.Request(prompt, params(temperature=2.0, seed=8)),
  ])
  assert runs[0].tokens == greedy and runs[1].tokens == greedy
  assert runs[2].tokens == runs[3].tokens != runs[4].tokens
  assert runs[2].tokens != greedy
  # Batch composition does not change a seeded sample.
  alone = engine.run([serve.Request(prompt, params(temperature=2.0, seed=7))])
  assert alone[0].tokens == runs[2].tokens


def test_sample_respects_top_k_and_top_p():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2, jnp.float32))
  keys = jax.random.split(jax.random.key(0), 400)
  draw = jax.vmap(lambda k: sample(
      logits, jnp.ones((2,), jnp.float32), jnp.array([2, 0], jnp.int32),
      jnp.array([1.0, 0.7], jnp.float32), jax.random.split(k, 2)))
  tokens = np.asarray(draw(keys))
  assert set(tokens[:, 0]) == {0, 1}   # top-2
  assert set(tokens[:, 1]) == {0, 1}   # nucleus 0.7 = {0.5, 0.3}
  greedy = sample(logits, jnp.zeros((2,), jnp.float32), jnp.zeros((2,), jnp.int32),
                  jnp.ones((2,), jnp.float32), jax.random.split(keys[0], 2))
  assert np.asarray(greedy).tolist() == [0, 0]


def test_stop_tokens_and_limits(model, rng):
  engine = serve.Engine(model, max_len=48)
  prompt = _prompts(rng, 1, 4, 5)[0]
  greedy = _greedy(model, prompt, 10)
  stop = greedy[3]
  first = greedy.index(stop)
  results = engine.run([serve.Request(prompt, serve.SamplingParams(max_tokens=10,
                                                                   stop_tokens=(stop,))),
                        serve.Request(prompt, serve.SamplingParams(max_tokens=2))])
  assert results[0].tokens == greedy[:first + 1] and results[0].finish_reason == "stop"
  assert results[1].tokens == greedy[:2] and results[1].finish_reason == "length"


def test_parallel_sampling_forks_the_prompt(model, rng):
  """n = 3: the prompt is prefilled once and cloned; sample 0 equals the n = 1 request."""
  engine = serve.Engine(model, max_len=48)
  prompt = _prompts(rng, 1, 12, 13)[0]
  params = serve.SamplingParams(max_tokens=6, temperature=1.5, seed=11, n=3)
  samples = engine.run([serve.Request(prompt, params)])
  assert [s.index for s in samples] == [0, 1, 2]
  assert engine.stats.step_tokens == len(prompt) - 1 + 3 * 6   # prefix written once
  single = engine.run([serve.Request(prompt, serve.SamplingParams(
      max_tokens=6, temperature=1.5, seed=11))])
  assert samples[0].tokens == single[0].tokens
  assert len({tuple(s.tokens) for s in samples}) > 1
  greedy = engine.run([serve.Request(prompt, serve.SamplingParams(max_tokens=6, n=2))])
  assert greedy[0].tokens == greedy[1].tokens == _greedy(model, prompt, 6)


@pytest.mark.parametrize("make, match", [
    (lambda: serve.SamplingParams(top_p=0.0), "top_p=0.0"),
    (lambda: serve.SamplingParams(max_tokens=0), "max_tokens=0"),
    (lambda: serve.SamplingParams(temperature=-1.0), "temperature=-1.0"),
    (lambda: serve.SamplingParams(n=0), "n=0"),
    (lambda: serve.Request(()), "prompt"),
])
def test_bad_parameters_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_requests_that_cannot_fit_raise(model):
  engine = serve.Engine(model, max_len=16)
  with pytest.raises(ValueError, match="max_len=16"):
    engine.run([serve.Request(tuple(range(10)), serve.SamplingParams(max_tokens=10))])
  with pytest.raises(ValueError, match="n=5"):
    engine.run([serve.Request((1, 2), serve.SamplingParams(max_tokens=2, n=5))])
  with pytest.raises(ValueError, match="max_stop_tokens"):
    engine.run([serve.Request((1,), serve.SamplingParams(max_tokens=2, stop_tokens=tuple(range(9))))])
  with pytest.raises(TypeError, match="cache_config"):
    serve.Engine(object())


def test_decode_loop_updates_the_cache_in_place(model):
  """The jitted loop aliases the donated cache and copies no K/V-sized buffer."""
  config = model.cache_config
  graphdef, params = nnx.split(model)
  queue = pack_queue([(1, 2, 3)], [serve.SamplingParams(max_tokens=4)], max_len=48,
                     max_stop=4)
  widths = (WIDTH, 4)
  ls = init_loop_state(config, queue, num_widths=len(widths))
  assert_serve_loop_in_place(graphdef, config, widths, params, ls)


@pytest.mark.parametrize("widths", [(WIDTH, 4, 2), (WIDTH, 3)])
def test_width_choice_never_changes_outputs(model, rng, widths):
  """The same queue through the wide-only loop and through narrower compiled widths gives
  identical tokens, greedy and seeded sampling, forks included."""
  prompts = _prompts(rng, 6)
  requests = [serve.Request(p, serve.SamplingParams(max_tokens=int(rng.integers(2, 9)),
                                                    temperature=float(i % 2), seed=i, n=1 + i % 3))
              for i, p in enumerate(prompts)]
  wide = serve.Engine(model, max_len=48, widths=(WIDTH,))
  narrow = serve.Engine(model, max_len=48, widths=widths)
  want, got = wide.run(requests), narrow.run(requests)
  assert [(c.request_id, c.index, c.tokens) for c in got] == [
      (c.request_id, c.index, c.tokens) for c in want]
  assert sum(narrow.stats.width_steps[w] for w in widths[1:]) > 0
  assert wide.stats.width_steps == {WIDTH: wide.stats.steps}


def test_parallel_samples_do_not_starve_admission(model, rng):
  """Three n=2 requests on four columns (the old host admission let a later request take the
  columns a waiting fork needed: NO_FREE_ID): every sample is served, greedy samples agree."""
  prompts = _prompts(rng, 3)
  requests = [serve.Request(p, serve.SamplingParams(max_tokens=5, n=2)) for p in prompts]
  results = serve.Engine(model, max_len=48).run(requests)
  assert [(c.request_id, c.index) for c in results] == [(i, j) for i in range(3) for j in range(2)]
  for c in results:
    assert c.tokens == _greedy(model, c.prompt, 5)


def test_model_protocol_is_checked_at_construction(model):
  """A model that breaks the step protocol is refused by name before any loop is traced."""

  class NoVocab(nnx.Module):
    def __init__(self, inner):
      self.inner, self.cache_config = inner, inner.cache_config

    def __call__(self, tokens, state, *, rows=None):
      return self.inner(tokens, state, rows=rows)

  with pytest.raises(TypeError, match="vocab_size"):
    serve.Engine(NoVocab(model))

  class WrongVocab(NoVocab):
    vocab_size = 7

  with pytest.raises(TypeError, match="float32"):
    serve.Engine(WrongVocab(model))


def test_paged_storage_serves_the_same_tokens(model, rng):
  """An engine over paged flat layers (CONTRACT §3.1; the pool never grows) gives the columns' tokens."""
  import dataclasses   # pylint: disable=g-import-not-at-top
  paged_cache = dataclasses.replace(model.cache_config, page_size=4)
  paged = Decoder(MODEL, paged_cache, rngs=nnx.Rngs(0))
  requests = [serve.Request(p, serve.SamplingParams(max_tokens=5, n=1 + i % 2))
              for i, p in enumerate(_prompts(rng, 4))]
  want = serve.Engine(model, max_len=48).run(requests)
  got = serve.Engine(paged, max_len=48).run(requests)
  assert [(c.request_id, c.index, c.tokens) for c in got] == [
      (c.request_id, c.index, c.tokens) for c in want]


@pytest.mark.parametrize("width, max_seqs, want", [
    # The e2e shape: halving down to 512 rows (a 600-token prompt next to 63 decodes runs
    # 1024 rows, not 2048), then a factor 4.
    (2048, 64, (2048, 1024, 512, 128, 64)),
    (512, 64, (512, 128, 64)),
    (4096, 256, (4096, 2048, 1024, 512, 256)),   # no middle width below twice the decode width
    (2048, 16, (2048, 1024, 512, 128, 16)),      # none below 128 rows (they cost what decode costs)
    (1000, 8, (1000, 248, 8)),                   # half of 1000 is under 512 rows: a factor 4
    (256, 8, (256, 8)),
    (64, 8, (64, 8)),
    (8, 4, (8,)),                                # decode already fills W
])
def test_default_widths_halve_where_rows_cost_then_shrink_by_four(width, max_seqs, want):
  from jaxkv.serve.engine import default_widths   # pylint: disable=g-import-not-at-top
  layers = (LayerConfig(policy=LayerPolicy(), n_kv_heads=1, head_dim=8),)
  config = CacheConfig(layers=layers, capacity=8192, max_seqs=max_seqs, max_write=width)
  assert default_widths(config) == want


@pytest.mark.parametrize("width, max_seqs, per_column, want", [
    (512, 64, 5, (512, 320, 128, 64)),    # k = 4: the verify width beside plain decoding's
    (512, 16, 5, (512, 128, 80, 16)),
    (512, 256, 5, (512, 256)),            # every column's draft does not fit below W
    (16, 4, 4, (16, 8)),
])
def test_speculative_widths_keep_plain_decodings(width, max_seqs, per_column, want):
  from jaxkv.serve.engine import default_widths   # pylint: disable=g-import-not-at-top
  layers = (LayerConfig(policy=LayerPolicy(), n_kv_heads=1, head_dim=8),)
  config = CacheConfig(layers=layers, capacity=8192, max_seqs=max_seqs, max_write=width)
  assert default_widths(config, per_column) == want
