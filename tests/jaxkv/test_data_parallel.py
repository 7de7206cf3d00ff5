"""`DataParallelEngine`: one engine per device, the same completions as one engine."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)
CACHE = MODEL.cache_config(capacity=160, max_seqs=3, max_write=8)
# float32 storage runs the reference attention: named, so a Hopper host does not warn of a fallback.
IMPL = "reference"


def _devices(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices (XLA_FLAGS forces them on CPU)")
  return jax.devices()[:n]


def test_data_parallel_equals_one_engine_and_uses_every_device():
  devices = _devices(2)
  model = Decoder(MODEL, CACHE, rngs=nnx.Rngs(0), implementation=IMPL)
  requests = [serve.Request(tuple(range(1, 2 + i % 5)),
                            serve.SamplingParams(max_tokens=2 + i % 4, temperature=float(i % 2),
                                                 seed=i, n=1 + i % 2))
              for i in range(7)]
  want = serve.Engine(model, max_len=32).run(requests)
  dp = serve.DataParallelEngine(model, devices=devices, max_len=32)
  got = dp.run(requests)
  assert [(c.request_id, c.index, c.tokens) for c in got] == [
      (c.request_id, c.index, c.tokens) for c in want]
  for engine in dp.engines:   # both served a share, each on its own device
    assert engine.stats.steps > 0
    assert engine.state.cache.k[0].devices() == {engine.device}
  assert dp.stats.generated == sum(len(c.tokens) for c in want)


def test_data_parallel_refuses_bad_input_before_serving():
  model = Decoder(MODEL, CACHE, rngs=nnx.Rngs(0), implementation=IMPL)
  dp = serve.DataParallelEngine(model, devices=_devices(2), max_len=32)
  with pytest.raises(ValueError, match="vocab_size"):
    dp.run([serve.Request((1,)), serve.Request((99,))])
  assert all(e.stats.steps == 0 for e in dp.engines)
  with pytest.raises(ValueError, match="mesh="):
    serve.DataParallelEngine(model, devices=_devices(2), mesh=None)
  with pytest.raises(ValueError, match="twice"):
    serve.DataParallelEngine(model, devices=[jax.devices()[0]] * 2)
