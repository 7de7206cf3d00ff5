"""Fronts over pipes: `EngineHost` steps the engine, `RemoteEngine` serves the app's calls.

In one process here (the pipes are real, the front's event loop is this test's): what a
request gets through the host and a front equals the request served alone; two fronts'
requests interleave and each front gets only its own; a front that leaves, or aborts,
frees what it held; a failure reaches the fronts whose requests it dropped; a request
the front's limits refuse never crosses the pipe. The spawned processes and the real
HTTP server are tests/server/test_fronts_server.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import threading
import time

import pytest
from flax import nnx

from live_utils import collect, random_requests
from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.errors import EngineError
from jaxkv.serve.hosting import EngineHost
from jaxkv.http.fronts import EngineView, RemoteEngine, engine_info

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def model():
  cache = MODEL.cache_config(capacity=160, max_seqs=4, max_write=8)
  return Decoder(MODEL, dataclasses.replace(cache, page_size=8), rngs=nnx.Rngs(0))


def _alone(model, requests):
  engine = serve.Engine(model, max_len=48)
  want = {}
  for r in requests:
    for c in engine.run([r]):
      want[(c.request_id, c.index)] = (c.tokens, c.finish_reason)
  return want


class _Hosted:
  """An engine behind an `EngineHost` on a thread, and `fronts` RemoteEngines over pipes."""

  def __init__(self, engine, fronts: int, **aio_args):
    pipes = [multiprocessing.Pipe() for _ in range(fronts)]
    self.host = EngineHost(engine, [a for a, _ in pipes], interval=4, **aio_args)
    self.thread = threading.Thread(target=self.host.serve, daemon=True)
    self.thread.start()
    info = engine_info(engine)
    self.fronts = [RemoteEngine(b, EngineView(info), front=i, fronts=fronts)
                   for i, (_, b) in enumerate(pipes)]

  def close(self):
    for f in self.fronts:
      f.close()
    self.thread.join(30)
    assert not self.thread.is_alive(), "the host did not stop after its fronts closed"


def _serve(client, requests):
  """Each request's deltas through `client`, as the app consumes them; {(rid, index): ...}
  keyed by the request's own id (the client's ids are its own)."""

  async def one(r):
    rid = client.add_request(r.replace(request_id=None))
    return r.request_id, [d async for d in client.deltas(rid)]

  async def main():
    return await asyncio.gather(*(one(r) for r in requests))

  got = {}
  for name, deltas in asyncio.run(main()):
    for (_, index), value in collect([dataclasses.replace(d, request_id=name)
                                      for d in deltas]).items():
      got[(name, index)] = value
  return got


@pytest.mark.parametrize("stepping", ["steps", "entries"])
def test_requests_through_two_fronts_are_each_served_alone(model, rng, stepping):
  requests = random_requests(rng, 8, sampled=stepping == "entries")
  engine = serve.Engine(model, max_len=48)
  hosted = _Hosted(engine, 2, stepping=stepping)
  try:
    results = [None, None]

    def front(i):   # each front's event loop on its own thread, as in its own process
      results[i] = _serve(hosted.fronts[i], requests[i::2])

    threads = [threading.Thread(target=front, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(300)
    got = results[0] | results[1]
    _wait_until_freed(engine)   # finished columns retire a step after their last read-back
  finally:
    hosted.close()
  assert got == _alone(model, requests)
  assert engine.held == 0 and not engine.has_unfinished()
  # Nothing kept per request, by the host or its AsyncEngine.
  assert not hosted.host._front_of and not hosted.host.aio._remaining
  # The fronts' views carry the engine's counters as of the last message each handled.
  for front in hosted.fronts:
    assert 0 < front.view.stats.generated <= engine.stats.generated


def test_a_front_that_leaves_or_aborts_frees_what_it_held(model):
  engine = serve.Engine(model, max_len=48)
  hosted = _Hosted(engine, 2, stepping="steps")
  long = serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=40))

  async def start_and_leave(client, abort):
    rid = client.add_request(long)
    gen = client.deltas(rid)
    first = await gen.__anext__()
    if abort:
      client.abort(rid)
      rest = [d async for d in gen]
      return first, rest
    await gen.aclose()   # a client that went away: the front aborts it
    return first, None

  try:
    first, rest = asyncio.run(start_and_leave(hosted.fronts[0], abort=True))
    assert first.tokens and rest[-1].finish_reason == "abort"
    first, _ = asyncio.run(start_and_leave(hosted.fronts[1], abort=False))
    assert first.tokens
    # Front 1 goes away with a request in flight: the host aborts it.
    asyncio.run(_start_only(hosted.fronts[1], long))
    hosted.fronts[1].close()
    _wait_until_freed(engine)   # the abort, then the retirement of its columns
    assert not engine.has_unfinished() and engine.held == 0
  finally:
    hosted.close()


def _wait_until_freed(engine, seconds: float = 20.0) -> None:
  deadline = time.monotonic() + seconds
  while (engine.has_unfinished() or engine.held) and time.monotonic() < deadline:
    time.sleep(0.05)


async def _start_only(client, request):
  rid = client.add_request(request)
  gen = client.deltas(rid)
  await gen.__anext__()   # it runs on the device now
  return rid


def test_a_refused_request_never_crosses_the_pipe(model):
  engine = serve.Engine(model, max_len=48)
  a, b = multiprocessing.Pipe()
  client = RemoteEngine(b, EngineView(engine_info(engine)))

  async def main():
    with pytest.raises(ValueError, match="max_tokens"):
      client.add_request(serve.Request((1, 2), serve.SamplingParams(max_tokens=400)))
    with pytest.raises(ValueError, match="vocab"):
      client.add_request(serve.Request((1, 99), serve.SamplingParams(max_tokens=2)))

  asyncio.run(main())
  assert not a.poll(0.2) and not client._boxes


def test_the_engines_process_going_away_ends_every_request_in_flight(model):
  engine = serve.Engine(model, max_len=48)
  a, b = multiprocessing.Pipe()
  client = RemoteEngine(b, EngineView(engine_info(engine)))

  async def main():
    rid = client.add_request(serve.Request((1, 2), serve.SamplingParams(max_tokens=4)))
    assert a.recv()[0] == "add"
    a.close()   # the host has gone
    with pytest.raises(EngineError, match="process has gone"):
      async for _ in client.deltas(rid):
        pass
    late = client.add_request(serve.Request((3,), serve.SamplingParams(max_tokens=2)))
    with pytest.raises(EngineError, match="process has gone"):
      async for _ in client.deltas(late):
        pass

  asyncio.run(main())


def test_a_failure_reaches_the_fronts_of_the_requests_it_dropped(model):
  engine = serve.Engine(model, max_len=48)
  pipes = [multiprocessing.Pipe() for _ in range(2)]
  host = EngineHost(engine, [p for p, _ in pipes], interval=4)
  host._front_of.update({10: 0, 11: 1, 12: 1})
  host.failed(RuntimeError("device lost"), [11, 12])
  kind, ids, text = pipes[1][1].recv()
  assert (kind, ids) == ("failed", [11, 12]) and "device lost" in text
  assert not pipes[0][1].poll(0.1)   # front 0's request was not dropped
  assert host._front_of == {10: 0}


def test_a_fronts_view_carries_what_metrics_reads_from_the_engine():
  """`/metrics` in a front process reads `EngineView.stats`; every counter it reads there comes
  across the pipe from the engine's own stats (the draft counters once did not: every step's
  metrics raised AttributeError in the front)."""
  import types   # pylint: disable=g-import-not-at-top
  from jaxkv.http.metrics import Metrics   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.hosting import status   # pylint: disable=g-import-not-at-top
  stats = serve.EngineStats(generated=50, preemptions=2, cached_tokens=7, compile_seconds=1.5,
                            seconds=4.5, draft_tokens=40, accepted_tokens=30)
  engine = types.SimpleNamespace(counts=lambda: (3, 1), waiting_tokens=9, held=12, stats=stats)
  view = EngineView({"capacity": 64, "max_len": 48,
                     "limits": {"vocab_size": 64, "grammar_room": 0}})
  view.update(status(engine))
  assert view.counts() == (3, 1) and (view.waiting_tokens, view.held) == (9, 12)
  for name in ("generated", "preemptions", "cached_tokens", "compile_seconds", "serve_seconds",
               "draft_tokens", "accepted_tokens", "acceptance_rate"):
    assert getattr(view.stats, name) == getattr(stats, name), name
  rendered = []
  for source in (engine, view):
    metrics = Metrics(capacity=64, model_name="m")
    metrics.after_step(source, [])
    rendered.append([l for l in metrics.render().decode().splitlines()
                     if l.startswith("jaxkv_") and "_created" not in l])
  assert rendered[0] == rendered[1]


def test_a_delta_crosses_the_pipe_whole():
  """Every field of a `Delta` survives `delta_row` / `from_row` (what the host sends a front),
  the ones equality ignores (timing, speculation) too."""
  from jaxkv.serve.hosting import delta_row, from_row   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.results import Delta, RequestTiming, Speculation, TokenLogprob   # pylint: disable=g-import-not-at-top
  fields = {f.name for f in dataclasses.fields(Delta)}
  timing = RequestTiming(**{f.name: 0.5 + i for i, f in enumerate(dataclasses.fields(RequestTiming))})
  d = Delta("r", 1, (4, 5), "stop", 7, timing=timing,
            logprobs=(TokenLogprob(4, -0.5, ((4, -0.5),)), TokenLogprob(5, -1.0, ((5, -1.0),))),
            speculation=Speculation(9, 4, 3))
  assert {k for k, v in dataclasses.asdict(d).items() if v is not None} == fields, "set them all"
  assert dataclasses.asdict(from_row(delta_row(d))) == dataclasses.asdict(d)
