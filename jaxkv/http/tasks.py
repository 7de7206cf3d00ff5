"""The HTTP front's asyncio helpers: work off the event loop, client departures, the stats line,
the drain's deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time

import uvicorn
from fastapi import Request

from jaxkv.http.metrics import Metrics


# Text beyond this many characters is tokenised in a worker thread (`Tokenizer.encode` then goes
# through `encode_batch`, which releases the GIL), so a megabyte prompt does not hold the event
# loop; shorter text is not worth the hop.
OFF_LOOP_CHARS = 1 << 16


async def off_loop(size: int, fn):
  """`fn()`, in a worker thread when `size` (characters to tokenise) is large."""
  return await asyncio.to_thread(fn) if size > OFF_LOOP_CHARS else fn()


async def log_stats(engine, metrics: Metrics, every: float) -> None:
  """Prints one line of serving stats every `every` seconds while anything is in flight."""
  last_tokens, last_time = engine.stats.generated, time.perf_counter()
  while True:
    await asyncio.sleep(every)
    running, waiting = engine.counts()
    now, tokens = time.perf_counter(), engine.stats.generated
    if running or waiting or tokens != last_tokens:
      print(f"jaxkv serve: {(tokens - last_tokens) / (now - last_time):.1f} tokens/s, "
            f"running {running}, waiting {waiting}, K/V {100 * engine.held / engine.capacity:.1f}%, "
            f"preemptions {engine.stats.preemptions}", flush=True)
    last_tokens, last_time = tokens, now


async def disconnected(http: Request) -> None:
  """Returns once the client of a plain (non-streaming) request has gone away."""
  while not await http.is_disconnected():
    await asyncio.sleep(0.05)


async def until(gen, watcher):
  """`gen`'s items until it ends, or until `watcher` finishes (then the rest is dropped)."""
  while True:
    nxt = asyncio.ensure_future(gen.__anext__())
    done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if nxt not in done:
      nxt.cancel()   # and wait for it: closing the generator while it runs would raise
      with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await nxt
      return
    try:
      yield nxt.result()
    except StopAsyncIteration:
      return


class Draining(Exception):
  """Delivered to the requests still in flight when the drain's deadline passes."""


# Past the drain's deadline, uvicorn cancels what still runs (a 500 or a cut stream); the
# requests left are answered this long before it, at most (a quarter of a short timeout).
DRAIN_MARGIN = 1.0


class Drain:
  """The server's shutdown: `start` (from the signal handler) arms a deadline on the event loop;
  when it passes, `on_past` ends every request still in flight with a well-formed answer.

  Args:
    on_past: called on the event loop at the deadline (it ends the engine's requests).

  Attributes:
    answered: HTTP requests answered 503 at the deadline (the app counts them as it answers).
  """

  def __init__(self, on_past):
    self.on_past = on_past
    self.loop: asyncio.AbstractEventLoop | None = None   # set when the app starts
    self.started = False
    self.answered = 0

  def attach(self) -> None:
    """Called on the event loop at startup: where `start` schedules the deadline."""
    self.loop = asyncio.get_running_loop()

  def start(self, timeout: float) -> None:
    """The shutdown began and in-flight requests have `timeout` seconds (any thread; once)."""
    if self.started or self.loop is None:
      return
    self.started = True
    grace = max(0.0, timeout - min(DRAIN_MARGIN, timeout / 4))
    self.loop.call_soon_threadsafe(self.loop.call_later, grace, self.on_past)

  def report(self) -> None:
    """One line for the requests answered 503 at the deadline (at the app's shutdown)."""
    if self.answered:
      print(f"jaxkv serve: the shutdown timeout passed with {self.answered} requests in flight; "
            "each was answered 503 (a stream: an error event, then [DONE])", flush=True)


class DrainingServer(uvicorn.Server):
  """uvicorn's server that starts the app's `Drain` when a shutdown signal arrives, so the
  requests still in flight at the timeout are answered just before uvicorn would cancel them."""

  def __init__(self, config: uvicorn.Config, drain: Drain):
    super().__init__(config)
    self.drain = drain

  def handle_exit(self, sig, frame) -> None:
    super().handle_exit(sig, frame)
    self.drain.start(self.config.timeout_graceful_shutdown or 0.0)
