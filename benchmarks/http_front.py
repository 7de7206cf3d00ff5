"""How fast the HTTP front streams, with the device taken out: `jaxkv serve`'s app over an engine
whose steps are a timer.

The app is `create_app`'s, unchanged, over a real (tiny) engine for request checks; only the
`AsyncEngine`'s two threads are replaced by one that, every `--step-ms`, posts one token for
every running sample to the event loop, as the real reader posts a read-back's deltas. So the
figures are the front's own: how many stream events per second one event loop writes, what each
costs it in CPU, and how late tokens reach the clients (ITL) when the steps come faster than the
front can write them (then a client's deltas are merged: fewer, longer events).

The clients are raw sockets in a process of their own (no JSON parsing, no SDK), so they cost
the server's machine little.

  python benchmarks/http_front.py --streams 256 --tokens 160 --step-ms 3.4 --fronts auto,asyncio
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--streams", type=int, default=256, help="concurrent streaming requests")
  p.add_argument("--tokens", type=int, default=160, help="tokens per request")
  p.add_argument("--step-ms", type=float, default=3.4, help="the timer engine's step time")
  p.add_argument("--fronts", default="auto,asyncio",
                 help="comma-separated: auto (uvloop and httptools where installed, as `jaxkv "
                      "serve`), asyncio (asyncio's loop and h11)")
  p.add_argument("--switch-us", type=int, default=500,
                 help="the interpreter's switch interval while serving, microseconds")
  p.add_argument("--out", default=None, help="write the results as JSON here")
  args = p.parse_args(argv)
  for name in ("streams", "tokens"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  if not 0 < args.step_ms <= 1000:
    p.error("--step-ms must be in (0, 1000]")
  for front in args.fronts.split(","):
    if front not in ("auto", "asyncio"):
      p.error(f"--fronts: {front!r} must be auto or asyncio")
  return args


def _timer_engine_class():
  from jaxkv.serve import aio   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.results import Delta   # pylint: disable=g-import-not-at-top

  class TimerEngine(aio.AsyncEngine):
    """An `AsyncEngine` whose steps are a timer: one token per running sample each step."""

    step_seconds = 0.0034

    def add_request(self, request):
      if self._closed:
        raise RuntimeError("closed")
      self._loop = asyncio.get_running_loop()
      self.engine.check(request)
      rid = request.request_id if request.request_id is not None else next(self._ids)
      self._boxes[rid] = aio._Mailbox(request.params.n)   # pylint: disable=protected-access
      with self._lock:
        self._running[rid] = [request.params.max_tokens] * request.params.n
      if not self._threads:
        self._switch_before = sys.getswitchinterval()
        sys.setswitchinterval(self.switch_interval)
        self._threads = [threading.Thread(target=self._tick, daemon=True)]
        self._threads[0].start()
      return rid

    def abort(self, request_id, index=None):
      with self._lock:
        return self._running.pop(request_id, None) is not None

    def abort_many(self, request_ids):
      return sum(self.abort(r) for r in request_ids)

    def _tick(self):
      next_at = time.perf_counter()
      while not self._closed:
        next_at += self.step_seconds
        time.sleep(max(0.0, next_at - time.perf_counter()))
        deltas = []
        with self._lock:
          for rid, left in list(self._running.items()):
            for j, k in enumerate(left):
              if k > 0:
                left[j] = k - 1
                deltas.append(Delta(rid, j, (7,), None if k > 1 else "length", 0))
            if not any(left):
              del self._running[rid]
        if deltas:
          self._post(self._route, deltas)
        self.ticks += 1

  def make(engine, **kwargs):
    e = TimerEngine(engine, **kwargs)
    e._lock, e._running, e.ticks = threading.Lock(), {}, 0   # pylint: disable=protected-access
    return e

  return make


def _client_main(port, streams, tokens, conn):   # a process of its own
  async def one(i, out):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"model": "bench", "prompt": [1, 2, 3], "max_tokens": tokens,
                       "temperature": 0.0, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    times, buf = [], b""
    while True:
      data = await reader.read(65536)
      if not data:
        break
      now = time.perf_counter()
      buf += data
      # Each `data: {...}` event with text is one arrival (the [DONE] line ends the stream).
      times += [now] * data.count(b'"text"')
      if b"data: [DONE]" in buf:
        break
      buf = buf[-16:]
    writer.close()
    out[i] = times

  async def main():
    out = [None] * streams
    start = time.perf_counter()
    await asyncio.gather(*(one(i, out) for i in range(streams)))
    return start, time.perf_counter(), out

  conn.send(asyncio.run(main()))


def run_front(args, make_engine, engine, tokenizer, front) -> dict:
  from jaxkv.http import app as app_module   # pylint: disable=g-import-not-at-top
  from serve import InProcessServer   # pylint: disable=g-import-not-at-top
  original = app_module.AsyncEngine
  app_module.AsyncEngine = lambda eng, **kw: make_engine(eng, **kw)
  try:
    app = app_module.create_app(engine, tokenizer, model_name="bench")
  finally:
    app_module.AsyncEngine = original
  aio = app.state.aio
  aio.step_seconds, aio.switch_interval = args.step_ms * 1e-3, args.switch_us * 1e-6
  gc.collect()
  gc.freeze()   # as `jaxkv serve`'s warm-up leaves the heap (cli.warm_up)
  server = InProcessServer(app, front)
  cpu = {}

  def loop_cpu(key):   # the event loop thread's CPU time, read on that thread
    cpu[key] = time.thread_time()

  try:
    loop = server.loop
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_client_main, args=(server.port, args.streams, args.tokens, child),
                       daemon=True)
    proc.start()
    ticks0 = aio.ticks
    loop.call_soon_threadsafe(loop_cpu, "start")
    start, end, arrivals = parent.recv()
    loop.call_soon_threadsafe(loop_cpu, "end")
    proc.join(10)
    ticks = aio.ticks - ticks0
    time.sleep(0.1)
  finally:
    server.stop()
    aio.close(timeout=10)
  events = sum(len(t) for t in arrivals)
  gaps = np.concatenate([np.diff(t) for t in arrivals if len(t) > 1] or [np.zeros(0)])
  wall = end - start
  out = {"front": server.front, "wall_s": wall, "events": events,
         "events_per_s": events / wall, "tokens": args.streams * args.tokens,
         "tokens_per_event": args.streams * args.tokens / max(1, events),
         "loop_cpu_s": cpu.get("end", 0.0) - cpu.get("start", 0.0),
         "ticks": ticks, "tick_ms": 1e3 * wall / max(1, ticks),
         "itl_ms": {q: float(1e3 * np.percentile(gaps, q)) if len(gaps) else None
                    for q in (50, 90, 99)},
         "loop_lag_ms": {q: float(1e3 * np.percentile(server.lags, q)) if server.lags else None
                         for q in (50, 99)}}
  out["loop_cpu_us_per_event"] = 1e6 * out["loop_cpu_s"] / max(1, events)
  return out


def main(argv=None) -> int:
  args = _args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from serve import write_checkpoint   # pylint: disable=g-import-not-at-top
  from jaxkv.cli import build_server   # pylint: disable=g-import-not-at-top
  checkpoint = write_checkpoint(tempfile.mkdtemp(prefix="jaxkv-front-"), small=True)
  engine, tokenizer, _ = build_server(checkpoint, max_seqs=args.streams)
  make_engine = _timer_engine_class()
  print(f"{args.streams} streams x {args.tokens} tokens, a step every {args.step_ms} ms "
        f"(ideal wall {args.tokens * args.step_ms / 1e3:.2f} s, ITL {args.step_ms} ms); "
        f"switch interval {args.switch_us} us", flush=True)
  results = {"args": vars(args), "fronts": {}}
  for i, front in enumerate(args.fronts.split(",")):   # a front named twice runs twice
    r = run_front(args, make_engine, engine, tokenizer, front)
    results["fronts"][f"{i}:{front}"] = r
    print(f"{r['front']:<22} wall {r['wall_s']:6.2f} s  {r['events_per_s']:8.0f} events/s  "
          f"{r['tokens_per_event']:5.2f} tokens/event  loop CPU {r['loop_cpu_us_per_event']:5.1f} "
          f"us/event  ITL p50/p90/p99 {r['itl_ms'][50]:.1f}/{r['itl_ms'][90]:.1f}/"
          f"{r['itl_ms'][99]:.1f} ms  steps {r['tick_ms']:.2f} ms apart  loop lag p99 "
          f"{r['loop_lag_ms'][99]:.1f} ms", flush=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
