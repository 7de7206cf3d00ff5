"""Stepping: single steps queued ahead of the device (`LiveQueue.dispatch(stepwise=True)`).

The step program holds no loop and no branch (on a GPU the host queues it while
the device runs the one before); retirement, admission, forks and preemption
run in the admission block only when the host finds one due. The tokens are
each request's alone, whatever the schedule: against the loop, against each
request served by itself, under preemption, forks, aborts and a reader that
falls behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import hlo_walk
from live_utils import collect, random_requests
from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve import AsyncEngine, aio, live
from jaxkv.serve.results import Delta

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)


def _model(capacity=160, page_size=None):
  cache = MODEL.cache_config(capacity=capacity, max_seqs=4, max_write=8)
  return Decoder(MODEL, dataclasses.replace(cache, page_size=page_size), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def columns_model():
  return _model()


@pytest.fixture(scope="module")
def paged_model():
  return _model(page_size=8)


_requests, _collect = random_requests, collect


def _alone(model, requests, **engine_args):
  """Each request served by itself (no batching, no admission order): the reference."""
  engine = serve.Engine(model, max_len=48, **engine_args)
  want = {}
  for r in requests:
    for c in engine.run([r]):
      want[(c.request_id, c.index)] = (c.tokens, c.finish_reason)
  return want


def _step_through(engine, *, read_every=None, add=None, limit=2000):
  """Dispatches one step at a time until nothing is left; the deltas collected.

  `read_every`: the adaptive read-back, with the reader collecting only every third
  dispatch (it falls behind). `add`: `{dispatch number: [requests]}` added then.
  """
  live_q, got, n = engine.live, {}, 0
  while engine.has_unfinished() or live_q.has_work() or add:
    for r in (add or {}).pop(n, []):
      engine.add_request(r)
    _collect(live_q.dispatch(1, stepwise=True, read_every=read_every), got)
    if read_every is None or n % 3 == 2 or live_q.in_flight >= live.MAX_IN_FLIGHT_STEPPING:
      while live_q.in_flight:
        _collect(live_q.collect(), got)
    n += 1
    assert n < limit, "stepping did not finish"
  while live_q.in_flight:
    _collect(live_q.collect(), got)
  return got


@pytest.mark.parametrize("layout", ["columns", "paged"])
def test_stepped_tokens_are_each_requests_alone(layout, columns_model, paged_model, rng):
  """Greedy and seeded samples, forks, stop tokens, arrivals mid-run: each request's tokens
  are the ones it gets served alone, and the engine ends holding nothing."""
  model = paged_model if layout == "paged" else columns_model
  extra = {"prefix_cache": True} if layout == "paged" else {}
  requests = _requests(rng, 10)
  engine = serve.Engine(model, max_len=48, **extra)
  for r in requests[:6]:
    engine.add_request(r)
  got = _step_through(engine, add={3: requests[6:8], 7: requests[8:]})
  assert got == _alone(model, requests, **extra)
  cols = engine.core.state.cols
  # Retired: no column in use (with prefix caching a retired one may stay as a cached prefix).
  assert not np.asarray(cols.used).any() and not np.asarray(cols.done).any()
  assert engine.held == 0


def test_preemption_and_a_reader_that_falls_behind(rng):
  """Paged storage too small for the load (steps stall, the admission block preempts) and a
  reader that collects every third dispatch: no token lost, none repeated."""
  model = _model(capacity=48, page_size=8)
  requests = [r.replace(params=dataclasses.replace(r.params, n=1, max_tokens=12, stop_tokens=()))
              for r in _requests(rng, 8, sampled=False)]
  engine = serve.Engine(model, max_len=40)
  for r in requests:
    engine.add_request(r)
  got = _step_through(engine, read_every=4)
  assert got == _alone(model, requests)
  assert engine.stats.preemptions > 0, "the load never needed a preemption: make it larger"


def test_steps_have_no_loop_and_no_branch(paged_model):
  """What lets the host run ahead: the compiled greedy step has no `while` and no
  `conditional` (each would read a predicate back to the host on a GPU), and the sampled
  step adds none: no `conditional` compiled here, and lowered for a GPU no more `while`s than
  the greedy step (on a CPU jax lowers its PRNG's rounds as a loop; on a GPU unrolled)."""
  engine = serve.Engine(paged_model, max_len=48, prefix_cache=True)
  engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=2, temperature=1.0,
                                                                   seed=1)))
  engine.live.dispatch(1, stepwise=True)
  core = engine.core   # the programs `step` runs: over the packed state
  args = (core._param_leaves, core._packed)
  for greedy in (True, False):
    hlo = core._verbs.steps[0, greedy].lower(*args).compile().as_text()
    comps, entry = hlo_walk.computations(hlo)
    lines = hlo_walk.reached(comps, entry, branches=True)
    assert not [l for l in lines if " conditional(" in l], greedy
    if greedy:
      assert hlo_walk.whiles(lines) == []
  gpu = {greedy: core._verbs.steps[0, greedy].trace(*args).lower(
      lowering_platforms=("cuda",)).as_text() for greedy in (True, False)}
  assert gpu[False].count("stablehlo.while") == gpu[True].count("stablehlo.while")
  assert "stablehlo.case" not in gpu[False] and "stablehlo.if" not in gpu[False]


