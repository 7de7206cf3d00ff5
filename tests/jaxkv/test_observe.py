"""What the engine reports: implementations per layer, compile vs serving time, per-sample latency.

The step-count checks are oracles of the scheduler's own guarantees, derived
here from the requests alone: a sample cannot get its first token before its
prompt went through the steps (at most `W` tokens a step), decodes one token
per step once it runs (every column gets a slot when `W >= max_seqs`), and no
more than `max_seqs` samples hold a column at once.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.report import implementation_lines, layer_implementations

MODEL = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                           layer_types=("sliding", "full", "sliding"), num_heads=2,
                           num_kv_heads=1, head_dim=16, sliding_window=4,
                           query_pre_attn_scalar=16.0)
CAPACITY, MAX_SEQS, WIDTH = 160, 4, 8


def _model(**kwargs):
  cache = MODEL.cache_config(capacity=CAPACITY, max_seqs=MAX_SEQS, max_write=WIDTH)
  return Decoder(MODEL, cache, rngs=nnx.Rngs(0), **kwargs)


def _requests(rng, count):
  out = []
  for i in range(count):
    prompt = tuple(int(t) for t in rng.integers(0, MODEL.vocab_size, int(rng.integers(1, 20))))
    params = serve.SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=1.0,
                                  n=int(rng.choice([1, 1, 2])), seed=i,
                                  stop_tokens=(int(rng.integers(0, MODEL.vocab_size)),))
    out.append(serve.Request(prompt, params))
  return out


@pytest.fixture(scope="module")
def served():
  engine = serve.Engine(_model(), max_len=48)
  requests = _requests(np.random.default_rng(3), 9)
  # max_steps=6: several loop entries, so host time between entries is part of the run.
  engine.max_steps = 6
  results = engine.run(requests, admission="fcfs")   # queue order: checked below
  return engine, requests, results


def test_step_counts_follow_the_schedule(served):
  engine, requests, results = served
  assert WIDTH >= MAX_SEQS   # every running column decodes one token per step
  stats = engine.stats
  assert stats.loop_entries > 1
  by_id = {i: r for i, r in enumerate(requests)}
  for c in results:
    t = c.timing
    prompt = len(by_id[c.request_id].prompt)
    assert 0 <= t.admitted_step < t.first_token_step <= t.finished_step <= stats.steps, c
    assert t.first_token_step - t.admitted_step >= math.ceil(prompt / WIDTH), c
    assert t.finished_step - t.first_token_step == len(c.tokens) - 1, c
  assert max(c.timing.finished_step for c in results) == stats.steps
  # First come first served: requests are admitted in queue order.
  admitted = [min(c.timing.admitted_step for c in results if c.request_id == i)
              for i in range(len(requests))]
  assert admitted == sorted(admitted)
  # A sample holds a column from its admission until it finishes; never more than max_seqs.
  for step in range(stats.steps):
    holding = sum(c.timing.admitted_step <= step < c.timing.finished_step for c in results)
    assert holding <= MAX_SEQS, step


def test_seconds_are_step_counts_times_the_mean_step(served):
  engine, _, results = served
  stats = engine.stats
  assert 0 < stats.compile_seconds < stats.seconds
  assert stats.serve_seconds == pytest.approx(stats.seconds - stats.compile_seconds)
  assert stats.step_seconds == pytest.approx(stats.serve_seconds / stats.steps)
  assert stats.generated == sum(len(c.tokens) for c in results)
  assert stats.tokens_per_second == pytest.approx(stats.generated / stats.serve_seconds)
  mean = stats.step_seconds
  for c in results:
    t = c.timing
    assert t.queue_seconds == pytest.approx(t.admitted_step * mean)
    assert t.first_token_seconds == pytest.approx(t.first_token_step * mean)
    assert t.total_seconds == pytest.approx(t.finished_step * mean)
    assert 0 <= t.queue_seconds < t.first_token_seconds <= t.total_seconds
    if len(c.tokens) > 1:
      assert t.inter_token_seconds == pytest.approx(
          (t.total_seconds - t.first_token_seconds) / (len(c.tokens) - 1))
    else:
      assert t.inter_token_seconds is None


def test_run_time_splits_into_set_up_loop_and_the_rest(served):
  """Set-up and the loop's entries are disjoint parts of the run: both measured, and
  together within `seconds` (the loop part holds the first run's compilation)."""
  _assert_split(served[0].stats)   # a first run; a warm one in the test below


def _assert_split(stats):
  assert stats.setup_seconds > 0 and stats.loop_seconds > 0
  assert stats.setup_seconds + stats.loop_seconds <= stats.seconds


def test_compile_is_paid_once_per_shape_class(served):
  engine, requests, first = served
  compiled = engine.stats.compile_seconds
  seen = []
  again = engine.run(requests, on_progress=lambda s, done: seen.extend(done))
  stats = engine.stats
  # Only small host-side helpers may compile now: the same queue is the same shape class.
  assert stats.compile_seconds < compiled / 4 and stats.serve_seconds > 0
  _assert_split(stats)
  assert again == first   # timings differ; a completion is its tokens, not its timing
  assert all(c.timing is not None for c in seen)   # the same objects, timed once run returned


def test_timing_of_a_sample_rejects_impossible_step_counts():
  with pytest.raises(ValueError, match="admitted=3, first=3"):
    serve.RequestTiming.from_steps(3, 3, 4, 2, 0.1)
  t = serve.RequestTiming.from_steps(0, 2, 6, 3, 0.5)
  assert (t.queue_seconds, t.first_token_seconds, t.total_seconds,
          t.inter_token_seconds) == pytest.approx((0.0, 1.0, 3.0, 1.0))


def test_engine_reports_each_layers_implementation(served):
  engine, _, _ = served
  want = tuple(jaxkv.implementation_plan(MODEL.cache_config(
      capacity=CAPACITY, max_seqs=MAX_SEQS, max_write=WIDTH), MODEL.num_heads))
  assert engine.implementations == want and engine.stats.implementations == want
  assert all(r.implementation == "reference" and "cpu" in r.reason for r in want)
  explicit = layer_implementations(_model(implementation="interpret"), engine.config)
  assert [r.implementation for r in explicit] == ["interpret"] * 3
  assert all("implementation='interpret' was chosen" in r.reason for r in explicit)
  unknown = layer_implementations(object(), engine.config)   # no CachedAttention to read
  assert [r.implementation for r in unknown] == ["unknown"] * 3


def test_implementation_lines_group_layers_by_implementation_and_reason():
  row = jaxkv.LayerImplementation
  plan = [row(0, "a", "why a"), row(1, "a", "why a"), row(2, "b", "why b"), row(3, "a", "why a"),
          row(4, "a", "other")]
  assert implementation_lines(plan) == [
      "attention: a on layers 0-1, 3 (3 of 5): why a",
      "attention: b on layer 2 (1 of 5): why b",
      "attention: a on layer 4 (1 of 5): other"]


def test_incremental_timing_has_the_inter_token_mean(rng):
  engine = serve.Engine(_model(), max_len=40)
  engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=6), "six"))
  engine.add_request(serve.Request((4,), serve.SamplingParams(max_tokens=1), "one"))
  timing = {d.request_id: d.timing for d in engine.stream(2) if d.timing is not None}
  six, one = timing["six"], timing["one"]
  assert 0 <= six.first_token_seconds <= six.total_seconds
  assert six.inter_token_seconds == pytest.approx(
      (six.total_seconds - six.first_token_seconds) / 5, rel=0.05)
  assert one.inter_token_seconds is None and six.admitted_step is None
