"""The incremental engine API: add_request / abort / step / stream over one persistent cache."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from live_utils import collect, random_requests
from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve import AsyncEngine
from jaxkv.serve.live_ops import abort_rows
from jaxkv.serve.state import init_loop_state, pack_queue
import jaxkv.serve.core  # noqa: F401  (monkeypatched below)
from jaxkv.serve.loop import serve_loop

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)
MAX_SEQS, WIDTH = 4, 8


def _model(capacity=160, initial_capacity=None):
  cache = MODEL.cache_config(capacity=capacity, max_seqs=MAX_SEQS, max_write=WIDTH,
                             initial_capacity=initial_capacity)
  return Decoder(MODEL, cache, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model():
  return _model()


_requests, _collect = random_requests, collect


def _want(model, requests, max_len=48, **engine_args):
  done = serve.Engine(model, max_len=max_len, **engine_args).run(requests)
  return {(c.request_id, c.index): (c.tokens, c.finish_reason) for c in done}


@pytest.mark.parametrize("interval", [1, 5])
def test_streamed_deltas_concatenate_to_run(model, rng, monkeypatch, interval):
  """Greedy and seeded requests, parallel samples, stop tokens: stream == run, one compile."""
  requests = _requests(rng, 9)
  want = _want(model, requests)
  chex.clear_trace_counter()   # parametrized: the count is per function, across cases
  monkeypatch.setattr(serve.core, "serve_loop", chex.assert_max_traces(serve_loop, n=1))
  engine = serve.Engine(model, max_len=48)
  assert [engine.add_request(r) for r in requests] == [r.request_id for r in requests]
  got = _collect(engine.stream(interval))
  assert got == want
  assert not engine.has_unfinished() and engine.stats.generated == sum(len(t) for t, _ in
                                                                       want.values())
  # An entry runs at most `interval` steps.
  stats = engine.stats
  assert stats.loop_entries >= -(-stats.steps // interval) and stats.loop_entries > 1, stats
  # The persistent cache is empty again: every column retired, no sequence left.
  assert int(engine.state.cols.used.sum()) == 0 and int(engine.state.cache.live.sum()) == 0


def test_add_request_while_others_run(model, rng):
  requests = _requests(rng, 12)
  want = _want(model, requests)
  engine = serve.Engine(model, max_len=48)
  got = {}
  for r in requests[:3]:
    engine.add_request(r)
  pending = list(requests[3:])
  while engine.has_unfinished() or pending:
    if pending:   # one new request per entry, while the earlier ones are mid-flight
      engine.add_request(pending.pop(0))
    _collect(engine.step(2), got)
  assert got == want


def test_queue_longer_than_device_queue_waits_on_the_host(model, rng):
  """More requests than queue slots (8) and output rows (16): they wait, then run in order."""
  requests = _requests(rng, 30)
  engine = serve.Engine(model, max_len=48)
  for r in requests:
    engine.add_request(r)
  assert engine._live.counts() == (0, 30)
  assert engine.waiting_tokens == sum(len(r.prompt) for r in requests)
  assert _collect(engine.stream(4)) == _want(model, requests)
  assert engine.waiting_tokens == 0


def test_flat_rows_grow_between_entries(rng):
  """A cache that starts with 16 flat rows grows on the host before longer requests enter."""
  model = _model(initial_capacity=16)
  requests = _requests(rng, 6)
  engine = serve.Engine(model, max_len=48)
  for r in requests[:2]:
    engine.add_request(r)
  got = _collect(engine.step(2))
  for r in requests[2:]:
    engine.add_request(r)
  assert _collect(engine.stream(3), got) == _want(model, requests)
  assert engine.state.cache.k[0].shape[0] > 16


def test_abort_frees_columns_and_room_for_later_requests(rng):
  """A capacity for one long request at a time: aborting it lets the next one in at once."""
  model = _model(capacity=40)
  long = serve.Request(tuple(range(1, 9)), serve.SamplingParams(max_tokens=30), "long")
  later = serve.Request((5, 6, 7), serve.SamplingParams(max_tokens=30), "later")
  engine = serve.Engine(model, max_len=41)   # the longest a capacity-40 cache holds
  engine.add_request(long)
  engine.add_request(later)
  first = _collect(engine.step(3))
  assert list(first) == [("long", 0)] and len(first["long", 0][0]) == 3
  assert engine._live.counts() == (1, 1)     # "later" cannot be admitted next to "long"
  assert engine.abort("long") and not engine.abort("long") and not engine.abort("nobody")
  deltas = engine.step(3)
  assert deltas[0] == serve.Delta("long", 0, (), "abort", 0, deltas[0].timing)
  assert deltas[0].timing is not None and engine.stats.aborted == 1
  assert [d.request_id for d in deltas[1:]] == ["later"]   # admitted in the same step
  got = _collect(engine.stream(8), _collect(deltas[1:]))
  assert got["later", 0] == _want(model, [later], max_len=41)["later", 0]
  assert int(engine.state.cols.reserve.sum()) == 0 and int(engine.state.cols.used.sum()) <= 1


def test_abort_waiting_queued_and_one_sample(model, rng):
  requests = _requests(rng, 14)
  multi = next(r for r in requests[:4] if r.params.n > 1 and r.params.max_tokens > 3)
  engine = serve.Engine(model, max_len=48)
  for r in requests:
    engine.add_request(r)
  assert engine.abort("r13")                   # waiting on the host
  assert not engine.abort(multi.request_id, index=0)   # not running yet: refused
  got = _collect(engine.step(1))
  queued = next(rid for rid, t in reversed(engine._live.ledger.tracked.items())
                if t.base >= 0 and t.admitted is None)   # in the device queue, not admitted
  assert engine.abort(queued)                  # in the device queue, not admitted
  while not got.get((multi.request_id, 0), ([], None))[0]:
    _collect(engine.step(1), got)
  assert not engine.abort(multi.request_id, index=multi.params.n)   # no such sample
  assert engine.abort(multi.request_id, index=0)
  got = _collect(engine.stream(3), got)
  want = _want(model, requests)
  for key, (tokens, reason) in got.items():
    if key[0] in ("r13", queued) or key == (multi.request_id, 0):
      assert reason == "abort" and tokens == want[key][0][:len(tokens)], key
    else:
      assert (tokens, reason) == want[key], key
  assert ("r13", 0) in got and (queued, 0) in got and len(got) == len(want)


def test_stop_tokens_past_max_stop_tokens_are_checked_on_the_host(model, rng):
  """With max_stop_tokens=1, the second stop token still ends the sample (cut after it)."""
  prompt = (3, 9, 27)
  free = serve.Engine(model, max_len=48).run([serve.Request(prompt, serve.SamplingParams(
      max_tokens=12))])[0].tokens
  stop = free[4]
  absent = next(t for t in range(64) if t not in free)
  request = serve.Request(prompt, serve.SamplingParams(max_tokens=12, stop_tokens=(absent, stop)),
                          request_id="s")
  engine = serve.Engine(model, max_len=48, max_stop_tokens=1)
  with pytest.raises(ValueError, match="max_stop_tokens=1"):
    engine.run([request])                      # run keeps its refusal
  engine.add_request(request)
  got = _collect(engine.stream(12))
  assert got["s", 0] == (free[:free.index(stop) + 1], "stop")
  assert got["s", 0] == _want(model, [request])["s", 0]


def test_random_seed_is_drawn_and_reported(model):
  request = serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=8, temperature=1.0, seed=None,
                                                          n=2))
  engine = serve.Engine(model, max_len=48)
  rid = engine.add_request(request)
  deltas = list(engine.stream())
  seeds = {d.seed for d in deltas}
  assert len(seeds) == 1
  replay = dataclasses.replace(request, params=dataclasses.replace(request.params,
                                                                   seed=seeds.pop()),
                               request_id=rid)
  assert _collect(deltas) == _want(model, [replay])
  done = serve.Engine(model, max_len=48).run([request])
  assert done[0].seed is not None and done[0].seed == done[1].seed


def test_errors_leave_the_engine_usable(model, rng, monkeypatch):
  engine = serve.Engine(model, max_len=48)
  with pytest.raises(ValueError, match="max_len=48"):
    engine.add_request(serve.Request((1,) * 40, serve.SamplingParams(max_tokens=20)))
  with pytest.raises(ValueError, match="vocab_size"):
    engine.add_request(serve.Request((1,), serve.SamplingParams(stop_tokens=(64,))))
  assert not engine.has_unfinished()
  requests = _requests(rng, 3)
  engine.add_request(requests[0])
  with pytest.raises(ValueError, match="already in flight"):
    engine.add_request(requests[0])
  with pytest.raises(RuntimeError, match="still in flight"):
    engine.run(requests[1:])

  calls = []

  def broken(*args):
    calls.append(1)
    raise FloatingPointError("device lost")

  good = engine.core._loop
  monkeypatch.setattr(engine.core, "_loop", broken)
  with pytest.raises(serve.EngineError, match="device lost") as info:
    engine.step()
  assert info.value.failed == ["r0"] and not engine.has_unfinished() and calls
  monkeypatch.setattr(engine.core, "_loop", good)
  for r in requests:
    engine.add_request(r)
  assert _collect(engine.stream(4)) == _want(model, requests)
  assert engine.run(requests[1:2])[0].tokens == _want(model, requests[1:2])["r1", 0][0]


def test_async_engine_streams_and_aborts_on_early_exit(model, rng):
  requests = _requests(rng, 6)
  want = _want(model, requests)
  engine = serve.Engine(model, max_len=48)
  long = serve.Request((1, 2), serve.SamplingParams(max_tokens=40), "long")

  async def consume(request):
    return _collect([d async for d in aio.generate(request)])

  async def leave_early():
    async for d in aio.generate(long):
      if d.tokens:
        break   # closing the generator aborts the request

  async def main():
    results = await asyncio.gather(leave_early(), *(consume(r) for r in requests))
    deadline = time.monotonic() + 60
    while engine.has_unfinished():   # the abort is applied by the driver's next step
      assert time.monotonic() < deadline, "the engine did not apply the abort"
      await asyncio.sleep(0.01)
    return results[1:]

  aio = AsyncEngine(engine, interval=2)
  results = asyncio.run(main())
  got = {}
  for part in results:
    got |= part
  assert got == want
  assert engine.stats.aborted == 1


def test_stats_split_compile_time_from_serving(model, rng):
  """The first entry of a new shape class compiles; no later entry does (nor adds, aborts)."""
  engine = serve.Engine(model, max_len=40)   # a max_len no other test compiles for
  # Both loops (greedy-only and sampled traffic) and the snapshots of 1- and 4-step entries.
  warm = engine.warm_up(steps=(1, 4))
  assert not engine.has_unfinished() and warm > 0
  for r in _requests(rng, 3):
    engine.add_request(r)
  engine.step(1)
  stats = engine.stats
  compiled, seconds = stats.compile_seconds, stats.seconds
  assert 0 < compiled < seconds
  list(engine.stream(1))   # regression: the loop's committed outputs as inputs compiled again
  for r in _requests(rng, 3, prefix="again"):
    engine.add_request(r)
  engine.step(1)
  engine.abort("again0")
  deltas = list(engine.stream(4))
  # Only the small abort/clear helpers may compile now, not the loop again.
  assert stats.compile_seconds - compiled < compiled / 4 and stats.seconds > seconds
  assert stats.tokens_per_second > 0
  timings = [d.timing for d in deltas if d.timing is not None]
  assert len(timings) == 3
  for t in timings:
    assert 0 <= t.queue_seconds <= t.total_seconds
    assert t.first_token_seconds is None or t.queue_seconds <= t.first_token_seconds
  engine.run(_requests(rng, 9))   # a queue of 9 pads to 16 slots: a new shape class
  assert 0 < engine.stats.compile_seconds < engine.stats.seconds


def test_async_engine_reports_a_failed_step_and_recovers(model, rng, monkeypatch):
  engine = serve.Engine(model, max_len=48)
  requests = _requests(rng, 2)
  good = engine.core._loop

  def broken(*args):
    raise FloatingPointError("device lost")

  async def consume(request):
    return _collect([d async for d in aio.generate(request)])

  async def main():
    monkeypatch.setattr(engine.core, "_loop", broken)
    with pytest.raises(serve.EngineError, match="device lost"):
      await consume(requests[0])
    monkeypatch.setattr(engine.core, "_loop", good)
    return await consume(requests[1])

  aio = AsyncEngine(engine, interval=3)
  assert asyncio.run(main()) == _want(model, requests[1:])


@pytest.mark.parametrize("max_stop_tokens", [None, 1])
def test_overlapped_steps_deliver_the_tokens_of_run(model, rng, max_stop_tokens):
  """`step(overlap=True)` returns the previous entry's deltas while the next entry runs.

  Arrivals between calls, aborts, entry lengths and sync calls mixed in at random;
  with `max_stop_tokens=1` the second stop token is cut on the host one entry late.
  Every sample not aborted equals `run`'s; an aborted one is a prefix of it.
  """
  requests = _requests(rng, 16)
  want = _want(model, requests)
  extra = {} if max_stop_tokens is None else {"max_stop_tokens": max_stop_tokens}
  engine = serve.Engine(model, max_len=48, **extra)
  got, aborted, pending = {}, set(), list(requests)
  for r in pending[:4]:
    engine.add_request(r)
  pending = pending[4:]
  overlapped = 0
  while engine.has_unfinished() or pending:
    if pending and rng.random() < 0.5:
      engine.add_request(pending.pop(0))
    unfinished = sorted({rid for (rid, _), (_, reason) in got.items() if reason is None})
    if unfinished and (rng.random() < 0.1 or not aborted) and engine.abort(unfinished[0]):
      aborted.add(unfinished[0])
    overlap = bool(rng.random() < 0.8)
    overlapped += overlap
    _collect(engine.step(int(rng.integers(1, 5)), overlap=overlap), got)
  assert overlapped > 10 and aborted and engine.waiting_tokens == 0
  for key, (tokens, reason) in want.items():
    if key[0] in aborted and got[key][1] == "abort":
      assert got[key][0] == tokens[:len(got[key][0])], key
    else:
      assert got[key] == (tokens, reason), key
  assert int(engine.state.cols.reserve.sum()) == 0


def test_overlap_hands_out_an_entry_while_the_next_one_runs(model):
  """The first tokens come back with the second entry already dispatched; not so with logprobs."""
  engine = serve.Engine(model, max_len=48)
  engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=20), "a"))
  first = engine.step(2, overlap=True)
  assert [d.request_id for d in first] == ["a"] and len(first[0].tokens) == 2
  assert engine.stats.loop_entries == 2   # entry 2 was in flight when entry 1's tokens returned
  rest = _collect(engine.stream(4), _collect(first))
  assert rest == _want(model, [serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=20),
                                             "a")])
  engine = serve.Engine(model, max_len=48)
  engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=20, logprobs=1),
                                   "lp"))
  first = engine.step(2, overlap=True)
  assert engine.stats.loop_entries == 1 and len(first[0].logprobs) == 2


def test_abort_many_ends_every_listed_request_in_one_call(model, rng):
  requests = _requests(rng, 10)
  engine = serve.Engine(model, max_len=48)
  for r in requests:
    engine.add_request(r)
  first = _collect(engine.step(2))
  gone = [r.request_id for r in requests[::2]] + ["nobody"]
  assert engine.abort_many(gone) == 5 and engine.abort_many(gone) == 0
  got = _collect(engine.stream(3), first)
  want = _want(model, requests)
  for key, (tokens, reason) in want.items():
    if key[0] in gone:
      assert got[key][1] in ("abort", reason) and got[key][0] == tokens[:len(got[key][0])]
    else:
      assert got[key] == (tokens, reason)
  assert not engine.has_unfinished() and engine.waiting_tokens == 0 and engine.counts() == (0, 0)


def test_a_request_added_while_an_entry_runs_joins_at_the_next_step(model):
  """Counted in steps: b, added while entry 0 (4 steps) is in flight, is admitted by entry 1's
  first step and samples its first token there; the driver runs at most two entries ahead."""
  engine = serve.Engine(model, max_len=48)
  live = engine.live
  a = serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=20), "a")
  b = serve.Request((4, 5), serve.SamplingParams(max_tokens=6), "b")
  engine.add_request(a)
  live.dispatch(4)                      # entry 0: steps 1..4, uncollected
  engine.add_request(b)
  live.dispatch(4)                      # entry 1: b was appended before it
  with pytest.raises(RuntimeError, match="uncollected"):
    live.dispatch(4, wait=False)        # a third entry would run ahead of the reader
  row = live.ledger.tracked["b"].base
  out = engine.state.out
  assert (int(out.admitted[row]), int(out.first[row])) == (4, 5)
  got = {}
  while live.in_flight:
    _collect(live.collect(), got)
  assert len(got["b", 0][0]) == 4       # steps 5..8 of entry 1
  _collect(engine.stream(4), got)
  assert got == _want(model, [a, b])


def test_queue_counters_wrap_past_int32(model, rng):
  """The device queue's counters only grow: past 2**31 they wrap and the ring still serves in order."""
  engine = serve.Engine(model, max_len=48)
  first = _requests(rng, 2, prefix="w")
  for r in first:
    engine.add_request(r)
  got = _collect(engine.stream(4))
  near = lambda: engine.core.place(jnp.int32(2**31 - 3))   # an empty queue: next == count
  engine.core.apply(lambda ls: dataclasses.replace(ls, queue=dataclasses.replace(
      ls.queue, next=near(), count=near())))
  later = _requests(rng, 12, prefix="x")
  for r in later:
    engine.add_request(r)
  _collect(engine.stream(2), got)
  assert int(engine.state.queue.next) < 0   # wrapped
  assert got == _want(model, first + later)


