"""HTTP fronts in processes of their own (`jaxkv serve --api-server-count N`, N > 1).

The engine's process keeps the engine and steps it (`jaxkv.serve.hosting.EngineHost`);
each of N spawned processes runs the same app (`create_app`) on the one listening
socket, the kernel spreading connections across them. A front's app is given

- an `EngineView`: the engine's limits (checked in the front, before anything crosses
  the pipe) and its counters as of the host's last message;
- a `RemoteEngine`: the `AsyncEngine` calls the app makes (`add_request`, `deltas`,
  `abort`, `abort_many`, `fail_all`, `close`), carried over the pipe. A receiver thread
  routes each message's deltas into per-request mailboxes on the front's event loop.

A front imports jax but never uses an accelerator (it pins jax to the CPU first). If
the engine's process goes away, every request in flight ends with an `EngineError`.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import pickle
import signal
import socket
import threading
from typing import AsyncIterator

from jaxkv.serve.aio import _Mailbox, delivered, fail_boxes, route
from jaxkv.serve.errors import EngineError
from jaxkv.serve.hosting import EngineHost, from_row
from jaxkv.serve.parallel import DataParallelEngine
from jaxkv.serve.requests import Request, check_request
from jaxkv.serve.results import EngineStats


def engine_info(engine) -> dict:
  """What a front needs of `engine` (an `Engine` or `DataParallelEngine`): plain values."""
  one = engine.engines[0] if isinstance(engine, DataParallelEngine) else engine
  return {"capacity": engine.capacity, "max_len": engine.max_len,
          "limits": dict(vocab_size=one.vocab_size, max_len=one.max_len,
                         max_seqs=one.config.max_seqs, capacity=one.config.capacity,
                         max_stop_tokens=one.max_stop, max_logprobs=one.max_logprobs,
                         grammar_room=one.grammar_pool)}


class EngineView:
  """The engine as a front's app reads it: fixed limits, counters from the host."""

  def __init__(self, info: dict):
    self.capacity, self.max_len = info["capacity"], info["max_len"]
    self._limits = info["limits"]
    self.vocab_size, self.grammar_pool = self._limits["vocab_size"], self._limits["grammar_room"]
    self._counts, self.waiting_tokens, self.held = (0, 0), 0, 0
    # The engine's own stats record, filled from the host's counters: its derived figures
    # (`serve_seconds`, `acceptance_rate`) are computed as in the engine's process.
    self.stats = EngineStats()

  def check(self, request: Request) -> None:
    """`Engine.check`: TypeError/ValueError naming the field unless the engine can serve it."""
    check_request(request, **self._limits)

  def counts(self) -> tuple[int, int]:
    return self._counts

  def update(self, status: tuple) -> None:
    (running, waiting, self.waiting_tokens, self.held, generated, preemptions, cached,
     compiled, seconds, drafted, accepted) = status
    self._counts = (running, waiting)
    s = self.stats
    s.generated, s.preemptions, s.cached_tokens = generated, preemptions, cached
    s.compile_seconds, s.seconds = compiled, seconds
    s.draft_tokens, s.accepted_tokens = drafted, accepted