def test_plain_sampled_requests_step_without_a_loop_entry(paged_model, monkeypatch):
  """Sampled requests the draw alone serves (temperature, top-k, min-p, a seed) are stepped like
  greedy ones, by the sampled step (no branch): one step per stepwise dispatch, the loop never
  entered, and each request's tokens are those the loop's sampler draws for it."""
  engine = serve.Engine(paged_model, max_len=48)
  requests = [
      serve.Request((1, 2), serve.SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                 top_k=5), "a"),
      serve.Request((4, 5, 6), serve.SamplingParams(max_tokens=20, temperature=0.8, seed=4,
                                                    min_p=0.05), "b")]
  want = {(c.request_id, c.index): (c.tokens, c.finish_reason) for c in engine.run(requests)}

  def refuse(*args, **kwargs):
    raise AssertionError("stepping entered the loop")

  monkeypatch.setattr(engine.core, "enter", refuse)
  for r in requests:
    engine.add_request(r)
  live_q = engine.live
  live_q.dispatch(1, stepwise=True, read_every=4)
  assert engine.core.read(lambda ls: int(ls.steps)) == 1
  assert _step_through(engine) == want


def test_a_request_the_draw_alone_does_not_serve_runs_in_loop_entries(paged_model):
  """A penalised request beside a plain sampled one: stepwise dispatches run loop entries (the
  sampled step has no penalty stage), and both get their tokens alone."""
  engine = serve.Engine(paged_model, max_len=48)
  requests = [
      serve.Request((1, 2), serve.SamplingParams(max_tokens=12, temperature=1.0, seed=3), "a"),
      serve.Request((3, 4), serve.SamplingParams(max_tokens=12, temperature=1.0, seed=5,
                                                 presence_penalty=0.5), "b")]
  entered = []
  enter = engine.core.enter
  engine.core.enter = lambda *a, **k: entered.append(k.get("greedy")) or enter(*a, **k)
  for r in requests:
    engine.add_request(r)
  got = _step_through(engine)
  assert entered and not any(entered), entered   # sampled loop entries
  assert got == _alone(paged_model, requests)


def test_plain_sampled_names_what_the_draw_alone_serves():
  """The host's test for the sampled step, field by field (no device work)."""
  from jaxkv.serve.admission import plain_sampled   # pylint: disable=g-import-not-at-top
  base = serve.SamplingParams(max_tokens=4, temperature=1.0)
  served = [{}, {"temperature": 0.0}, {"top_k": 16}, {"top_k": 1}, {"min_p": 0.2},
            {"seed": 7}, {"stop_tokens": (3,)}, {"min_tokens": 2},
            {"temperature": 0.0, "top_p": 0.5}]
  refused = [{"top_k": 17}, {"top_p": 0.9}, {"repetition_penalty": 1.1},
             {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"logprobs": 0},
             {"logit_bias": {3: 1.0}}, {"allowed_token_ids": (1, 2)},
             {"min_tokens": 2, "stop_tokens": (3,)}]
  for change in served:
    assert plain_sampled(dataclasses.replace(base, **change), 16), change
  for change in refused:
    assert not plain_sampled(dataclasses.replace(base, **change), 16), change


