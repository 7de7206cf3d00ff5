"""A queue of plain greedy requests runs a loop with no sampler `lax.cond` (issue 11).

The sampler's `lax.cond` ("does any row sample, penalise or want logprobs?") costs
a host synchronisation per step on a GPU. `Engine.run` serves a queue whose
requests are all plain greedy with `serve_loop(greedy=True)`: argmax tokens, no
conditional in the compiled loop, the same tokens as the general loop.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.admission import plain_greedy
from jaxkv.serve.state import init_loop_state, pack_queue


@pytest.fixture(scope="module")
def model():
  config = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=8)
  return Decoder(config, config.cache_config(capacity=64, max_seqs=4, max_write=8),
                 rngs=nnx.Rngs(0))


def _requests(n, **params):
  rng = np.random.default_rng(1)
  return [serve.Request(tuple(int(t) for t in rng.integers(0, 64, int(rng.integers(2, 9)))),
                        serve.SamplingParams(max_tokens=int(rng.integers(2, 8)), n=1 + i % 2,
                                             **params))
          for i in range(n)]


@pytest.mark.parametrize("params, plain", [
    ({}, True), ({"top_k": 5, "top_p": 0.5, "min_p": 0.1}, True),   # ignored at temperature 0
    ({"temperature": 0.7}, False), ({"repetition_penalty": 1.2}, False),
    ({"presence_penalty": 0.5}, False), ({"frequency_penalty": -0.5}, False),
    ({"logprobs": 0}, False)])
def test_plain_greedy_names_the_requests_whose_token_is_the_argmax(params, plain):
  assert plain_greedy(serve.SamplingParams(**params)) is plain


def _conditionals(engine, greedy, requests):
  queue = pack_queue([r.prompt for r in requests], [r.params for r in requests],
                     max_len=engine.max_len, max_stop=engine.max_stop)
  ls = init_loop_state(engine.config, queue, num_widths=len(engine.widths))
  text = engine.lower(ls, 1, greedy=greedy).as_text()
  return text.count("stablehlo.case") + text.count("stablehlo.if")


def test_greedy_queue_runs_the_loop_without_the_sampler_cond(model, monkeypatch):
  requests = _requests(6)
  engine = serve.Engine(model, max_len=32)
  assert _conditionals(engine, False, requests) > 0       # the sampler's cond
  assert _conditionals(engine, True, requests) == 0
  # pylint: disable=protected-access
  used = []
  for name in ("_loop", "_greedy_loop"):
    jitted = getattr(engine.core, name)
    monkeypatch.setattr(engine.core, name, lambda *a, _j=jitted, _n=name: used.append(_n) or _j(*a))
  greedy = engine.run(requests)
  assert set(used) == {"_greedy_loop"}
  # One seeded request in the queue: the general loop; the greedy requests' tokens agree.
  mixed = engine.run(requests + _requests(1, temperature=1.0, seed=3))
  assert used[-1] == "_loop"
  assert [(c.request_id, c.index, c.tokens) for c in mixed[:len(greedy)]] == [
      (c.request_id, c.index, c.tokens) for c in greedy]
