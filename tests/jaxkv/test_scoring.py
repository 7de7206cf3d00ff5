"""`PromptScorer`: prompt-token logprobs from the engine's model on a cache of the scorer's own.

Cross-checked against the engine's serving loop: the tokens a greedy request generates,
scored as a prompt, get the logprobs (and top k) the loop reported for them. The model has
a ring (sliding-window) layer, and the prompt runs in steps narrower than the window and
wider, so chunking and the ring's wrap are covered. (The float64 oracle is in the server
tests: `test_openai_compat`, `test_lm_eval`.)
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.scoring import PromptScorer

MODEL = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           layer_types=("sliding", "full"), num_heads=2, num_kv_heads=1,
                           head_dim=16, sliding_window=4, query_pre_attn_scalar=16.0)
MAX_LEN = 40


@pytest.fixture(scope="module")
def engine():
  cache = MODEL.cache_config(capacity=160, max_seqs=4, max_write=8)
  return serve.Engine(Decoder(MODEL, cache, rngs=nnx.Rngs(0)), max_len=MAX_LEN, max_logprobs=4)


def test_a_generated_continuation_scores_as_the_loop_reported_it(engine):
  prompt = (3, 17, 5, 40, 22, 9, 31)
  done, = engine.run([serve.Request(prompt, serve.SamplingParams(max_tokens=20, logprobs=3))])
  whole = list(prompt) + list(done.tokens)
  for width in (1, 3, 8):   # narrower than the window, across it, the engine's W
    scored = PromptScorer(engine, width=width).score(whole, k=3)
    assert [s.token for s in scored] == whole[1:]
    tail = scored[len(prompt) - 1:]
    np.testing.assert_allclose([s.logprob for s in tail], [e.logprob for e in done.logprobs],
                               atol=1e-5)
    for s, e in zip(tail, done.logprobs):
      assert [t for t, _ in s.top] == [t for t, _ in e.top]
      np.testing.assert_allclose([v for _, v in s.top], [v for _, v in e.top], atol=1e-5)
      assert s.rank == 1   # greedy: each generated token was the most likely


def test_ranks_count_the_more_likely_tokens_and_top_k_is_sorted(engine):
  scorer = PromptScorer(engine)
  scored = scorer.score([1, 2, 3, 4, 5, 6], k=4)
  assert len(scored) == 5
  for s in scored:
    values = [v for _, v in s.top]
    assert values == sorted(values, reverse=True) and len(values) == 4
    better = sum(v > s.logprob for v in values)
    assert s.rank == better + 1 or (s.rank > 4 and better == 4)
  assert scorer.score([7], k=2) == [] and scorer.score([7, 8], k=0)[0].top == ()


@pytest.mark.parametrize("tokens, k, fragment", [
    ([], 1, "1 to max_len=40"),
    (list(range(1, 42)), 1, "41 tokens; scoring takes 1 to max_len=40"),
    ([1, 64], 1, "token 64 is outside the vocabulary"),
    ([1, 2], -1, "k=-1 must be an int"),
    ([1, 2], 65, "k=65 must be an int"),
    ([1, 2], True, "k=True must be an int"),
])
def test_bad_input_is_refused_and_the_scorer_still_serves(engine, tokens, k, fragment):
  scorer = PromptScorer(engine, width=4)
  before = scorer.score([1, 2, 3], k=1)
  with pytest.raises(ValueError, match=fragment):
    scorer.score(tokens, k)
  again = scorer.score([1, 2, 3], k=1)
  assert [(s.token, s.rank, s.top[0][0]) for s in again] == [(s.token, s.rank, s.top[0][0])
                                                              for s in before]
  np.testing.assert_allclose([s.logprob for s in again], [s.logprob for s in before], atol=1e-6)
  with pytest.raises(ValueError, match="width=0 must be an int"):
    PromptScorer(engine, width=0)
