"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 1 ms to 2 min: a CPU test server and a loaded GPU server both land inside.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0, 120.0)


class Metrics:
  """What `/metrics` exposes.

  Time to first token, inter-token latency, queue time and end-to-end latency
  are histograms (seconds, measured on the server around each request); K/V
  use, running/waiting requests, tokens/s and compile time are gauges refreshed
  after every engine step; token and request counters carry the totals.
  """

  def __init__(self, capacity: int):
    self.registry = r = CollectorRegistry()
    self.capacity = capacity
    hist = lambda name, doc: Histogram(name, doc, registry=r, buckets=_BUCKETS)
    self.ttft = hist("jaxkv_time_to_first_token_seconds", "Request arrival to its first token")
    self.itl = hist("jaxkv_inter_token_latency_seconds",
                    "Time between a request's consecutive tokens (a delta of m tokens counts m "
                    "times, each at the delta's interval / m)")
    self.queue = hist("jaxkv_queue_time_seconds", "Request arrival to its admission into the loop")
    self.e2e = hist("jaxkv_e2e_request_latency_seconds", "Request arrival to its last token")
    self.kv_usage = Gauge("jaxkv_kv_cache_usage_ratio",
                          "Cache positions held by live sequences / capacity", registry=r)
    self.running = Gauge("jaxkv_requests_running", "Requests admitted into the loop", registry=r)
    self.waiting = Gauge("jaxkv_requests_waiting", "Requests waiting for admission", registry=r)
    self.tokens_per_second = Gauge(
        "jaxkv_generation_tokens_per_second",
        "Tokens generated per second over the last engine step (compilation excluded)", registry=r)
    self.compile_seconds = Gauge(
        "jaxkv_compile_seconds", "Seconds the engine spent tracing and compiling since its cache "
        "was made (apart from serving time)", registry=r)
    self.prompt_tokens = Counter("jaxkv_prompt_tokens", "Prompt tokens of accepted requests",
                                 registry=r)
    self.generation_tokens = Counter("jaxkv_generation_tokens", "Tokens generated", registry=r)
    self.finished = Counter("jaxkv_requests_finished", "Finished samples by finish reason",
                            ["reason"], registry=r)
    self.errors = Counter("jaxkv_request_errors", "Requests answered with an error, by status",
                          ["status"], registry=r)
    self._last = (time.perf_counter(), 0.0, 0.0)

  def after_step(self, engine, deltas) -> None:
    """Refreshes the gauges from the engine after one step."""
    live = engine._live   # pylint: disable=protected-access
    if live is None:
      return
    running, waiting = live.counts()
    self.running.set(running)
    self.waiting.set(waiting)
    self.kv_usage.set(live.held / self.capacity)
    stats = engine.stats
    self.compile_seconds.set(stats.compile_seconds)
    new = sum(len(d.tokens) for d in deltas)
    self.generation_tokens.inc(new)
    _, last_serve, _ = self._last
    serve = stats.serve_seconds
    if serve > last_serve:
      self.tokens_per_second.set(new / (serve - last_serve))
    self._last = (time.perf_counter(), serve, 0.0)

  def render(self) -> bytes:
    return generate_latest(self.registry)