def _queue_order(ls):
  """`prompt_len` of the queued requests in ring order, from `next` (the test's oracle view)."""
  q = jax.device_get(ls.queue)
  size = q.prompt_len.shape[0]
  return [int(q.prompt_len[(int(q.next) + j) % size]) for j in range(int(q.count) - int(q.next))]


@pytest.mark.parametrize("head", [2, 6])   # 6: the queued run wraps around the ring's end
def test_abort_rows_closes_the_ring_over_aborted_requests(model, head):
  """Queued requests whose first output row is aborted leave the ring; the rest keep their order,
  and nothing else of the state changes."""
  engine = serve.Engine(model, max_len=48)
  prompts = [tuple(range(1, 2 + i)) for i in range(8)]   # prompt_len identifies a request
  host = pack_queue(prompts, [serve.SamplingParams()] * 8, max_len=48, max_stop=engine.max_stop)
  ls = init_loop_state(engine.config, host, num_widths=len(engine.widths))
  slots = [(head + j) % 8 for j in range(5)]
  ls = dataclasses.replace(ls, queue=dataclasses.replace(
      ls.queue, next=jnp.int32(head), count=jnp.int32(head + 5)))
  before = jax.device_get(ls.cols)
  rows = np.zeros((host.rows,), bool)
  out_base = np.asarray(host.arrays["out_base"])
  aborted = [slots[1], slots[3]]
  rows[out_base[aborted]] = True
  ls = abort_rows(engine.config, ls, jnp.zeros_like(rows), jnp.asarray(rows))
  assert _queue_order(ls) == [len(prompts[s]) for s in slots if s not in aborted]
  assert int(ls.queue.next) == head and int(ls.status) == 0
  chex.assert_trees_all_equal(jax.device_get(ls.cols), before)


