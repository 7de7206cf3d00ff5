"""Structured output in the engine: `SamplingParams(grammar=...)` through `Engine.run` and the
incremental API, on the Llama fixture (whose free text is gibberish, so only the constraint
can make an output valid).

Oracles: `jsonschema` and `re` judge the texts; the unconstrained greedy token at every
position comes from the model teacher-forced on a `ModelRunner` (not the jitted loop), and
what the grammar allows there from the automaton's host tables (not the device pool).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("outlines_core", reason="structured output needs outlines-core")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("tokenizers")

from jaxkv import serve  # noqa: E402
from jaxkv.models import hf  # noqa: E402
from jaxkv.serve.decoding import feed  # noqa: E402
from jaxkv.structured.automaton import AutomatonCache  # noqa: E402
from jaxkv.structured.vocab import token_bytes  # noqa: E402
from jaxkv.tokenizer import Tokenizer  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age"]}
REGEX = r"[A-Z][a-z]{2,4}-[0-9]{2}"
CHOICES = ["Paris", "London", "Rome"]
# A small pool: three of these automata never fit at once, so the incremental API must reuse
# and evict (every request still fits alone).
POOL = (160, 64, 6000)


@pytest.fixture(scope="module")
def setup():
  model, _, _ = hf.load_model(FIXTURE, capacity=2048, max_seqs=4, max_write=16)
  engine = serve.Engine(model, max_len=160, grammar_pool=POOL, max_steps=8)
  tok = Tokenizer.from_checkpoint(FIXTURE)
  vocab = token_bytes(tok)
  cache = AutomatonCache(vocab)
  return engine, tok, vocab, cache


def _text(vocab, tokens) -> str:
  return b"".join(vocab[t] for t in tokens if t != EOS).decode()


def _params(grammar, **kw):
  return serve.SamplingParams(**{"max_tokens": 120, "stop_tokens": (EOS,), "grammar": grammar}
                              | kw)


def _check(kind, value, text):
  if kind == "json":
    jsonschema.validate(json.loads(text), value)
  elif kind == "regex":
    assert re.fullmatch(value, text), text
  else:
    assert text in value


def test_run_outputs_match_their_grammar_greedy_sampled_and_forked(setup):
  engine, tok, vocab, cache = setup
  prompt = tuple(tok.encode("hello world"))
  specs = [("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES)]
  requests = []
  for kind, value in specs:
    g = cache.compile(kind, value)
    requests += [serve.Request(prompt, _params(g)),
                 serve.Request(prompt, _params(g, temperature=1.0, seed=3, n=2)),
                 serve.Request(prompt, _params(g, temperature=0.8, top_k=5, seed=9))]
  requests.append(serve.Request(prompt, serve.SamplingParams(max_tokens=20, stop_tokens=(EOS,))))
  out = engine.run(requests)
  by_request = {}
  for c in out:
    by_request.setdefault(c.request_id, []).append(c)
  for i, (kind, value) in enumerate(specs):
    for c in [c for r in range(3 * i, 3 * i + 3) for c in by_request[r]]:
      assert c.finish_reason == "stop" and c.tokens[-1] == EOS   # complete, then its stop token
      _check(kind, value, _text(vocab, c.tokens))
  samples = {_text(vocab, c.tokens) for c in by_request[1]}
  assert len(samples) == 2   # two forked samples, two keys
  # The unconstrained request beside them is not constrained: gibberish, not JSON.
  free = _text(vocab, by_request[len(requests) - 1][0].tokens)
  with pytest.raises(ValueError):
    json.loads(free)


def test_constrained_greedy_takes_the_free_greedy_token_wherever_it_is_allowed(setup):
  """At each position the free greedy token (the model teacher-forced on the constrained prefix
  through a ModelRunner) is drawn if the automaton allows it there; else the most likely
  allowed token, which never beats the free one."""
  engine, tok, vocab, cache = setup
  prompt = list(tok.encode("the capital of France is"))
  runner_model, _, _ = hf.load_model(FIXTURE, capacity=512, max_seqs=1, max_write=16)
  runner = serve.ModelRunner(runner_model)
  took_free = 0
  # The last grammar allows most of the vocabulary, so the free token is often allowed.
  for kind, value in (("json", SCHEMA), ("regex", REGEX), ("regex", r"[ -~]{3,9}")):
    g = cache.compile(kind, value)
    [c] = engine.run([serve.Request(tuple(prompt), _params(g))])
    seq = runner.seq_new()
    logits = feed(runner, {seq: prompt + list(c.tokens[:-1])})[seq]
    runner.seq_rm(seq)
    state = g.initial
    for i, token in enumerate(c.tokens):
      row = logits[len(prompt) - 1 + i]
      allowed = g.allowed(state) if state >= 0 else np.zeros(len(row), bool)
      if g.final[state] if state >= 0 else True:
        allowed = allowed.copy()
        allowed[EOS] = True
      free = int(np.argmax(row))
      if allowed[free]:
        assert token == free, (kind, i)
        took_free += 1
      else:
        assert allowed[token] and row[token] <= row[free]
        assert row[token] == pytest.approx(np.max(np.where(allowed, row, -np.inf)), abs=1e-4)
      state = g.step(state, token) if token != EOS else -1
    assert state == -1   # ended on the stop token, in a final state
  assert took_free > 0


def test_incremental_api_equals_run_and_reuses_the_small_pool(setup):
  """More distinct automata over time than the pool holds at once: the incremental API places,
  reuses and evicts them, and every output equals `Engine.run`'s for the same request."""
  engine, tok, vocab, cache = setup
  prompt = tuple(tok.encode("x"))
  specs = [("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES), ("regex", r"[0-9]{4}"),
           ("json", SCHEMA), ("choice", ["ab", "cd"])]
  requests = [serve.Request(prompt, _params(cache.compile(k, v), temperature=1.0, seed=i),
                            request_id=f"g{i}") for i, (k, v) in enumerate(specs)]
  want = {c.request_id: c.tokens for c in engine.run(requests)}
  got: dict = {}
  for r in requests:   # one at a time: each waits for room only as long as another runs
    engine.add_request(r)
  while engine.has_unfinished():
    for d in engine.step(8):
      got.setdefault(d.request_id, []).extend(d.tokens)
  assert {k: tuple(v) for k, v in got.items()} == {k: tuple(v) for k, v in want.items()}
  for (kind, value), r in zip(specs, requests):
    _check(kind, value, _text(vocab, got[r.request_id]))


def test_grammar_refusals_name_the_field_and_change_nothing(setup):
  engine, tok, _, cache = setup
  g = cache.compile("regex", REGEX)
  with pytest.raises(ValueError, match="grammar needs stop_tokens"):
    serve.SamplingParams(grammar=g)
  with pytest.raises(ValueError, match="grammar and min_tokens"):
    serve.SamplingParams(grammar=g, stop_tokens=(EOS,), min_tokens=1, max_tokens=4)
  with pytest.raises(ValueError, match="grammar and allowed_token_ids"):
    serve.SamplingParams(grammar=g, stop_tokens=(EOS,), allowed_token_ids=[5])
  with pytest.raises(TypeError, match="grammar=.* must be a jaxkv.structured TokenAutomaton"):
    serve.SamplingParams(grammar="[0-9]+", stop_tokens=(EOS,))
  big = cache.compile("json", {"type": "object", "properties": {
      f"k{i}": {"type": "string", "maxLength": 3} for i in range(12)}})
  assert big.num_states > POOL[0]
  before = engine.stats
  with pytest.raises(ValueError, match="grammar has .* states; the engine's grammar pool holds 160"):
    engine.run([serve.Request((5, 6), _params(big))])
  with pytest.raises(ValueError, match="grammar has .* states"):
    engine.add_request(serve.Request((5, 6), _params(big)))
  assert engine.stats is before and not engine.has_unfinished()
  # Together too many for one run: refused before anything is served.
  two = [cache.compile("json", SCHEMA), cache.compile("json", {"type": "array", "items": {
      "type": "string", "maxLength": 4}, "maxItems": 3})]
  if sum(a.num_states for a in two) > POOL[0]:
    with pytest.raises(ValueError, match="the requests' grammars hold"):
      engine.run([serve.Request((5,), _params(a)) for a in two])
    assert engine.stats is before
  with pytest.raises(ValueError, match="grammar_pool=.* must be"):
    serve.Engine(engine.core.graphdef and hf.load_model(FIXTURE, capacity=64, max_seqs=1,
                                                        max_write=8)[0], grammar_pool=(1, 0, 1))


def test_preempted_and_prefix_cached_requests_keep_their_grammar_state(setup):
  """Paged storage too small for four constrained requests at once: the latest admitted are
  preempted and recomputed, and shared prompt pages come from the prefix cache; every output
  equals the column engine's and matches its grammar."""
  engine, tok, vocab, cache = setup
  model, _, _ = hf.load_model(FIXTURE, capacity=96, max_seqs=4, max_write=16, page_size=8)
  paged = serve.Engine(model, max_len=96, grammar_pool=POOL, max_steps=8, prefix_cache=True)
  prompt = tuple(tok.encode("one prompt for all"))
  specs = [("json", SCHEMA), ("regex", REGEX), ("json", SCHEMA), ("choice", CHOICES)] * 2
  requests = [serve.Request(prompt, _params(cache.compile(k, v), temperature=0.9, seed=i,
                                            max_tokens=70), request_id=i)
              for i, (k, v) in enumerate(specs)]
  want = {c.request_id: c.tokens for c in engine.run(requests)}
  got = {c.request_id: c.tokens for c in paged.run(requests)}
  assert got == want
  assert paged.stats.preemptions > 0 and paged.stats.cached_tokens > 0
  for (kind, value), r in zip(specs, requests):
    _check(kind, value, _text(vocab, got[r.request_id][:-1]))
