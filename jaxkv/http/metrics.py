"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

import bisect
import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# Latency buckets from 1 ms to 2 min: a CPU test server and a loaded GPU server both land inside.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0, 120.0)


class _Histogram(Collector):
  """A histogram of one series whose `observe` takes a count: a delta of m tokens is one call,
  not m (prometheus_client's `Histogram.observe` costs a lock and a bucket scan per call, paid
  per token on the event loop). Observed and rendered on the event loop only."""

  def __init__(self, name: str, doc: str, model_name: str, buckets, registry):
    self.name, self.doc, self.model_name = name, doc, model_name
    self.bounds = tuple(buckets) + (math.inf,)
    self.counts = [0] * len(self.bounds)
    self.total = 0.0
    registry.register(self)

  def observe(self, value: float, count: int = 1) -> None:
    self.counts[bisect.bisect_left(self.bounds, value)] += count
    self.total += value * count

  def collect(self):
    family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, n in zip(self.bounds, self.counts):
      cumulative += n
      buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
    family.add_metric([self.model_name], buckets, self.total)
    yield family


class _Bound:
  """A labelled metric with its `model_name` label bound: `.labels(...)` takes the others."""

  def __init__(self, metric, model_name: str):
    self.metric, self.model_name = metric, model_name

  def labels(self, *values):
    return self.metric.labels(self.model_name, *values)


class Metrics:
  """What `/metrics` exposes, every series labelled with `model_name` (as vLLM's are).

  Time to first token, inter-token latency, queue time and end-to-end latency
  are histograms (seconds, measured on the server around each request); K/V
  use, running/waiting requests, preemptions, the prefix-cache hit rate,
  tokens/s, compile time and the speculative acceptance rate are gauges refreshed
  after every engine step; token, draft-token and request counters carry the totals.
  """

  def __init__(self, capacity: int, model_name: str = ""):
    self.registry = r = CollectorRegistry()
    self.capacity = capacity
    label = ["model_name"]
    hist = lambda name, doc: _Histogram(name, doc, model_name, _BUCKETS, r)
    gauge = lambda name, doc: Gauge(name, doc, label, registry=r).labels(model_name)
    counter = lambda name, doc: Counter(name, doc, label, registry=r).labels(model_name)
    self.ttft = hist("jaxkv_time_to_first_token_seconds", "Request arrival to its first token")
    self.itl = hist("jaxkv_inter_token_latency_seconds",
                    "Time between a request's consecutive tokens (a delta of m tokens counts m "
                    "times, each at the delta's interval / m)")
    self.queue = hist("jaxkv_queue_time_seconds", "Request arrival to its admission into the loop")
    self.e2e = hist("jaxkv_e2e_request_latency_seconds", "Request arrival to its last token")
    self.kv_usage = gauge("jaxkv_kv_cache_usage_ratio",
                          "Cache positions held by live sequences / capacity (0 when idle)")
    self.running = gauge("jaxkv_requests_running", "Requests admitted into the loop")
    self.waiting = gauge("jaxkv_requests_waiting", "Requests waiting for admission")
    self.preempted = gauge("jaxkv_requests_preempted",
                           "Sequences preempted (paged storage: pages dropped, recomputed later) "
                           "since the engine's cache was made")
    self.prefix_hit_rate = gauge("jaxkv_prefix_cache_hit_rate",
                                 "Prompt tokens adopted from cached pages / prompt tokens accepted")
    self.tokens_per_second = gauge(
        "jaxkv_generation_tokens_per_second",
        "Tokens generated per second over the last engine step (compilation excluded)")
    self.compile_seconds = gauge(
        "jaxkv_compile_seconds", "Seconds the engine spent tracing and compiling since its cache "
        "was made (apart from serving time)")
    self.prompt_tokens = counter("jaxkv_prompt_tokens", "Prompt tokens of accepted requests")
    self.generation_tokens = counter("jaxkv_generation_tokens", "Tokens generated")
    self.finished = _Bound(Counter("jaxkv_requests_finished", "Finished samples by finish reason",
                                   label + ["reason"], registry=r), model_name)
    self.errors = _Bound(Counter("jaxkv_request_errors", "Requests answered with an error, by "
                                 "status", label + ["status"], registry=r), model_name)
    self.draft_tokens = counter("jaxkv_spec_decode_num_draft_tokens",
                                "Speculative decoding: draft tokens verified")
    self.accepted_tokens = counter("jaxkv_spec_decode_num_accepted_tokens",
                                   "Speculative decoding: draft tokens accepted (each a step saved)")
    self.acceptance = gauge("jaxkv_spec_decode_acceptance_rate",
                            "Speculative decoding: accepted / verified draft tokens since the "
                            "engine's cache was made (0 before any draft)")
    self._drafts = (0, 0)   # the engine's counters at the last step
    self._prompt_total = 0
    self._last = (time.perf_counter(), 0.0, 0.0)

  def accepted(self, prompt_tokens: int) -> None:
    self._prompt_total += prompt_tokens
    self.prompt_tokens.inc(prompt_tokens)

  def after_step(self, engine, deltas) -> None:
    """Refreshes the gauges from the engine after one step."""
    running, waiting = engine.counts()
    self.running.set(running)
    self.waiting.set(waiting)
    self.kv_usage.set(engine.held / self.capacity)
    stats = engine.stats
    self.preempted.set(stats.preemptions)
    if self._prompt_total:
      self.prefix_hit_rate.set(stats.cached_tokens / self._prompt_total)
    self.compile_seconds.set(stats.compile_seconds)
    drafted, accepted = stats.draft_tokens, stats.accepted_tokens
    if (drafted, accepted) != self._drafts:
      # The engine's counts restart with a new cache: count on from there.
      last_d, last_a = self._drafts if drafted >= self._drafts[0] else (0, 0)
      self.draft_tokens.inc(drafted - last_d)
      self.accepted_tokens.inc(accepted - last_a)
      self.acceptance.set(stats.acceptance_rate)
      self._drafts = (drafted, accepted)
    new = sum(len(d.tokens) for d in deltas)
    self.generation_tokens.inc(new)
    _, last_serve, _ = self._last
    serve = stats.serve_seconds
    if serve > last_serve:
      self.tokens_per_second.set(new / (serve - last_serve))
    self._last = (time.perf_counter(), serve, 0.0)

  def render(self) -> bytes:
    return generate_latest(self.registry)