def test_a_refused_step_read_back_fails_its_requests_and_the_engine_recovers(model, rng):
  """A non-OK status found in an entry's snapshot (by `step`, or by AsyncEngine's reader while
  the driver runs the next entry) drops the requests on the device and names them; the engine
  then serves on a fresh cache."""
  from jaxkv import Status   # pylint: disable=g-import-not-at-top
  engine = serve.Engine(model, max_len=48)
  good = engine.core._loop, engine.core._greedy_loop

  def refusing(loop):
    def entry(leaves, ls, budget):
      out = loop(leaves, ls, budget)
      return dataclasses.replace(out, status=engine.core.place(jnp.int32(Status.NO_ROOM)))
    return entry

  def refuse(on):
    engine.core._loop, engine.core._greedy_loop = (tuple(map(refusing, good)) if on else good)

  requests = _requests(rng, 3)
  refuse(True)
  engine.add_request(requests[0])
  with pytest.raises(serve.EngineError, match="NO_ROOM") as info:
    engine.step(2)
  assert info.value.failed == ["r0"] and not engine.has_unfinished()
  assert engine.counts() == (0, 0) and engine.waiting_tokens == 0

  async def consume(request):
    return _collect([d async for d in aio.generate(request)])

  async def main():
    with pytest.raises(serve.EngineError, match="NO_ROOM"):
      await consume(requests[1])
    refuse(False)
    return await consume(requests[2])

  aio = AsyncEngine(engine, interval=2)
  assert asyncio.run(main()) == _want(model, requests[2:])
  aio.close(timeout=10)