class RemoteEngine:
  """The `AsyncEngine` calls of `create_app`, served by an `EngineHost` across `conn`.

  Request ids are `front`, `front + fronts`, ...: unique across the fronts.
  """

  def __init__(self, conn, view: EngineView, *, front: int = 0, fronts: int = 1):
    self.conn, self.view = conn, view
    self.on_step = None
    self._boxes: dict[object, _Mailbox] = {}
    self._ids = itertools.count(front, fronts)
    self._loop: asyncio.AbstractEventLoop | None = None
    self._send_lock = threading.Lock()
    self._receiver: threading.Thread | None = None
    self._closed = False
    self._gone: EngineError | None = None

  def add_request(self, request: Request):
    """Checks `request` here (ValueError/TypeError as `Engine.add_request`) and sends it; its id."""
    if self._closed:
      raise RuntimeError("the engine client is closed")
    self.view.check(request)
    self._loop = asyncio.get_running_loop()
    if self._receiver is None:
      self._receiver = threading.Thread(target=self._receive, name="jaxkv-front-receiver",
                                        daemon=True)
      self._receiver.start()
    rid = request.request_id
    if rid is None:
      rid = next(self._ids)
      request = request.replace(request_id=rid)
    elif rid in self._boxes:
      raise ValueError(f"request_id={rid!r} is already in flight")
    box = self._boxes[rid] = _Mailbox(request.params.n)
    if self._gone is not None:
      box.put(self._gone)
    else:
      self._send(("add", request))
    return rid

  def abort(self, request_id, index: int | None = None) -> bool:
    if request_id not in self._boxes:
      return False
    self._send(("abort", request_id, index))
    return True

  def abort_many(self, request_ids) -> int:
    ids = [rid for rid in request_ids if rid in self._boxes]
    if ids:
      self._send(("abort_many", ids))
    return len(ids)

  def fail_all(self, error: Exception) -> int:
    """`AsyncEngine.fail_all`: every request this front is reading ends with `error`."""
    return fail_boxes(self._boxes, error)

  def warm_up(self) -> float:
    return 0.0   # the engine's process compiled before the fronts started

  def close(self, timeout: float | None = None) -> None:
    """Closes the pipe: the host aborts what this front still has in flight."""
    self._closed = True
    try:   # shut the socket down: a receiver blocked reading it would keep it open
      dup = socket.socket(fileno=os.dup(self.conn.fileno()))
      dup.shutdown(socket.SHUT_RDWR)
      dup.close()
    except (OSError, ValueError):
      pass
    # The receiver then reads its end and returns; the connection is closed once it has (closed
    # under a read, its handle would vanish mid-call).
    if self._receiver is not None:
      self._receiver.join(5.0 if timeout is None else timeout)
    if self._receiver is None or not self._receiver.is_alive():
      self.conn.close()

  def deltas(self, request_id) -> AsyncIterator:
    """`AsyncEngine.deltas`: the request's deltas until each sample has finished; leaving
    early aborts it."""
    return delivered(self._boxes, request_id, self._ended)

  def _ended(self, request_id, finished: bool) -> None:
    if not finished and self._gone is None and not self._closed:
      self.abort(request_id)

  def _send(self, message) -> None:
    with self._send_lock:
      try:
        self.conn.send(message)
      except (OSError, ValueError):   # the engine's process has gone: the receiver reports it
        pass

  def _receive(self) -> None:
    while True:
      try:
        message = pickle.loads(self.conn.recv_bytes())
      except (EOFError, OSError, ValueError):
        if not self._closed:
          self._post(self._lost, None)
        return
      self._post(self._handle, message)

  def _post(self, fn, arg) -> None:
    try:
      self._loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:   # that event loop has closed: nobody there listens any more
      pass

  def _handle(self, message) -> None:   # on the event loop
    kind = message[0]
    if kind == "deltas":
      _, rows, status = message
      self.view.update(status)
      route(self._boxes, [from_row(row) for row in rows], self.on_step)
    elif kind == "failed":
      _, ids, text = message
      for rid in ids:
        box = self._boxes.get(rid)
        if box is not None:
          box.put(EngineError(f"step failed; request {rid!r} was dropped: {text}", []))
    elif kind == "refused":
      _, rid, text = message
      box = self._boxes.get(rid)
      if box is not None:
        box.put(EngineError(f"the engine refused request {rid!r}: {text}", []))

  def _lost(self, _) -> None:
    self._gone = EngineError("the engine's process has gone; the request was dropped", [])
    self.fail_all(self._gone)


