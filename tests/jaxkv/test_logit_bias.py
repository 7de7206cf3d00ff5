"""`SamplingParams.logit_bias` (OpenAI's per-token biases, added before the penalties) and
`allowed_token_ids` (vLLM's: only these tokens, masked before the bias).

The oracle decodes on the host (`ModelRunner`, one step at a time, not the serving loop):
the argmax of the logits (restricted to the allowed tokens) plus the biases, then the
repetition penalty, and the raw distribution's logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.decoding import feed
from jaxkv.serve.requests import MAX_LOGIT_BIAS

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def model():
  return Decoder(MODEL, MODEL.cache_config(capacity=160, max_seqs=4, max_write=8),
                 rngs=nnx.Rngs(1))


def _biased(raw, bias, seen, rep, bias_first=True):
  x = raw.copy()
  if bias_first:   # vLLM's order: logits processors (the bias), then penalties
    for t, b in bias.items():
      x[t] += b
  for t in seen:
    x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
  if not bias_first:
    for t, b in bias.items():
      x[t] += b
  return x


def _oracle(model, prompt, max_new, bias, rep=1.0, allowed=None):
  runner = serve.ModelRunner(model)
  s = runner.seq_new()
  logits = feed(runner, {s: list(prompt)})[s][-1]
  tokens, lps = [], []
  for _ in range(max_new):
    raw = np.array(logits, np.float64)
    x = _biased(raw, bias, set(prompt) | set(tokens), rep)
    if allowed is not None:
      x = np.where(np.isin(np.arange(len(x)), list(allowed)), x, -np.inf)
    tok = int(np.argmax(x))
    tokens.append(tok)
    lps.append((raw - raw.max() - np.log(np.exp(raw - raw.max()).sum()))[tok])
    logits = feed(runner, {s: [tok]})[s][-1]
  runner.seq_rm(s)
  return tokens, lps


def test_biased_greedy_decoding_equals_the_host_oracle(model):
  engine = serve.Engine(model, max_len=40)
  prompt = (3, 17, 5, 9)
  free, = engine.run([serve.Request(prompt, serve.SamplingParams(max_tokens=8))])
  cases = {"force": {11: 100.0}, "ban": {free.tokens[0]: -100.0, free.tokens[1]: -100.0},
           "nudge": {t: 1.5 for t in (2, 7, 30, 41)} | {free.tokens[2]: -2.0},
           "with_penalty": {free.tokens[0]: -3.0, 20: 2.5}}
  requests = [serve.Request(prompt, serve.SamplingParams(
      max_tokens=8, logit_bias=bias, logprobs=0,
      repetition_penalty=1.3 if name == "with_penalty" else 1.0), name)
      for name, bias in cases.items()]
  got = {c.request_id: c for c in engine.run(requests)}
  for name, bias in cases.items():
    want, lps = _oracle(model, prompt, 8, bias, rep=1.3 if name == "with_penalty" else 1.0)
    assert got[name].tokens == want, name
    np.testing.assert_allclose([e.logprob for e in got[name].logprobs], lps, atol=1e-4)
  assert got["force"].tokens == [11] * 8 and got["ban"].tokens[0] != free.tokens[0]
  assert got["nudge"].tokens != free.tokens   # the oracle agrees: the biases changed something


def test_a_large_bias_decides_a_sampled_request_and_each_fork(model):
  engine = serve.Engine(model, max_len=40)
  done = engine.run([serve.Request((1, 2), serve.SamplingParams(
      max_tokens=6, temperature=1.0, seed=3, n=3, logit_bias={42: 100}))])
  assert [c.tokens for c in done] == [[42] * 6] * 3


@pytest.mark.parametrize("bias, error, fragment", [
    ({"1": 1.0}, TypeError, "logit_bias token='1' must be an int"),
    ({1: 101}, ValueError, r"logit_bias\[1\]=101.0 must be in \[-100, 100\]"),
    ({-1: 1}, ValueError, "logit_bias token -1 must be >= 0"),
    ({1: float("nan")}, ValueError, r"logit_bias\[1\]=nan must be finite"),
    ({t: 1 for t in range(MAX_LOGIT_BIAS + 1)}, ValueError, "at most MAX_LOGIT_BIAS"),
    ("12", TypeError, "must map token ids to biases"),
])
def test_bad_logit_bias_is_refused_naming_it(bias, error, fragment):
  with pytest.raises(error, match=fragment):
    serve.SamplingParams(logit_bias=bias)


def test_a_token_past_the_vocabulary_is_refused_before_anything_runs(model):
  engine = serve.Engine(model, max_len=40)
  with pytest.raises(ValueError, match="logit_bias token 64 must be < vocab_size=64"):
    engine.add_request(serve.Request((1, 2), serve.SamplingParams(logit_bias={3: 1, 64: 1}), "x"))
  assert engine.counts() == (0, 0) and not engine.has_unfinished()


def test_the_bias_comes_before_the_repetition_penalty(model):
  """A bias that lifts a prompt token's negative logit past zero: divided by the penalty when
  the bias comes first (vLLM's order), multiplied when it comes last; a bias is chosen
  where the two orders pick different tokens, and the engine picks the first order's."""
  engine = serve.Engine(model, max_len=40)
  prompt, rep = (3, 17, 5, 9), 2.0
  runner = serve.ModelRunner(model)
  s = runner.seq_new()
  raw = np.array(feed(runner, {s: list(prompt)})[s][-1], np.float64)
  pick = None
  for t in prompt:
    for b in np.linspace(0.5, 12.0, 47):
      first = int(np.argmax(_biased(raw, {t: b}, set(prompt), rep)))
      last = int(np.argmax(_biased(raw, {t: b}, set(prompt), rep, bias_first=False)))
      if first != last:
        pick = (t, float(b), first)
        break
    if pick:
      break
  assert pick, "no bias separates the two orders for this model"
  t, b, want = pick
  done, = engine.run([serve.Request(prompt, serve.SamplingParams(
      max_tokens=1, logit_bias={t: b}, repetition_penalty=rep))])
  assert done.tokens == [want]


def test_allowed_token_ids_restricts_greedy_and_sampled_requests(model):
  engine = serve.Engine(model, max_len=40)
  prompt = (3, 17, 5, 9)
  free, = engine.run([serve.Request(prompt, serve.SamplingParams(max_tokens=6))])
  allowed = (2, 30, 41, free.tokens[1])
  cases = {"only": ({}, 1.0), "biased": ({30: -3.0, 41: 2.0, 50: 100.0}, 1.0),
           "penalised": ({}, 1.8)}
  got = {c.request_id: c for c in engine.run([
      serve.Request(prompt, serve.SamplingParams(max_tokens=6, allowed_token_ids=allowed,
                                                 logit_bias=bias, repetition_penalty=rep,
                                                 logprobs=0), name)
      for name, (bias, rep) in cases.items()])}
  for name, (bias, rep) in cases.items():
    want, lps = _oracle(model, prompt, 6, bias, rep=rep, allowed=allowed)
    assert got[name].tokens == want, name
    np.testing.assert_allclose([e.logprob for e in got[name].logprobs], lps, atol=1e-4)
  assert 50 not in got["biased"].tokens   # a bias cannot bring back a token outside the set
  sampled = engine.run([serve.Request((1, 2), serve.SamplingParams(
      max_tokens=8, temperature=1.5, seed=5, n=3, allowed_token_ids=[4, 9]))])
  assert all(set(c.tokens) <= {4, 9} for c in sampled)
  assert {t for c in sampled for t in c.tokens} == {4, 9}   # both drawn: not one forced


@pytest.mark.parametrize("allowed, error, fragment", [
    ([], ValueError, "allows no token"),
    ([-1], ValueError, "must be >= 0"),
    (list(range(MAX_LOGIT_BIAS + 1)), ValueError, "at most MAX_LOGIT_BIAS"),
    ("12", TypeError, "allowed_token_ids"),
])
def test_bad_allowed_token_ids_are_refused_naming_them(allowed, error, fragment):
  with pytest.raises(error, match=fragment):
    serve.SamplingParams(allowed_token_ids=allowed)


def test_an_allowed_token_past_the_vocabulary_is_refused(model):
  engine = serve.Engine(model, max_len=40)
  with pytest.raises(ValueError, match="allowed_token_ids holds 64, which must be < vocab_size"):
    engine.add_request(serve.Request((1,), serve.SamplingParams(allowed_token_ids=[1, 64])))
  assert engine.counts() == (0, 0)
