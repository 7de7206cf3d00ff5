"""The HTTP front's asyncio helpers: work off the event loop, client departures, the stats line."""

from __future__ import annotations

import asyncio
import contextlib
import time

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