def test_aborting_a_full_device_queue_lets_the_requests_behind_it_in(model, rng):
  """Every column and all 8 queue slots aborted, by the last entry read the queue is full:
  the next steps still move the requests waiting on the host in, and serve them as `run` does."""
  engine = serve.Engine(model, max_len=48)
  long = [serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=40), f"l{i}")
          for i in range(12)]
  for r in long:
    engine.add_request(r)
  engine.step(1)   # 3 admitted (the capacity holds three reservations), 5 queued
  engine.step(1)   # 3 more appended: the device queue's 8 slots are full, 1 waits on the host
  assert engine.counts() == (3, 9) and engine.live.ledger.queued_seen == engine.live.queue_size
  later = _requests(rng, 3, prefix="y")
  for r in later:
    engine.add_request(r)
  assert engine.abort_many([r.request_id for r in long]) == 12
  got = {}
  for _ in range(200):   # bounded: a stale view of the queue must not stall the waiting requests
    if not engine.has_unfinished():
      break
    _collect(engine.step(4), got)
  assert not engine.has_unfinished()
  assert {k: v for k, v in got.items() if k[0].startswith("y")} == _want(model, later)


def test_aborting_every_sampled_request_reuses_the_sampled_loop(model, monkeypatch):
  """With only aborted requests left to free (a queue the device still holds), the entry runs
  the loop variant the last one ran: the last abort (or a server's drain) never waits for a
  first compile of the greedy loop."""
  engine = serve.Engine(model, max_len=48)
  for i in range(8):   # more than the columns hold: some wait in the device queue
    engine.add_request(serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=40,
                                                                     temperature=1.0, seed=i),
                                     f"s{i}"))
  variants = []
  enter = engine.core.enter
  monkeypatch.setattr(engine.core, "enter",
                      lambda k, *, greedy=False: variants.append(greedy) or enter(k, greedy=greedy))
  engine.step(1)
  assert engine.counts()[1] > 0 and engine.live.ledger.queued > 0
  assert engine.abort_many([f"s{i}" for i in range(8)]) == 8
  while engine.has_unfinished() or engine.live.ledger.queued:
    engine.step(1)
  assert len(variants) > 1 and not any(variants), variants


def test_an_engine_is_served_by_one_open_async_engine_at_a_time(model):
  """A second AsyncEngine over an engine another open one serves is refused (its reader would
  collect the other's entries), naming the argument and leaving the first in charge; once
  that one is closed, another may serve the engine."""
  engine = serve.Engine(model, max_len=48)
  first = AsyncEngine(engine, interval=2)
  with pytest.raises(ValueError, match="engine= is already served by an open AsyncEngine"):
    AsyncEngine(engine, interval=4)
  assert engine.driver is first
  first.close()
  second = AsyncEngine(engine, interval=4)
  assert engine.driver is second
  second.close()
  assert engine.driver is None
