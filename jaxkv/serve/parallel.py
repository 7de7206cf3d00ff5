"""`DataParallelEngine`: one `Engine` per device, the queue split between them.

For a model that fits one device, data parallelism serves more requests per
second than splitting the model: each device holds a full copy of the weights
and its own cache, and serves its share of the queue in its own jitted loop.
The engines run in host threads (each loop entry releases the GIL while the
device works), so the devices serve at the same time.

The queue is split greedily by work: requests are taken longest first
(prompt + n x max_tokens) and each goes to the device with the least work so
far; each device admits its share in the `admission` order of `Engine.run`. Completions come
back in the order of the queue, exactly as one `Engine` returns them; with the
same seeds, sampled tokens do not depend on which device served a request.

Served incrementally (`AsyncEngine(DataParallelEngine(...))`, `jaxkv serve
--data-parallel-size`), each request goes to the engine with the fewest requests
in flight and each engine steps on its own threads; the front reads the group's
counters here (`counts`, `held`, `stats`, ...: sums over the engines).
"""

from __future__ import annotations

import concurrent.futures
from typing import Sequence

import jax

from jaxkv.serve.admission import check_admission, labelled, queue_order
from jaxkv.serve.engine import Engine
from jaxkv.serve.errors import EngineError
from jaxkv.serve.requests import Request
from jaxkv.serve.results import Completion, EngineStats


