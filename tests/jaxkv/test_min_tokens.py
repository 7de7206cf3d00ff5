"""`SamplingParams.min_tokens`: no stop token is drawn before that many new tokens.

The oracle decodes on the host (`ModelRunner`, one step at a time, not the serving loop):
the argmax with the stop tokens masked while fewer than `min_tokens` tokens exist, and the
logprobs of the raw distribution. Sampled requests and forked samples are checked by the
property itself (no stop token early), and each sample against the same request sent alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.decoding import feed

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)
MAX_LEN = 40


@pytest.fixture(scope="module")
def model():
  return Decoder(MODEL, MODEL.cache_config(capacity=160, max_seqs=4, max_write=8),
                 rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(model):
  return serve.Engine(model, max_len=MAX_LEN)


def _oracle(model, prompt, max_new, stops, min_tokens):
  """Greedy with `stops` masked before `min_tokens`; `(tokens, raw logprob of each)`."""
  runner = serve.ModelRunner(model)
  s = runner.seq_new()
  logits = feed(runner, {s: list(prompt)})[s][-1]
  tokens, lps = [], []
  while len(tokens) < max_new:
    x = np.array(logits, np.float64)
    raw = x - x.max() - np.log(np.exp(x - x.max()).sum())
    if len(tokens) < min_tokens:
      x[list(stops)] = -np.inf
    tok = int(np.argmax(x))
    tokens.append(tok)
    lps.append(raw[tok])
    if tok in stops:
      break
    logits = feed(runner, {s: [tok]})[s][-1]
  runner.seq_rm(s)
  return tokens, lps


def test_greedy_min_tokens_holds_the_stop_tokens_back_then_lets_them_stop(engine, model):
  prompt = (3, 17, 5)
  free, = engine.run([serve.Request(prompt, serve.SamplingParams(max_tokens=12))])
  # Stop at the first greedy token and at a later one: without min_tokens, one token.
  stops = (free.tokens[0], free.tokens[3])
  cases = [serve.Request(prompt, serve.SamplingParams(max_tokens=12, stop_tokens=stops,
                                                      min_tokens=k, logprobs=0), f"k{k}")
           for k in (0, 1, 4, 12)]
  got = {c.request_id: c for c in engine.run(cases)}
  for k in (0, 1, 4, 12):
    want, lps = _oracle(model, prompt, 12, stops, k)
    c = got[f"k{k}"]
    assert c.tokens == want, k
    assert not set(c.tokens[:k]) & set(stops)
    assert c.finish_reason == ("stop" if c.tokens[-1] in stops else "length")
    np.testing.assert_allclose([e.logprob for e in c.logprobs], lps, atol=1e-4)
  assert len(got["k0"].tokens) == 1 and len(got["k1"].tokens) > 1


def test_sampled_and_forked_samples_hold_back_their_stop_tokens(engine, model):
  params = dict(max_tokens=10, temperature=1.0, seed=7, n=3, min_tokens=6)
  probe = engine.run([serve.Request((9, 1), serve.SamplingParams(
      max_tokens=10, temperature=1.0, seed=7, n=3))])
  # Tokens these samples draw early without min_tokens: as stop tokens they would end them.
  stops = tuple(sorted({t for c in probe for t in c.tokens[:3]}))[:4]
  group = engine.run([serve.Request((9, 1), serve.SamplingParams(stop_tokens=stops, **params))])
  assert len(group) == 3
  for c in group:
    assert not set(c.tokens[:6]) & set(stops), (c.index, c.tokens, stops)
    assert len(c.tokens) >= 6
  # Each sample as the same request served alone, live, beside other work.
  live = serve.Engine(model, max_len=MAX_LEN)
  live.add_request(serve.Request((9, 1), serve.SamplingParams(stop_tokens=stops, **params), "g"))
  live.add_request(serve.Request((2, 2, 2), serve.SamplingParams(max_tokens=5), "other"))
  out = {}
  while live.has_unfinished():
    for d in live.step(3):
      out[(d.request_id, d.index)] = out.get((d.request_id, d.index), []) + list(d.tokens)
  assert [out[("g", c.index)] for c in group] == [c.tokens for c in group]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(max_tokens=4, min_tokens=5), "min_tokens=5 must be <= max_tokens=4"),
    (dict(min_tokens=-1), r"min_tokens=-1 must be in \[0, 2\*\*31\)"),
    (dict(min_tokens=1.5), "min_tokens"),
])
def test_bad_min_tokens_is_refused_naming_it(kwargs, fragment):
  with pytest.raises((ValueError, TypeError), match=fragment):
    serve.SamplingParams(**kwargs)


def test_min_tokens_with_stop_tokens_past_the_device_slots_is_refused_and_nothing_queued(model):
  engine = serve.Engine(model, max_len=MAX_LEN, max_stop_tokens=2)
  many = serve.SamplingParams(max_tokens=5, stop_tokens=(1, 2, 3), min_tokens=2)
  with pytest.raises(ValueError, match="min_tokens=2 with 3 stop_tokens; at most max_stop_tokens=2"):
    engine.add_request(serve.Request((4, 5), many, "x"))
  assert not engine.has_unfinished() and engine.counts() == (0, 0)
  # Without min_tokens the extra stop tokens are checked on the host, as before.
  engine.add_request(serve.Request((4, 5), serve.SamplingParams(max_tokens=5,
                                                                stop_tokens=(1, 2, 3)), "y"))
  assert engine.counts() == (0, 1)
