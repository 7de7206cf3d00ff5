"""min_p, penalties and logprobs through the engine: `run`, forks, the incremental API, validation.

The oracle decodes on the host with a `ModelRunner` (one sequence, plain
NumPy penalties and `log_softmax`), sharing no code with the loop's sampler.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve import live
from jaxkv.serve.decoding import feed

MODEL = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           layer_types=("sliding", "full"), num_heads=2, num_kv_heads=1,
                           head_dim=16, sliding_window=4, query_pre_attn_scalar=16.0)
MAX_LEN = 40


@pytest.fixture(scope="module")
def model():
  cache = MODEL.cache_config(capacity=160, max_seqs=4, max_write=8)
  return Decoder(MODEL, cache, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def engine(model):
  return serve.Engine(model, max_len=MAX_LEN, max_logprobs=6)


def _host_oracle(model, prompt, max_new, *, rep=1.0, pres=0.0, freq=0.0, top=0):
  """Greedy decoding with penalties on the host; `(tokens, [(logprob, top ids, top lps)])`."""
  runner = serve.ModelRunner(model)
  s = runner.seq_new()
  logits = feed(runner, {s: list(prompt)})[s][-1]
  tokens, lps = [], []
  for i in range(max_new):
    x = np.array(logits, np.float64)
    for t in set(prompt) | set(tokens):
      x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in collections.Counter(tokens).items():
      x[t] -= freq * c + pres
    tok = int(np.argmax(x))
    raw = np.array(logits, np.float64)
    raw = raw - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    order = np.argsort(-raw, kind="stable")[:top]
    lps.append((raw[tok], order, raw[order]))
    tokens.append(tok)
    if i + 1 < max_new:
      logits = feed(runner, {s: [tok]})[s][-1]
  runner.seq_rm(s)
  return tokens, lps


def _assert_logprobs(got, want, n):
  assert len(got) == len(want)
  for g, (lp, ids, top) in zip(got, want):
    assert g.logprob == pytest.approx(lp, abs=1e-4)
    assert [i for i, _ in g.top] == list(ids[:n])
    np.testing.assert_allclose([v for _, v in g.top], top[:n], atol=1e-4)


def test_greedy_with_penalties_and_logprobs_matches_the_host_oracle(model, engine, rng):
  prompts = [tuple(int(t) for t in rng.integers(0, 64, size=k)) for k in (5, 9, 3, 7)]
  cases = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5, frequency_penalty=0.7,
                                              logprobs=3),
           dict(repetition_penalty=0.6, frequency_penalty=-0.5, logprobs=6), dict(logprobs=0)]
  requests = [serve.Request(p, serve.SamplingParams(max_tokens=12, **c))
              for p, c in zip(prompts, cases)]
  done = engine.run(requests)
  plain = engine.run([serve.Request(p, serve.SamplingParams(max_tokens=12)) for p in prompts])
  for c, p, d, g in zip(cases, prompts, done, plain):
    tokens, lps = _host_oracle(model, p, 12, rep=c.get("repetition_penalty", 1.0),
                               pres=c.get("presence_penalty", 0.0),
                               freq=c.get("frequency_penalty", 0.0), top=6)
    assert d.tokens == tokens, c
    if "logprobs" in c:
      _assert_logprobs(d.logprobs, lps, c["logprobs"])
      assert all(len(t.top) == c["logprobs"] for t in d.logprobs)
    else:
      assert d.logprobs is None
  assert done[0].tokens != plain[0].tokens and done[1].tokens != plain[1].tokens
  assert done[3].tokens == plain[3].tokens   # logprobs alone never change the tokens


def _sampled_oracle(model, prompt, max_new, *, seed, n):
  """`n` samples at temperature 1 on the host: `categorical` over a `ModelRunner`'s logits with
  the documented key `fold_in(fold_in(key(seed), i), t)` for sample `i`'s token `t`."""
  runner = serve.ModelRunner(model)
  out = []
  for i in range(n):
    s = runner.seq_new()
    logits = feed(runner, {s: list(prompt)})[s][-1]
    tokens = []
    for t in range(max_new):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), t)
      tokens.append(int(jax.random.categorical(key, jnp.asarray(logits, jnp.float32))))
      if t + 1 < max_new:
        logits = feed(runner, {s: [tokens[-1]]})[s][-1]
    runner.seq_rm(s)
    out.append(tokens)
  return out


def test_every_forked_sample_draws_with_its_own_key(model, engine):
  """n=4 samples of one prompt (forked from its prefill): sample i's tokens are the host's
  draws with sample i's key, so no two siblings share a key (then they would be equal).
  logprobs=0 (which changes no token) gives `_target`'s queue shapes: no new compile."""
  request = serve.Request((5, 17, 3, 40, 22, 9), serve.SamplingParams(
      max_tokens=8, temperature=1.0, seed=23, n=4, logprobs=0))
  got = [c.tokens for c in engine.run([request])]
  assert len({tuple(t) for t in got}) == 4
  assert got == _sampled_oracle(model, request.prompt, 8, seed=23, n=4)


def _target():
  return serve.Request((5, 17, 3, 40, 22), serve.SamplingParams(
      max_tokens=14, temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
      presence_penalty=0.3, frequency_penalty=0.2, logprobs=4, seed=11, n=2),
      request_id="target")