def test_a_request_added_between_steps_is_admitted_at_the_next_step(paged_model):
  """Counted in steps: b, added after a's steps 1..3 were dispatched (unread), is admitted by
  the next dispatch's admission block and samples its first token in the step after it."""
  engine = serve.Engine(paged_model, max_len=48)
  live_q = engine.live
  a = serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=20), "a")
  b = serve.Request((4, 5), serve.SamplingParams(max_tokens=6), "b")
  engine.add_request(a)
  for _ in range(3):
    live_q.dispatch(1, stepwise=True, read_every=8)   # a's reads wait behind the first entry
  engine.add_request(b)
  live_q.dispatch(1, stepwise=True, read_every=8)
  row = live_q.ledger.tracked["b"].base
  out = engine.core.read(lambda ls: (ls.out.admitted[row], ls.out.first[row], ls.steps))
  assert tuple(int(v) for v in out) == (3, 4, 4)
  got = {}
  while live_q.in_flight:
    _collect(live_q.collect(), got)
  _extend(got, _step_through(engine))
  assert got == _alone(paged_model, [a, b])


def _extend(got, more):
  """`got` with each sample's tokens of `more` appended (its finish taken)."""
  for key, (tokens, reason) in more.items():
    before, old_reason = got.get(key, ([], None))
    assert old_reason is None, f"{key} went on after its finish"
    got[key] = (before + tokens, reason)
  return got


def test_abort_while_stepping_frees_what_it_held(paged_model, rng):
  """An abort between steps removes the request's columns at the next dispatch; the others'
  tokens are unchanged and nothing stays held."""
  requests = _requests(rng, 5, sampled=False)
  long = serve.Request((7, 8, 9), serve.SamplingParams(max_tokens=40), "long")
  engine = serve.Engine(paged_model, max_len=48)
  for r in [long, *requests]:
    engine.add_request(r)
  live_q, got = engine.live, {}
  for _ in range(4):
    _collect(live_q.step(1, stepwise=True), got)
  assert got["long", 0][0], "the long request has not started"
  assert engine.abort("long")
  _extend(got, _step_through(engine))
  assert got.pop(("long", 0))[1] == "abort"
  assert engine.stats.aborted == 1
  assert not np.asarray(engine.core.state.cache.live).any()   # no prefix cache: all gone
  assert engine.held == 0
  assert got == _alone(paged_model, requests)


def test_async_engine_stepping_streams_each_requests_tokens(paged_model, rng):
  requests = _requests(rng, 6)
  engine = serve.Engine(paged_model, max_len=48)
  engine.warm_up([4], stepwise=True)

  async def consume(request):
    return _collect([d async for d in engine_aio.generate(request)])

  async def main():
    return await asyncio.gather(*(consume(r) for r in requests))

  before = sys.getswitchinterval()
  engine_aio = AsyncEngine(engine, interval=4, stepping="steps", switch_interval=0.0002,
                           run_ahead=1)
  got = {}
  for part in asyncio.run(main()):
    got |= part
  assert sys.getswitchinterval() == pytest.approx(0.0002)   # while it steps
  engine_aio.close(timeout=10)
  assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)   # kept in microseconds
  assert got == _alone(paged_model, requests)
  stats = engine.stats   # the driver's time: waiting for the device, inside the steps' calls
  assert 0 < stats.pace_seconds + stats.step_call_seconds + stats.admit_seconds < stats.seconds
  assert 1 <= stats.admissions <= stats.steps and stats.admit_seconds > 0


def test_a_slow_consumer_gets_merged_deltas():
  """Deltas of one sample waiting in the queue come as one; another sample's, an error and a
  finish end the merge, and nothing is lost or reordered."""
  engine = object.__new__(AsyncEngine)
  engine._boxes, engine._owner = {}, {}
  d = lambda i, toks, reason=None: Delta("r", i, toks, reason, 0)
  engine._boxes["r"] = box = aio._Mailbox(2)
  # The finishing delta's fields that equality ignores must survive the merge too.
  spec = serve.Speculation(draft_tokens=6, accepted_tokens=3, rounds=2)
  timing = serve.RequestTiming(0.1, 0.2, 0.3)
  finish = dataclasses.replace(d(0, (5,), "stop"), speculation=spec, timing=timing)
  for item in (d(0, (1,)), d(0, (2, 3)), d(1, (9,)), d(0, (4,)), finish,
               d(0, (6,)), d(1, (), "length")):
    box.put(item)

  async def main():
    return [x async for x in engine.deltas("r")]

  out = asyncio.run(main())
  assert [(x.index, x.tokens, x.finish_reason) for x in out] == [
      (0, (1, 2, 3), None), (1, (9,), None), (0, (4, 5), "stop"), (0, (6,), None),
      (1, (), "length")]
  assert (out[2].speculation, out[2].timing) == (spec, timing)
  assert not engine._boxes   # delivered to the end: nothing kept


