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


def test_async_engine_over_a_data_parallel_group_streams_what_one_engine_returns():
  """`AsyncEngine(DataParallelEngine)`: each request goes to the least busy engine, ids stay unique
  across the group, every stream equals one engine's completions, an abort reaches the engine
  serving the request, and the group's counters sum the engines'."""
  import asyncio   # pylint: disable=g-import-not-at-top
  devices = _devices(2)
  model = Decoder(MODEL, CACHE, rngs=nnx.Rngs(0), implementation=IMPL)
  requests = [serve.Request(tuple(range(1, 2 + i % 5)),
                            serve.SamplingParams(max_tokens=2 + i % 4, temperature=float(i % 2),
                                                 seed=i, n=1 + i % 2), request_id=f"r{i}")
              for i in range(6)]
  want = {(c.request_id, c.index): c.tokens for c in serve.Engine(model, max_len=32).run(requests)}
  dp = serve.DataParallelEngine(model, devices=devices, max_len=32)
  assert dp.capacity == 2 * CACHE.capacity and dp.max_len == 32

  async def main():
    aio = serve.AsyncEngine(dp, interval=2)
    try:
      ids = [aio.add_request(r) for r in requests]
      with pytest.raises(ValueError, match="already in flight"):
        aio.add_request(requests[0])   # an id in flight on another engine of the group
      unnamed = aio.add_request(serve.Request((1, 2), serve.SamplingParams(max_tokens=30)))
      owners = {aio._owner[rid] for rid in ids}   # pylint: disable=protected-access
      assert aio.abort(unnamed)   # 30 tokens: still in flight
      got = {}
      for rid in ids:
        async for d in aio.deltas(rid):
          got[(d.request_id, d.index)] = got.get((d.request_id, d.index), []) + list(d.tokens)
      aborted = [d.finish_reason async for d in aio.deltas(unnamed)]
      return got, owners, aborted
    finally:
      aio.close()

  got, owners, aborted = asyncio.run(main())
  assert got == want and owners == {0, 1} and aborted[-1] == "abort"
  assert dp.counts() == (0, 0) and dp.held == 0
  assert dp.stats.generated == sum(e.stats.generated for e in dp.engines) > 0
  assert dp.stats.aborted == 1


def test_build_engine_splits_the_devices_into_data_parallel_engines():
  """`build_engine(data_parallel_size=)`: one engine per device group, each sized alike; too many
  devices asked for is refused with the numbers, before anything is loaded."""
  import os   # pylint: disable=g-import-not-at-top
  from jaxkv.serve import loading   # pylint: disable=g-import-not-at-top
  fixture = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
  _devices(4)
  with pytest.raises(ValueError, match=r"tensor_parallel_size=3 x data_parallel_size=2 = 6 "
                                       r"devices; this host has \d+ local devices"):
    loading.build_engine(fixture, tensor_parallel_size=3, data_parallel_size=2, max_len=64)
  with pytest.raises(ValueError, match="data_parallel_size=0 must be >= 1"):
    loading.build_engine(fixture, data_parallel_size=0, max_len=64)
  served = loading.build_engine(fixture, data_parallel_size=2, max_len=64, max_seqs=2,
                                kv_cache_memory=1 << 20)
  group = served.engine
  assert isinstance(group, serve.DataParallelEngine) and len(group.engines) == 2
  assert [e.device for e in group.engines] == jax.devices()[:2]
  assert {e.config for e in group.engines} == {served.plan.cache_config}
  split = loading.build_engine(fixture, tensor_parallel_size=2, data_parallel_size=2, max_len=64,
                               max_seqs=2, kv_cache_memory=1 << 20).engine
  assert [e.mesh.devices.tolist() for e in split.engines] == [jax.devices()[:2],
                                                             jax.devices()[2:4]]


def test_every_engine_of_the_group_has_one_live_queue_its_threads_and_requests_share(
    monkeypatch):
  """An engine's LiveQueue is made on first use. Made slowly (here: a sleep in its
  constructor), a driver thread making one while the event loop makes another for the
  request it adds would leave that request unserved: each engine's queue is made before the
  threads start, so every request of the group is served."""
  import asyncio   # pylint: disable=g-import-not-at-top
  import time   # pylint: disable=g-import-not-at-top
  from jaxkv.serve import live as live_module   # pylint: disable=g-import-not-at-top
  devices = _devices(2)
  model = Decoder(MODEL, CACHE, rngs=nnx.Rngs(0), implementation=IMPL)
  dp = serve.DataParallelEngine(model, devices=devices, max_len=32)
  made = live_module.LiveQueue.__init__

  def slowly(self, *args, **kwargs):
    time.sleep(0.3)
    made(self, *args, **kwargs)
  monkeypatch.setattr(live_module.LiveQueue, "__init__", slowly)
  requests = [serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=3), request_id=f"q{i}")
              for i in range(4)]

  async def main():
    aio = serve.AsyncEngine(dp, interval=2)
    try:
      ids = [aio.add_request(r) for r in requests]   # the group alternates: both engines serve
      assert {aio._owner[rid] for rid in ids} == {0, 1}   # pylint: disable=protected-access

      async def one(rid):
        return [t async for d in aio.deltas(rid) for t in d.tokens]
      return await asyncio.wait_for(asyncio.gather(*(one(rid) for rid in ids)), timeout=60)
    finally:
      aio.close(timeout=30)

  got = asyncio.run(main())
  assert [len(tokens) for tokens in got] == [3] * 4
