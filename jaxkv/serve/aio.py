"""`AsyncEngine`: the incremental engine API from asyncio.

Two threads own the stepping (`LiveQueue`'s two halves). The driver dispatches
loop entries back to back (`LiveQueue.dispatch`: aborts, new requests, one
entry), so the device never waits for the host: on a GPU the entry's call
returns when the device has finished it, with the GIL released meanwhile, and
the next entry is dispatched at once. The reader collects each entry
(`LiveQueue.collect`) while the next one runs and hands its deltas to the event
loop in one call (`call_soon_threadsafe`), where they are routed to one
mailbox per request. While they step, the event loop keeps serving:
detokenising, writing streams and accepting requests, which join the loop at
the next entry.

An entry runs `interval` steps while the engine is busy (each entry costs a
fixed host round trip, paid once per `interval` steps), and `min_interval`
steps while fewer than a sixteenth of its columns run and nothing waits, so a
request that arrives at a quiet engine waits at most that many steps for its
admission. A consumer that stops early (a closed generator, a cancelled task: a
client that went away) aborts its request, which frees its columns at the next
entry. While an `AsyncEngine` steps it lowers the interpreter's thread switch
interval (process-wide) to its `switch_interval`, and `close` puts the old one back.

Over a `DataParallelEngine` each engine gets its own driver and reader, and
each new request goes to the engine with the fewest requests in flight
(running + waiting); its id is then unique across the group.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import sys
import threading
from typing import AsyncIterator, Callable

from jaxkv.serve.engine import Engine
from jaxkv.serve.live import RUN_AHEAD
from jaxkv.serve.parallel import DataParallelEngine
from jaxkv.serve.requests import Request
from jaxkv.serve.results import Delta

# The interpreter's thread switch interval while an AsyncEngine steps: the driver wants the
# GIL back as soon as an entry (or a step's launch) returns, and a busy event loop or reader
# keeps it about this long each time while the device waits.
SWITCH_INTERVAL = 0.0001

# How the driver steps (`LiveQueue.dispatch`): loop entries of up to `interval` steps, or
# single steps queued ahead of the device, read back every `interval` steps.
STEPPING = ("steps", "entries")


def _merged(run: list[Delta]) -> Delta:
  """One delta for `run` (one sample's consecutive deltas, in order)."""
  if len(run) == 1:
    return run[0]
  first, last = run[0], run[-1]
  tokens = tuple(t for d in run for t in d.tokens)
  logprobs = None if first.logprobs is None else tuple(x for d in run for x in d.logprobs)
  return Delta(first.request_id, first.index, tokens, last.finish_reason, first.seed,
               timing=last.timing, logprobs=logprobs, speculation=last.speculation)


class _Mailbox:
  """One request's undelivered deltas (and errors), and its consumer's wake-up while it waits.

  A plain list, not an `asyncio.Queue`: a read-back routes one delta per running sample,
  and the consumer takes everything that arrived at once, so each costs an append.
  """

  __slots__ = ("items", "waiter", "remaining")

  def __init__(self, remaining: int):
    self.items: list = []
    self.waiter: asyncio.Future | None = None
    self.remaining = remaining

  def put(self, item) -> None:
    self.items.append(item)
    if self.waiter is not None and not self.waiter.done():
      self.waiter.set_result(None)

  async def drain(self) -> AsyncIterator[Delta]:
    """The deltas as they arrive until every sample has finished; an error put in between
    is raised after what came before it."""
    while self.remaining:
      items = self.items
      if not items:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
          await self.waiter
        finally:
          self.waiter = None
        continue
      item = items[0]
      if isinstance(item, BaseException):
        del items[0]
        raise item
      # A consumer slower than the steps gets one sample's deltas that arrived meanwhile as
      # one: fewer, longer chunks where the event loop is busy, one per step where it keeps up.
      end = 1
      while (item.finish_reason is None and end < len(items)
             and not isinstance(items[end], BaseException) and items[end].index == item.index):
        item = items[end]
        end += 1
      merged = _merged(items[:end])
      del items[:end]
      self.remaining -= merged.finish_reason is not None
      yield merged


def route(boxes: dict, deltas: list[Delta], on_step=None) -> None:
  """Each delta into its request's mailbox (a request no longer consumed: dropped); then
  `on_step(deltas)`."""
  for delta in deltas:
    box = boxes.get(delta.request_id)
    if box is not None:
      box.put(delta)
  if on_step is not None:
    on_step(deltas)


def fail_boxes(boxes: dict, error: Exception) -> int:
  """`error` into every mailbox (raised to its consumer once it has read what came before);
  how many got it."""
  for box in boxes.values():
    box.put(error)
  return len(boxes)


async def delivered(boxes: dict, request_id, on_end) -> AsyncIterator[Delta]:
  """`boxes[request_id]`'s deltas until each sample has finished; then (or when the consumer
  leaves early) the mailbox goes and `on_end(request_id, finished)` is called."""
  box = boxes[request_id]
  deltas = box.drain()
  try:
    async for delta in deltas:
      yield delta
  finally:
    await deltas.aclose()
    boxes.pop(request_id, None)
    on_end(request_id, not box.remaining)


class AsyncEngine:
  """Serves `Engine.add_request`/`step` from asyncio.

  Args:
    engine: the `Engine`, or a `DataParallelEngine` whose engines it drives (only this
      object should drive their incremental API).
    interval: most steps per loop entry while requests wait for a column: new
      tokens reach consumers every `interval` steps at the latest.
    min_interval: steps per entry while fewer than a sixteenth of the columns
      run and no request waits (default `max(1, interval // 4)`): a request that
      arrives at a quiet engine waits at most this many steps before it joins the loop.
    on_step: optional callback after every step, called on the event loop
      with the step's deltas (metrics).
    stepping: `"entries"`: the driver runs loop entries (each call returns when the
      device has run it); `"steps"`: it queues single steps ahead of the device
      (`LiveQueue.dispatch(stepwise=True)`), read back whenever the reader is free
      and at least every `interval` steps; `min_interval` does not apply.
    switch_interval: the interpreter's thread switch interval (seconds) while the
      engine steps (`sys.setswitchinterval`, process-wide; `close` restores it).
    run_ahead: `"steps"`: steps queued on the device at most (`live.RUN_AHEAD`).
    sink: deliver on the stepping threads instead of an event loop: `sink.deltas(deltas,
      ended)` after each read-back (`ended`: the requests whose every sample finished in it)
      and `sink.failed(error, request_ids)` for the requests a failure dropped (`EngineHost`
      forwards them to front processes). Requests then need their own `request_id`, and
      `deltas`/`generate` are not available.
  """

  def __init__(self, engine: Engine | DataParallelEngine, *, interval: int = 8,
               min_interval: int | None = None,
               on_step: Callable[[list[Delta]], None] | None = None,
               stepping: str = "entries", switch_interval: float = SWITCH_INTERVAL,
               run_ahead: int = RUN_AHEAD, sink=None):
    for name, value in (("interval", interval), ("min_interval", min_interval),
                        ("run_ahead", run_ahead)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    if stepping not in STEPPING:
      raise ValueError(f"stepping={stepping!r} must be one of {STEPPING}")
    if (isinstance(switch_interval, bool) or not isinstance(switch_interval, (int, float))
        or not 0 < switch_interval <= 1):
      raise ValueError(f"switch_interval={switch_interval!r} must be a number of seconds in "
                       "(0, 1]")
    self.switch_interval, self.run_ahead = float(switch_interval), run_ahead
    self._switch_before: float | None = None
    self.sink = sink
    self._remaining: dict = {}   # sink: request_id -> samples not finished yet
    self.engine, self.interval, self.on_step = engine, interval, on_step
    self.stepping = stepping
    self.min_interval = max(1, interval // 4) if min_interval is None else min(min_interval,
                                                                               interval)
    self.parts = list(engine.engines) if isinstance(engine, DataParallelEngine) else [engine]
    for part in self.parts:
      other = getattr(part, "driver", None)
      if other is not None and not other._closed:
        raise ValueError("engine= is already served by an open AsyncEngine (each would collect "
                         "entries the other dispatched): close() that one first")
    self._closed = False
    for part in self.parts:
      part.driver = self
    self._boxes: dict[object, _Mailbox] = {}   # request_id -> its undelivered deltas
    self._owner: dict = {}   # request_id -> the engine serving it (event loop thread only)
    self._ids = itertools.count()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._wakes = [threading.Event() for _ in self.parts]
    self._threads: list[threading.Thread] = []
    self._lives: list = []   # each engine's LiveQueue, as its threads use it

  def add_request(self, request: Request):
    """Checks and queues `request` (raising ValueError/TypeError as `Engine.add_request`); its id.

    Call `deltas(request_id)` next to consume its output.
    """
    if self._closed:
      raise RuntimeError("the AsyncEngine is closed")
    if self.sink is None:
      self._loop = asyncio.get_running_loop()
    elif request.request_id is None:
      raise ValueError("request_id=None: an AsyncEngine with a sink needs each request's id")
    part = 0
    if len(self.parts) > 1:   # the least busy engine; ids unique across the group
      part = min(range(len(self.parts)), key=lambda i: sum(self.parts[i].counts()))
      rid = request.request_id
      if rid is None:
        rid = next(i for i in self._ids if i not in self._owner)
        request = request.replace(request_id=rid)
      elif rid in self._owner:
        raise ValueError(f"request_id={rid!r} is already in flight")
    if self.sink is not None:   # known before its first delta can be read back
      self._owner[request.request_id] = part
      self._remaining[request.request_id] = request.params.n
    try:
      rid = self.parts[part].add_request(request)
    except BaseException:
      if self.sink is not None:
        self._owner.pop(request.request_id, None)
        self._remaining.pop(request.request_id, None)
      raise
    self._owner[rid] = part
    if self.sink is None:
      self._boxes[rid] = _Mailbox(request.params.n)
    if not self._threads:
      # Every engine's LiveQueue made here, before the threads read it: an engine's first
      # `live` makes it, and one made on a driver thread while this one made another
      # would leave that driver watching a queue no request reaches.
      self._lives = [p.live for p in self.parts]
      self._switch_before = sys.getswitchinterval()
      sys.setswitchinterval(self.switch_interval)
      for i in range(len(self.parts)):
        self._threads += [
            threading.Thread(target=self._drive, args=(i,), name=f"jaxkv-driver-{i}", daemon=True),
            threading.Thread(target=self._read, args=(i,), name=f"jaxkv-reader-{i}", daemon=True)]
      for t in self._threads:
        t.start()
    self._wakes[part].set()
    return rid

  def abort(self, request_id, index: int | None = None) -> bool:
    """`Engine.abort`: ends the request (or one running sample) at the next step."""
    part = self._owner.get(request_id)
    return part is not None and self.parts[part].abort(request_id, index)

  def abort_many(self, request_ids) -> int:
    """`Engine.abort_many`: ends every request in `request_ids` at the next step."""
    by_part: dict = {}
    for rid in request_ids:
      if rid in self._owner:
        by_part.setdefault(self._owner[rid], []).append(rid)
    return sum(self.parts[p].abort_many(ids) for p, ids in by_part.items())

  def warm_up(self) -> float:
    """`Engine.warm_up` for what the driver will dispatch (its entry lengths, or its steps and
    their read-backs); the compile seconds."""
    if self.stepping == "steps":
      return self.engine.warm_up([self.interval], stepwise=True)
    return self.engine.warm_up(sorted({self.interval, self.min_interval}))

  def fail_all(self, error: Exception) -> int:
    """Ends every request a consumer is reading with `error` (raised from `deltas`, which then
    aborts it in the engine; a consumer that reads its last delta first never sees it); how
    many were given it. Call it on the event loop."""
    return fail_boxes(self._boxes, error)

  def close(self, timeout: float | None = None) -> None:
    """Stops the driver thread after its current entry (requests still in flight stay unserved);
    another AsyncEngine may serve the engine after it."""
    self._closed = True
    for part in self.parts:
      if part.driver is self:
        part.driver = None
    for wake in self._wakes:
      wake.set()
    if self._threads:
      for live in self._lives:
        live.notify()
      for t in self._threads:
        t.join(timeout)
    if self._switch_before is not None:
      sys.setswitchinterval(self._switch_before)
      self._switch_before = None

  def deltas(self, request_id) -> AsyncIterator[Delta]:
    """The request's deltas until each sample has finished; leaving early aborts it.

    Raises:
      EngineError: the step serving the request failed (the request is dropped).
    """
    return delivered(self._boxes, request_id, self._ended)

  def _ended(self, request_id, finished: bool) -> None:
    if not finished:
      self.abort(request_id)
    self._owner.pop(request_id, None)

  async def generate(self, request: Request) -> AsyncIterator[Delta]:
    """`add_request` then `deltas`."""
    rid = self.add_request(request)
    async for delta in self.deltas(rid):
      yield delta

  def _steps(self, engine: Engine) -> int:
    running, waiting = engine.counts()
    quiet = not waiting and 16 * running < engine.config.max_seqs
    return self.min_interval if quiet else self.interval

  def _drive(self, part: int) -> None:
    """A driver thread: dispatches entries while there is work (at most two uncollected)."""
    engine, wake, live = self.parts[part], self._wakes[part], self._lives[part]
    while not self._closed:
      wake.clear()   # cleared before the check: an add_request after it sets it again
      if not live.has_work():
        wake.wait()
        continue
      try:
        if self.stepping == "steps":   # one step at a time, read back as the host keeps up
          deltas = live.dispatch(1, stepwise=True, read_every=self.interval,
                                 run_ahead=self.run_ahead)
        else:
          deltas = live.dispatch(self._steps(engine))
      except Exception as e:   # pylint: disable=broad-except  (routed to the requests it failed)
        self._report(e, part)
        continue
      if deltas:   # aborts (and entries collected at once: logprobs)
        self._post(self._route, deltas)

  def _read(self, part: int) -> None:
    """A reader thread: collects each entry while the next one runs, posts its deltas."""
    live = self._lives[part]
    while not self._closed:
      if not live.wait_for_entry(timeout=1.0):
        continue
      try:
        deltas = live.collect(reset=False)   # a failure is reported by the driver's dispatch
      except Exception as e:   # pylint: disable=broad-except  (routed to the requests it failed)
        self._report(e, part)
        continue
      finally:
        self._wakes[part].set()   # what the driver decides from may have changed
      if deltas or self.on_step is not None:
        self._post(self._route, deltas)

  def _report(self, e: Exception, part: int) -> None:
    if getattr(e, "deltas", None):   # what finished before the failure is delivered first
      self._post(self._route, e.deltas)
    self._post(functools.partial(self._fail, part=part), e)
    if getattr(e, "failed", None) is None:   # not the engine's own report: wait for news
      self._wakes[part].wait(1.0)

  def _post(self, fn, arg) -> None:
    if self.sink is not None:   # delivered on this thread
      fn(arg)
      return
    try:
      self._loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:   # the event loop is closed: nobody is listening any more
      self._closed = True

  def _fail(self, e: Exception, part: int) -> None:
    failed = getattr(e, "failed", None)
    if failed is None:   # unnamed: every request of that engine
      failed = [rid for rid in (self._remaining if self.sink is not None else self._boxes)
                if self._owner.get(rid) == part]
    if self.sink is not None:
      for rid in failed:
        self._owner.pop(rid, None)
        self._remaining.pop(rid, None)
      self.sink.failed(e, list(failed))
      return
    for rid in failed:
      box = self._boxes.get(rid)
      if box is not None:
        box.put(e)

  def _route(self, deltas: list[Delta]) -> None:
    if self.sink is not None:
      ended = []
      for d in deltas:   # a request whose samples have all finished is forgotten
        if d.finish_reason is not None and d.request_id in self._remaining:
          self._remaining[d.request_id] -= 1
          if not self._remaining[d.request_id]:
            del self._remaining[d.request_id]
            self._owner.pop(d.request_id, None)
            ended.append(d.request_id)
      self.sink.deltas(deltas, ended)
      if self.on_step is not None:
        self.on_step(deltas)
      return
    route(self._boxes, deltas, self.on_step)