def _mix():
  p = serve.SamplingParams
  return [serve.Request((1, 2, 3), p(max_tokens=9), "a"),
          serve.Request((9, 8), p(max_tokens=6, temperature=1.5, seed=2, logprobs=2, n=2), "b"),
          _target(),
          serve.Request((30, 31, 32, 33), p(max_tokens=12, temperature=0.5, min_p=0.3,
                                            repetition_penalty=1.5, seed=3), "c"),
          serve.Request((7,) * 9, p(max_tokens=5, frequency_penalty=1.0, logprobs=6), "d")]


def _by_sample(completions, rid):
  return {c.index: c for c in completions if c.request_id == rid}


def test_a_request_alone_and_in_a_mix_gets_the_same_tokens_and_logprobs(engine):
  alone = _by_sample(engine.run([_target()]), "target")
  mixed = _by_sample(engine.run(_mix()), "target")
  assert alone[0].tokens != alone[1].tokens   # two samples of one seed differ
  for j in (0, 1):
    assert mixed[j].tokens == alone[j].tokens
    assert [t.token for t in mixed[j].logprobs] == mixed[j].tokens
    for a, b in zip(alone[j].logprobs, mixed[j].logprobs):
      assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
      assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_incremental_api_streams_the_same_tokens_and_logprobs(engine, monkeypatch):
  """Deltas equal `run`'s completions, also when the logprob window (here 4) wraps many times."""
  monkeypatch.setattr(live, "LOGPROB_WINDOW", 4)
  expected = {(c.request_id, c.index): c for c in engine.run(_mix())}
  engine.run([])   # drops the old incremental queue: the next one reads the patched window
  ids = [engine.add_request(r) for r in _mix()]
  got = collections.defaultdict(lambda: ([], []))
  for d in engine.stream(max_steps=50):   # capped to 4 steps per entry while logprobs run
    tokens, lps = got[(d.request_id, d.index)]
    tokens.extend(d.tokens)
    if d.logprobs is not None:
      assert len(d.logprobs) == len(d.tokens)
      lps.extend(d.logprobs)
  assert engine._live.logprob_window == 4   # pylint: disable=protected-access
  assert ids == ["a", "b", "target", "c", "d"] and set(got) == set(expected)
  for key, c in expected.items():
    tokens, lps = got[key]
    assert tokens == c.tokens, key
    if c.logprobs is None:
      assert not lps
      continue
    assert [t.token for t in lps] == tokens
    for a, b in zip(lps, c.logprobs):
      assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
      assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_an_aborted_request_with_logprobs_reports_empty_logprobs(engine):
  rid = engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=20,
                                                                         logprobs=2)))
  first = engine.step(max_steps=2)
  assert first and all(len(d.logprobs) == len(d.tokens) > 0 for d in first)
  assert engine.abort(rid)
  [last] = engine.step()
  assert (last.finish_reason, last.tokens, last.logprobs) == ("abort", (), ())


@pytest.mark.parametrize("field, value, error, match", [
    ("min_p", 1.5, ValueError, r"min_p=1.5 must be in \[0.0, 1.0\]"),
    ("min_p", "0.1", TypeError, "min_p='0.1' must be a real number"),
    ("repetition_penalty", 0.0, ValueError, "repetition_penalty=0.0 must be > 0"),
    ("repetition_penalty", float("inf"), ValueError, "repetition_penalty=inf must be finite"),
    ("presence_penalty", -2.5, ValueError, r"presence_penalty=-2.5 must be in \[-2.0, 2.0\]"),
    ("frequency_penalty", 2.01, ValueError, r"frequency_penalty=2.01 must be in"),
    ("frequency_penalty", True, TypeError, "frequency_penalty=True must be a real number"),
    ("logprobs", -1, ValueError, "logprobs=-1 must be >= 0"),
    ("logprobs", 2.0, TypeError, "logprobs=2.0 must be an int"),
    ("logprobs", True, TypeError, "logprobs=True must be an int"),
])
def test_sampling_params_refuse_bad_values(field, value, error, match):
  with pytest.raises(error, match=match):
    serve.SamplingParams(**{field: value})


def test_engine_refuses_more_logprobs_than_it_holds_naming_the_request(engine):
  bad = serve.Request((1, 2), serve.SamplingParams(logprobs=7), request_id="r1")
  with pytest.raises(ValueError, match=r"request 'r1': logprobs=7 must be <= max_logprobs=6"):
    engine.run([serve.Request((3,)), bad])
  with pytest.raises(ValueError, match=r"request 'r1': logprobs=7"):
    engine.add_request(bad)
  assert not engine.has_unfinished()   # refused: nothing queued
  with pytest.raises(ValueError, match=r"max_logprobs=65 must be in \[0, vocab_size=64\]"):
    serve.Engine(_decoder(), max_len=MAX_LEN, max_logprobs=65)
  with pytest.raises(TypeError, match="max_logprobs=2.5 must be an int"):
    serve.Engine(_decoder(), max_len=MAX_LEN, max_logprobs=2.5)


def _decoder():
  cache = MODEL.cache_config(capacity=160, max_seqs=4, max_write=8)
  return Decoder(MODEL, cache, rngs=nnx.Rngs(1))