def test_deltas_arriving_while_the_consumer_waits_wake_it_in_order():
  """Deltas routed in batches from another thread reach the consumer in order (merged per
  sample where several wait), an error ends it after what came before, and a consumer that
  leaves early aborts its request."""
  engine = object.__new__(AsyncEngine)
  engine._boxes, engine._owner, engine.on_step, engine.sink = {}, {}, None, None
  aborted = []
  engine.abort = lambda rid, index=None: aborted.append(rid)
  d = lambda rid, toks, reason=None: Delta(rid, 0, toks, reason, 0)

  async def main():
    loop = asyncio.get_running_loop()
    engine._boxes.update(a=aio._Mailbox(1), b=aio._Mailbox(1), c=aio._Mailbox(1))
    got = {"a": [], "b": []}

    async def consume(rid):
      try:
        async for x in engine.deltas(rid):
          got[rid].append(x.tokens)
      except RuntimeError as e:
        got[rid].append(str(e))

    tasks = [asyncio.ensure_future(consume(r)) for r in "ab"]
    await asyncio.sleep(0)   # both wait now
    batches = [[d("a", (1,)), d("b", (5,))], [d("a", (2,))], [d("a", (3,), "length")]]
    for batch in batches:
      await loop.run_in_executor(None, lambda b=batch: loop.call_soon_threadsafe(
          engine._route, b))
    engine._boxes["b"].put(RuntimeError("step failed"))
    await asyncio.gather(*tasks)
    gen = engine.deltas("c")
    engine._boxes["c"].put(d("c", (7,)))
    assert (await gen.__anext__()).tokens == (7,)
    await gen.aclose()   # left before its finish
    return got

  got = asyncio.run(main())
  assert [t for x in got["a"] for t in x] == [1, 2, 3] and got["b"] == [(5,), "step failed"]
  assert aborted == ["b", "c"] and not engine._boxes   # the failed one and the one that left


def test_cli_stepping_choices_are_the_engines():
  from jaxkv import cli   # pylint: disable=g-import-not-at-top
  assert cli._STEPPING == aio.STEPPING
  args = cli._parser().parse_args(["serve", "m"])
  assert (args.stepping, args.interval) == ("steps", 16)
  with pytest.raises(SystemExit):
    cli._parser().parse_args(["serve", "m", "--stepping", "sometimes"])


def test_stepping_argument_is_checked(columns_model):
  engine = serve.Engine(columns_model, max_len=48)
  with pytest.raises(ValueError, match="stepping='often'"):
    AsyncEngine(engine, stepping="often")
  for bad in (0, -1e-3, 2.0, True, "fast"):
    with pytest.raises(ValueError, match="switch_interval="):
      AsyncEngine(engine, switch_interval=bad)
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match="run_ahead="):
      AsyncEngine(engine, run_ahead=bad)


def test_run_ahead_is_checked_before_anything_changes(columns_model):
  engine = serve.Engine(columns_model, max_len=48)
  engine.add_request(serve.Request((1, 2), serve.SamplingParams(max_tokens=3), "a"))
  for bad in (0, 2.0, False):
    with pytest.raises(ValueError, match="run_ahead="):
      engine.live.dispatch(1, stepwise=True, run_ahead=bad)
  assert engine.core.state is None and engine.counts() == (0, 1)   # nothing dispatched
  assert engine.live.ledger.dispatched == 0


def test_each_step_is_read_back_while_the_reader_keeps_pace_with_the_device(paged_model):
  """A reader one step behind the driver (it collects a step's read-back once the next step is
  queued, as the device runs them) gets one read-back per step, i.e. a token per step per
  stream; one that falls further behind gets several steps per read-back."""
  engine = serve.Engine(paged_model, max_len=48)
  live_q = engine.live
  engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=30), "a"))
  live_q.dispatch(1, stepwise=True, read_every=8)   # admission, then its first step
  entries, steps = engine.stats.loop_entries, live_q.ledger.steps_total
  for _ in range(6):
    live_q.dispatch(1, stepwise=True, read_every=8)
    while live_q.in_flight >= live.RUN_AHEAD:
      live_q.collect()
  assert live_q.ledger.steps_total - steps == 6
  assert engine.stats.loop_entries - entries == 6   # a read-back per step
  entries = engine.stats.loop_entries
  for _ in range(6):   # nobody collects: read-backs merge once RUN_AHEAD wait
    live_q.dispatch(1, stepwise=True, read_every=8)
  assert engine.stats.loop_entries - entries < 6
  while live_q.in_flight:
    live_q.collect()
