"""`EngineHost`: one engine served to front processes over pipes (`jaxkv serve --api-server-count`).

One event loop cannot write a token per step to hundreds of streams (a stream event
costs tens of microseconds of Python), and on one interpreter its work takes the GIL
from the thread that queues the device's steps. So the HTTP fronts may run in
processes of their own: each holds a `jaxkv.http.fronts.RemoteEngine`, and the
engine's process holds this host, which

- receives the fronts' messages on one thread (`wait` over every pipe):
  `("add", request)` (the front chose a `request_id` unique across fronts),
  `("abort", request_id, index)` and `("abort_many", request_ids)`;
- steps the engine with an `AsyncEngine` whose deliveries come to the host on the
  stepping threads (its `sink`), and sends each front, per read-back, one
  `("deltas", rows, status)` with the rows of its own requests
  (`delta_row`) and the engine's counters (`status`);
- reports a failure as `("failed", request_ids, message)` to the fronts whose requests it
  dropped, and a request the engine refused as `("refused", request_id, message)`.

A front that goes away (its pipe closes) has its requests aborted. The host owns no
HTTP and no tokenizer; the fronts own no device.
"""

from __future__ import annotations

import pickle
import threading
from multiprocessing.connection import Connection, wait

from jaxkv.serve.aio import AsyncEngine
from jaxkv.serve.results import Delta


def delta_row(d: Delta) -> tuple:
  """A delta as plain values (what crosses the pipe; `from_row` rebuilds it)."""
  return (d.request_id, d.index, d.tokens, d.finish_reason, d.seed, d.timing, d.logprobs,
          d.speculation)


def from_row(row: tuple) -> Delta:
  return Delta(*row[:5], timing=row[5], logprobs=row[6], speculation=row[7])


def status(engine) -> tuple:
  """The counters a front shows (`/metrics`, admission limits, the stats line)."""
  running, waiting = engine.counts()
  s = engine.stats
  return (running, waiting, engine.waiting_tokens, engine.held, s.generated, s.preemptions,
          s.cached_tokens, s.compile_seconds, s.seconds, s.draft_tokens, s.accepted_tokens)


class EngineHost:
  """Serves `engine` to the fronts at the other ends of `conns` (module docstring).

  Args:
    engine: the `Engine` (or `DataParallelEngine`), warmed up.
    conns: one duplex `multiprocessing` connection per front.
    **aio_args: the `AsyncEngine`'s stepping arguments (`interval`, `stepping`, ...).
  """

  def __init__(self, engine, conns: list[Connection], **aio_args):
    self.engine, self.conns = engine, list(conns)
    self.aio = AsyncEngine(engine, sink=self, **aio_args)
    self._front_of: dict = {}   # request_id -> index of the front that sent it
    self._send_locks = [threading.Lock() for _ in self.conns]
    self._open = set(range(len(self.conns)))

  # ------------------------------------------------------------------ the sink (stepping threads)

  def deltas(self, deltas: list[Delta], ended: list) -> None:
    by_front: dict[int, list] = {}
    front_of = self._front_of
    for d in deltas:
      front = front_of.get(d.request_id)
      if front is not None:
        by_front.setdefault(front, []).append(delta_row(d))
    for rid in ended:   # every sample has finished
      front_of.pop(rid, None)
    state = status(self.engine)
    for front in tuple(self._open):   # every front hears the counters, even with no rows
      self._send(front, ("deltas", by_front.get(front, []), state))

  def failed(self, error: Exception, request_ids: list) -> None:
    by_front: dict[int, list] = {}
    for rid in request_ids:
      front = self._front_of.pop(rid, None)
      if front is not None:
        by_front.setdefault(front, []).append(rid)
    for front, ids in by_front.items():
      self._send(front, ("failed", ids, f"{type(error).__name__}: {error}"))

  def _send(self, front: int, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with self._send_locks[front]:
      try:
        self.conns[front].send_bytes(data)
      except (OSError, ValueError):   # the front has gone: its receiver aborts its requests
        pass

  # ------------------------------------------------------------------ the fronts' messages

  def serve(self) -> None:
    """Handles the fronts' messages until every front has closed its pipe, then stops
    stepping (whatever is still in flight is aborted first)."""
    index = {id(c): i for i, c in enumerate(self.conns)}
    live = list(self.conns)
    while live:
      for conn in wait(live):
        front = index[id(conn)]
        try:
          message = conn.recv()
        except (EOFError, OSError):
          live.remove(conn)
          self._gone(front)
          continue
        self._handle(front, message)
    self.aio.close(timeout=30)

  def _handle(self, front: int, message) -> None:
    kind = message[0]
    if kind == "add":
      request = message[1]
      rid = request.request_id
      if rid in self._front_of:
        self._send(front, ("refused", rid, f"ValueError: request_id={rid!r} is already in "
                                           "flight"))
        return
      self._front_of[rid] = front
      try:
        self.aio.add_request(request)
      except (ValueError, TypeError, RuntimeError) as e:
        self._front_of.pop(rid, None)
        self._send(front, ("refused", rid, f"{type(e).__name__}: {e}"))
    elif kind == "abort":
      self.aio.abort(message[1], message[2])
    elif kind == "abort_many":
      self.aio.abort_many(message[1])
    else:
      raise ValueError(f"front {front} sent an unknown message {kind!r}")

  def _gone(self, front: int) -> None:
    """A front closed its pipe: what it still had in flight is aborted."""
    self._open.discard(front)
    left = [rid for rid, f in list(self._front_of.items()) if f == front]
    for rid in left:
      self._front_of.pop(rid, None)
    self.aio.abort_many(left)