def front_main(conn, sock: socket.socket, info: dict, tokenizer, index: int, count: int,
               app_args: dict, server_args: dict) -> None:
  """A front process: the app over `RemoteEngine(conn)`, served by uvicorn on `sock`."""
  import jax   # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")   # a front never touches the accelerator
  import uvicorn   # pylint: disable=g-import-not-at-top
  from jaxkv.http.app import create_app   # pylint: disable=g-import-not-at-top
  from jaxkv.http.tasks import DrainingServer   # pylint: disable=g-import-not-at-top
  view = EngineView(info)
  client = RemoteEngine(conn, view, front=index, fronts=count)
  app = create_app(view, tokenizer, client=client, **app_args)
  # As the engine's process after its warm-up (cli.warm_up): a full collection under load then
  # walks only what serving makes, not the imports' heap.
  gc.collect()
  gc.freeze()
  config = uvicorn.Config(app, **server_args)
  DrainingServer(config, app.state.drain).run(sockets=[sock])


class FrontProcesses:
  """`count` front processes on `host:port` over an `EngineHost` of `engine` (warmed up).

  `start` binds the port and spawns the fronts, `serve` handles their messages until they
  have all stopped (then stepping stops), `stop` asks them to (SIGTERM: each drains as one
  server would).

  Args:
    app_args: `create_app`'s keyword arguments other than the engine, tokenizer and client
      (`stats_interval` applies to the first front only: its line is the engine's).
    server_args: `uvicorn.Config`'s (log level, graceful shutdown timeout).
    aio_args: the engine's stepping arguments (`AsyncEngine`'s).
  """

  def __init__(self, engine, tokenizer, *, count: int, host: str, port: int, app_args: dict,
               server_args: dict, aio_args: dict):
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
      raise ValueError(f"count={count!r} must be an int >= 1")
    self.engine, self.tokenizer, self.count = engine, tokenizer, count
    self.host, self.port = host, port
    self.app_args, self.server_args, self.aio_args = app_args, server_args, aio_args
    self.procs: list = []
    self.hosted: EngineHost | None = None

  def start(self) -> None:
    import multiprocessing   # pylint: disable=g-import-not-at-top
    ctx = multiprocessing.get_context("spawn")
    family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((self.host, self.port))
    sock.listen(2048)
    self.port = sock.getsockname()[1]
    info = engine_info(self.engine)
    pipes = [ctx.Pipe() for _ in range(self.count)]
    for i, (_, child) in enumerate(pipes):
      args_i = dict(self.app_args)
      if i:
        args_i["stats_interval"] = 0.0
      self.procs.append(ctx.Process(
          target=front_main, name=f"jaxkv-front-{i}",
          args=(child, sock, info, self.tokenizer, i, self.count, args_i, self.server_args)))
    for p in self.procs:
      p.start()
    for _, child in pipes:
      child.close()
    sock.close()   # the fronts hold it now
    self.hosted = EngineHost(self.engine, [parent for parent, _ in pipes], **self.aio_args)

  def serve(self) -> None:
    try:
      self.hosted.serve()
    finally:
      for p in self.procs:
        p.join(timeout=30)
        if p.is_alive():
          p.terminate()

  def stop(self) -> None:
    for p in self.procs:
      if p.is_alive():
        os.kill(p.pid, signal.SIGTERM)


def serve_with_fronts(engine, tokenizer, *, count: int, host: str, port: int, app_args: dict,
                      server_args: dict, aio_args: dict, on_listening=None) -> None:
  """Serves `engine` through `count` front processes (`FrontProcesses`) until they have all
  stopped; SIGTERM or SIGINT to this process is passed on to them. `on_listening` is called
  once they have started. Call it on the main thread (it installs signal handlers)."""
  fronts = FrontProcesses(engine, tokenizer, count=count, host=host, port=port,
                          app_args=app_args, server_args=server_args, aio_args=aio_args)
  fronts.start()
  previous = {s: signal.signal(s, lambda *_: fronts.stop())
              for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    if on_listening is not None:
      on_listening()
    fronts.serve()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
