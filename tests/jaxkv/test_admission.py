"""`Engine.run(admission=...)`: the order in which a known queue takes free columns.

Oracles: the admission order is restated here from the contract (budgets descending,
ties in queue order), independently of `admission_order`; the tokens of every request
must not depend on the order (first come first served is the reference).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)
MAX_SEQS, WIDTH, MAX_LEN = 2, 8, 40


@pytest.fixture(scope="module")
def engine():
  cache = MODEL.cache_config(capacity=MAX_SEQS * MAX_LEN, max_seqs=MAX_SEQS, max_write=WIDTH)
  return serve.Engine(Decoder(MODEL, cache, rngs=nnx.Rngs(0)), max_len=MAX_LEN,
                      widths=(WIDTH, MAX_SEQS))


def _queue(rng, budgets, *, sampled=False):
  return [serve.Request(tuple(int(t) for t in rng.integers(0, 64, int(rng.integers(1, 9)))),
                        serve.SamplingParams(max_tokens=b, temperature=0.9 * (sampled and i % 2),
                                             seed=i, n=1 + (sampled and i % 3 == 0)),
                        request_id=f"r{i}")
          for i, b in enumerate(budgets)]


def _tokens(completions):
  return {(c.request_id, c.index): (c.tokens, c.finish_reason) for c in completions}


def _admitted(completions, requests):
  return [min(c.timing.admitted_step for c in completions if c.request_id == r.request_id)
          for r in requests]


def test_longest_first_admits_by_budget_and_returns_queue_order(engine, rng):
  budgets = [3, 9, 5, 9, 1, 12, 5]
  requests = _queue(rng, budgets)
  results = engine.run(requests)                      # the default order
  assert [c.request_id for c in results] == [r.request_id for r in requests]
  expected = sorted(range(len(budgets)), key=lambda i: (-budgets[i], i))
  admitted = _admitted(results, requests)
  assert [admitted[i] for i in expected] == sorted(admitted)
  # Ties keep queue order: r1 before r3 (budget 9), r2 before r6 (budget 5).
  assert admitted[1] <= admitted[3] and admitted[2] <= admitted[6]
  # The two longest start at once, in the first step.
  assert admitted[5] == admitted[1] == 0


def test_fcfs_admits_in_queue_order(engine, rng):
  requests = _queue(rng, [3, 9, 5, 9, 1, 12, 5])
  admitted = _admitted(engine.run(requests, admission="fcfs"), requests)
  assert admitted == sorted(admitted) and admitted[-1] > 0


def test_admission_order_changes_no_token(engine, rng):
  requests = _queue(rng, [2, 11, 4, 7, 1, 9, 3, 6], sampled=True)
  want = _tokens(engine.run(requests, admission="fcfs"))
  got = engine.run(requests)
  assert _tokens(got) == want
  assert [(c.request_id, c.index) for c in got] == sorted(
      want, key=lambda k: (int(k[0][1:]), k[1]))


def test_longest_first_shortens_a_queue_with_a_late_long_request(engine, rng):
  """Four short requests then a long one on two columns: first come first served decodes
  the long one alone after the short ones; longest first runs it beside them."""
  requests = _queue(rng, [4, 4, 4, 4, 24])
  engine.run(requests, admission="fcfs")
  fcfs_steps = engine.stats.steps
  engine.run(requests)
  lf_steps = engine.stats.steps
  assert lf_steps < fcfs_steps
  # The long request holds a column from the first step: the run lasts about as long
  # as it does (its prefill step, 24 decode steps, and the short ones beside it).
  assert lf_steps <= 24 + 2 < fcfs_steps


def test_an_unknown_admission_order_is_refused_before_anything_is_served(engine, rng):
  requests = _queue(rng, [3, 5])
  engine.run(requests)
  completions, stats = engine.completions, engine.stats
  with pytest.raises(ValueError, match="admission='shortest'"):
    engine.run(requests, admission="shortest")
  assert engine.completions is completions and engine.stats is stats
  dp = serve.DataParallelEngine(engine_model(engine), devices=jax.local_devices()[:1],
                                max_len=MAX_LEN, widths=(WIDTH, MAX_SEQS))
  with pytest.raises(ValueError, match="admission=None"):
    dp.run(requests, admission=None)
  assert dp.completions == [] and dp.engines[0].stats.steps == 0


def engine_model(engine):
  return nnx.merge(engine.core.graphdef, engine.core.params)


def test_the_same_order_is_used_by_every_data_parallel_engine(engine, rng):
  requests = _queue(rng, [2, 7, 3, 7, 5, 1])
  dp = serve.DataParallelEngine(engine_model(engine), devices=jax.local_devices()[:1],
                                max_len=MAX_LEN, widths=(WIDTH, MAX_SEQS))
  results = dp.run(requests)
  assert _tokens(results) == _tokens(engine.run(requests, admission="fcfs"))
  admitted = _admitted(results, requests)
  expected = sorted(range(len(requests)), key=lambda i: (-requests[i].params.max_tokens, i))
  assert [admitted[i] for i in expected] == sorted(admitted)
  assert np.all(np.diff(_admitted(dp.run(requests, admission="fcfs"), requests)) >= 0)
