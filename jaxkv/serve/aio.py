"""`AsyncEngine`: the incremental engine API from asyncio.

One driver task steps the `Engine` while any request is unfinished; each step
(one blocking loop entry of at most `interval` steps) runs in a worker thread
(`asyncio.to_thread`), so the event loop keeps serving while the device
works, and only one loop entry runs at a time. Deltas are routed to one
`asyncio.Queue` per request; `generate` yields them. A consumer that stops
early (a closed generator, a cancelled task: a client that went away) aborts
its request, which frees its columns at the next step.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from jaxkv.serve.engine import Engine
from jaxkv.serve.requests import Delta, Request


class AsyncEngine:
  """Serves `Engine.add_request`/`step` from asyncio.

  Args:
    engine: the `Engine` (only this object should drive its incremental API).
    interval: the streaming interval `k`: most steps per loop entry, so new
      tokens reach consumers every `k` steps at the latest.
    on_step: optional callback after every step, called on the event loop
      with the step's deltas (metrics).
  """

  def __init__(self, engine: Engine, *, interval: int = 8,
               on_step: Callable[[list[Delta]], None] | None = None):
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
      raise ValueError(f"interval={interval!r} must be an int >= 1")
    self.engine, self.interval, self.on_step = engine, interval, on_step
    self._queues: dict = {}
    self._driver: asyncio.Task | None = None

  def add_request(self, request: Request):
    """Checks and queues `request` (raising ValueError/TypeError as `Engine.add_request`); its id.

    Call `deltas(request_id)` next to consume its output.
    """
    rid = self.engine.add_request(request)
    self._queues[rid] = (asyncio.Queue(), request.params.n)
    if self._driver is None or self._driver.done():
      self._driver = asyncio.get_running_loop().create_task(self._drive())
    return rid

  def abort(self, request_id, index: int | None = None) -> bool:
    """`Engine.abort`: ends the request (or one running sample) at the next step."""
    return self.engine.abort(request_id, index)

  async def deltas(self, request_id) -> AsyncIterator[Delta]:
    """The request's deltas until each sample has finished; leaving early aborts it.

    Raises:
      EngineError: the step serving the request failed (the request is dropped).
    """
    queue, remaining = self._queues[request_id]
    try:
      while remaining:
        item = await queue.get()
        if isinstance(item, BaseException):
          raise item
        remaining -= item.finish_reason is not None
        yield item
    finally:
      self._queues.pop(request_id, None)
      if remaining:
        self.engine.abort(request_id)

  async def generate(self, request: Request) -> AsyncIterator[Delta]:
    """`add_request` then `deltas`."""
    rid = self.add_request(request)
    async for delta in self.deltas(rid):
      yield delta

  async def _drive(self) -> None:
    # No await between the check and the return: an add_request on the event loop
    # either sees this task running (and is served by it) or done (and starts another).
    while self.engine.has_unfinished():
      try:
        deltas = await asyncio.to_thread(self.engine.step, self.interval)
      except Exception as e:   # pylint: disable=broad-except  (routed to the requests it failed)
        failed = getattr(e, "failed", None)
        for rid in list(self._queues) if failed is None else failed:
          if rid in self._queues:
            self._queues[rid][0].put_nowait(e)
        if failed is None:   # not the engine's own failure report: stop driving
          return
        continue
      for delta in deltas:
        entry = self._queues.get(delta.request_id)
        if entry is not None:
          entry[0].put_nowait(delta)
      if self.on_step is not None:
        self.on_step(deltas)