class DataParallelEngine:
  """`Engine`s on several devices serving one queue.

  Args:
    model: a `jaxkv.serve.StepModel` (its parameters are copied to every device).
    devices: the devices (default: every local device); at least one.
    **engine_kwargs: passed to every `Engine` (`max_len`, `max_steps`, `widths`, ...;
      not `mesh` or `device`).
  """

  def __init__(self, model, *, devices: Sequence | None = None, **engine_kwargs):
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
      raise ValueError(f"devices={devices!r} must be a non-empty sequence of jax.Device")
    if len(set(devices)) != len(devices):
      raise ValueError(f"devices={devices!r} holds a device twice")
    for name in ("mesh", "device"):
      if name in engine_kwargs:
        raise ValueError(f"{name}= is chosen per device by DataParallelEngine")
    self.devices = devices
    self.engines = [Engine(model, device=d, **engine_kwargs) for d in devices]
    self.completions: list[Completion] = []

  @classmethod
  def of(cls, engines: Sequence[Engine]) -> "DataParallelEngine":
    """A group of engines built elsewhere (each on its own devices or mesh), served alike.

    Raises:
      ValueError: no engines, or engines that differ in what they accept (`max_len`,
        vocabulary, stop tokens, logprobs).
    """
    engines = list(engines)
    if not engines or not all(isinstance(e, Engine) for e in engines):
      raise ValueError(f"engines={engines!r} must be a non-empty sequence of Engine")
    alike = lambda e: (e.max_len, e.vocab_size, e.max_stop, e.max_logprobs, e.config.max_seqs,
                       e.grammar_pool)
    if len({alike(e) for e in engines}) != 1:
      raise ValueError("engines differ in max_len, vocab_size, max_stop_tokens, max_logprobs, "
                       f"max_seqs or grammar_pool: {[alike(e) for e in engines]}")
    group = cls.__new__(cls)
    group.devices = [e.device for e in engines]
    group.engines, group.completions = engines, []
    return group

  # ------------------------------------------------------------------ what a front reads

  @property
  def config(self):
    """The first engine's `CacheConfig` (every engine's geometry is the same)."""
    return self.engines[0].config

  @property
  def capacity(self) -> int:
    """Cache positions of all the engines together."""
    return sum(e.capacity for e in self.engines)

  # What every engine of the group shares.
  max_len = property(lambda self: self.engines[0].max_len)
  vocab_size = property(lambda self: self.engines[0].vocab_size)
  max_stop = property(lambda self: self.engines[0].max_stop)
  max_logprobs = property(lambda self: self.engines[0].max_logprobs)
  grammar_pool = property(lambda self: self.engines[0].grammar_pool)
  implementations = property(lambda self: self.engines[0].implementations)
  gemm = property(lambda self: self.engines[0].gemm)

  def check(self, request: Request) -> None:
    """Raises unless the engines can serve `request` (they accept the same requests)."""
    self.engines[0].check(request)

  def counts(self) -> tuple[int, int]:
    """`(running, waiting)` requests of the incremental API, over every engine."""
    pairs = [e.counts() for e in self.engines]
    return sum(r for r, _ in pairs), sum(w for _, w in pairs)

  @property
  def waiting_tokens(self) -> int:
    return sum(e.waiting_tokens for e in self.engines)

  @property
  def held(self) -> int:
    return sum(e.held for e in self.engines)

  @property
  def stats(self) -> EngineStats:
    """The engines' stats merged (counters summed; wall and compile times the slowest's)."""
    return self._merged_stats(self.engines)

  def warm_up(self, steps=(1,), *, stepwise: bool = False) -> float:
    """`Engine.warm_up` on every engine at once; the slowest one's compile seconds."""
    with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
      return max(pool.map(lambda e: e.warm_up(steps, stepwise=stepwise), self.engines))

  def run(self, requests: Sequence[Request], *,
          admission: str = "longest_first") -> list[Completion]:
    """Serves every request across the devices; completions in (request order, sample index).

    `admission`: each engine's admission order (`Engine.run`).

    Raises:
      ValueError, TypeError: a request no engine can serve (nothing is served).
      EngineError: an engine failed; `completions` holds every sample finished on
        any device (the other devices finish their shares first).
    """
    check_admission(admission)
    requests = labelled(requests)
    order = queue_order(requests)
    for r in requests:
      self.engines[0].check(r)   # the engines are alike: one check refuses before any serves
    shares = self._split(requests)
    with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
      # An engine with no share runs [] too: its stats restart, so `stats` merges this run only.
      futures = [pool.submit(e.run, share, admission=admission)
                 for e, share in zip(self.engines, shares)]
      errors = []
      for f in futures:
        if f.exception() is not None:
          errors.append(f.exception())
    self.completions = sorted([c for e, share in zip(self.engines, shares) if share
                               for c in e.completions],
                              key=lambda c: (order[c.request_id], c.index))
    if errors:
      raise EngineError(f"{len(errors)} of {len(self.engines)} engines failed; first: "
                        f"{errors[0]}", self.completions) from errors[0]
    return self.completions

  def _split(self, requests: list[Request]) -> list[list[Request]]:
    work = [0] * len(self.engines)
    owner = {}
    cost = lambda r: len(r.prompt) + r.params.n * r.params.max_tokens
    for i in sorted(range(len(requests)), key=lambda i: -cost(requests[i])):
      d = min(range(len(work)), key=lambda d: work[d])
      owner[i] = d
      work[d] += cost(requests[i])
    return [[r for i, r in enumerate(requests) if owner[i] == d] for d in range(len(work))]

  @staticmethod
  def _merged_stats(engines) -> EngineStats:
    # The engines run at once: wall and compile times are the slowest engine's, not sums.
    out = EngineStats(implementations=engines[0].implementations if engines else ())
    for e in engines:
      s = e.stats
      out.compile_seconds = max(out.compile_seconds, s.compile_seconds)
      out.steps += s.steps
      out.step_tokens += s.step_tokens
      out.generated += s.generated
      out.occupancy += s.occupancy
      out.loop_entries += s.loop_entries
      out.aborted += s.aborted
      out.preemptions += s.preemptions
      out.evictions += s.evictions
      out.cached_tokens += s.cached_tokens
      out.draft_tokens += s.draft_tokens
      out.accepted_tokens += s.accepted_tokens
      out.seconds = max(out.seconds, s.seconds)
      out.admissions += s.admissions
      # One driver per engine, all at once: the slowest's driver times, as for `seconds`.
      out.pace_seconds = max(out.pace_seconds, s.pace_seconds)
      out.step_call_seconds = max(out.step_call_seconds, s.step_call_seconds)
      out.admit_seconds = max(out.admit_seconds, s.admit_seconds)
      out.peak_rows = max(out.peak_rows, s.peak_rows)
      for w, n in s.width_steps.items():
        out.width_steps[w] = out.width_steps.get(w, 0) + n
    return out
