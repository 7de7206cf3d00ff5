"""Prefix caching over paged storage (issue 13 item 5): `Engine(..., prefix_cache=True)`.

Oracle: the column engine, which caches nothing. Adopted pages must change no
token; the counters must account for every prompt token (computed or adopted).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve import paged_claims

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)
MAX_SEQS, WIDTH, MAX_LEN, CAPACITY, PAGE = 4, 8, 32, 160, 4
ENGINE = dict(max_len=MAX_LEN, widths=(WIDTH,))


def _model(page_size=None):
  cache = MODEL.cache_config(capacity=CAPACITY, max_seqs=MAX_SEQS, max_write=WIDTH)
  return Decoder(MODEL, dataclasses.replace(cache, page_size=page_size), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def models():
  return _model(), _model(PAGE)


def _tokens(completions):
  return {(c.request_id, c.index): (c.tokens, c.finish_reason) for c in completions}


def _shared(rng, system_len, count, n=1):
  system = tuple(int(t) for t in rng.integers(0, 64, system_len))
  return [serve.Request(system + tuple(int(t) for t in rng.integers(0, 64, 1 + i % 5)),
                        serve.SamplingParams(max_tokens=3 + i % 4, temperature=0.8 * (i % 2),
                                             seed=i, n=n), request_id=i) for i in range(count)]


def test_page_hashes_chain():
  """A page's key covers every token before it: a change reaches it and every later page."""
  tokens = jnp.arange(16, dtype=jnp.int32)
  base = np.asarray(paged_claims.page_hashes(tokens, 4, 4))
  late = np.asarray(paged_claims.page_hashes(tokens.at[9].set(60), 4, 4))
  early = np.asarray(paged_claims.page_hashes(tokens.at[0].set(60), 4, 4))
  assert (late[:2] == base[:2]).all() and (late[2:] != base[2:]).all()
  assert (early != base).all() and len(set(base.tolist())) == 4


def test_a_shared_system_prompt_is_prefilled_once(models, rng):
  """Eight requests (two samples each) behind a 16-token system prompt: the burst waits for
  the first prefill, then every request adopts its four pages; tokens equal the columns'."""
  columns, paged = models
  requests = _shared(rng, 16, 8, n=2)
  plain = serve.Engine(columns, **ENGINE)
  want = _tokens(plain.run(requests))
  engine = serve.Engine(paged, prefix_cache=True, **ENGINE)
  assert _tokens(engine.run(requests)) == want
  stats = engine.stats
  assert stats.preemptions == 0
  # Every token the columns computed was either computed here or adopted.
  assert stats.step_tokens + stats.cached_tokens == plain.stats.step_tokens
  # All but the first request adopt the 16 system tokens (forks share them already).
  assert stats.cached_tokens >= 7 * 16


def test_eviction_under_pressure(models, rng):
  """Distinct prefixes, four columns: retained prefixes take the free columns and are
  evicted least recently used; a repeated prefix is adopted until evicted. Exact tokens."""
  columns, paged = models
  groups = [_shared(np.random.default_rng(g), 8, 3) for g in range(4)]
  requests = [dataclasses.replace(r, request_id=(g, r.request_id))
              for g, group in enumerate(groups) for r in group]
  requests += [dataclasses.replace(r, request_id=("again", r.request_id)) for r in groups[3]]
  want = _tokens(serve.Engine(columns, **ENGINE).run(requests))
  engine = serve.Engine(paged, prefix_cache=True, **ENGINE)
  assert _tokens(engine.run(requests)) == want
  assert engine.stats.evictions > 0 and engine.stats.cached_tokens > 0


def test_a_hash_collision_costs_a_miss_not_a_wrong_page(models, rng, monkeypatch):
  """Every page key equal (a total collision): matches are confirmed token by token, so no
  foreign page is adopted and the tokens stay exact; true matches are still found."""
  columns, paged = models
  monkeypatch.setattr(paged_claims, "page_hashes",
                      lambda tokens, num, size: jnp.zeros((num,), jnp.uint32))
  requests = _shared(rng, 8, 4) + [
      serve.Request(tuple(int(t) for t in rng.integers(0, 64, 14)), request_id=f"other{i}")
      for i in range(3)]
  want = _tokens(serve.Engine(columns, **ENGINE).run(requests))
  # Other widths than the module's other engines: a fresh compile that sees the patch.
  engine = serve.Engine(paged, prefix_cache=True, max_len=MAX_LEN, widths=(WIDTH, 4))
  # Queue order: the shared requests come first and follow each other, so at least three
  # of them find the first one's pages (longest-first would admit the others first).
  assert _tokens(engine.run(requests, admission="fcfs")) == want
  assert engine.stats.cached_tokens >= 3 * 8


def test_prefixes_persist_across_incremental_requests(models, rng):
  """The incremental API keeps its cache: a request arriving after another finished adopts
  the pages that one left behind."""
  _, paged = models
  first, second = _shared(rng, 12, 2)
  engine = serve.Engine(paged, prefix_cache=True, **ENGINE)
  engine.add_request(first)
  list(engine.stream())
  assert engine.stats.cached_tokens == 0
  engine.add_request(second)
  got = [d for d in engine.stream()]
  assert engine.stats.cached_tokens == 12
  want = _tokens(serve.Engine(paged, **ENGINE).run([second]))
  assert [t for d in got for t in d.tokens] == want[(second.request_id, 0)][0]


def test_a_repeated_prompt_of_whole_pages_adopts_all_but_its_last_page(models, rng):
  """Prompts of 8 and 12 tokens (whole pages) and 7 and 9 (a page +- 1), each sent twice in a
  row: the repeat adopts its twin's full pages but keeps at least one prompt token to feed
  (adopting a whole prompt leaves nothing to prefill, and the step fails with EMPTY). Tokens
  equal the columns', which cache nothing. The last request forks (n=2) so the output rows
  pad to the shared-prompt test's 16: the same compiled shapes."""
  columns, paged = models
  prompts = [tuple(int(t) for t in rng.integers(0, 64, k)) for k in (8, 7, 9, 12)]
  requests = [serve.Request(prompts[i // 2], serve.SamplingParams(
      max_tokens=3 + i % 4, temperature=0.8 * (i % 2), seed=i, n=1 + i // 7), request_id=i)
              for i in range(8)]
  want = _tokens(serve.Engine(columns, **ENGINE).run(requests))
  engine = serve.Engine(paged, prefix_cache=True, **ENGINE)
  assert _tokens(engine.run(requests, admission="fcfs")) == want
  # Each repeat adopts (len - 1) // 4 full pages of its twin: 1, 1, 2 and 2.
  assert engine.stats.cached_tokens >= 4 * (1 + 1 + 2 + 2), engine.stats
