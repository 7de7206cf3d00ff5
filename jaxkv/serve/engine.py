"""`Engine`: continuous batching over a request queue, the whole queue in one `jax.jit` call.

The incremental API's methods (`add_request`, `step`, ...) come from `incremental.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import secrets
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve.admission import (ADMISSION_ORDERS, admission_order, check_admission, labelled,
                                   plain_greedy, queue_order)
from jaxkv.serve.errors import EngineError
from jaxkv.serve.incremental import IncrementalAPI
from jaxkv.serve.live import LiveQueue
from jaxkv.serve.loop import serve_loop
from jaxkv.serve.memory import _grown_rows, check_engine_fits
from jaxkv.serve.step_model import check_step_model
from jaxkv.serve.report import layer_implementations
from jaxkv.serve.requests import MAX_LOGPROBS, Request, check_request
from jaxkv.serve.results import (PAGED_COUNTERS, Completion, EngineStats, RequestTiming,
                                 read_paged_counters, token_logprobs)
from jaxkv.serve.state import LoopState, init_loop_state, pack_queue
from jaxkv.serve.timing import compile_seconds


def _model_mesh(model, config: CacheConfig, mesh, kv_axis):
  """`(mesh, kv_axis)`: the arguments, else the model's attributes; validated."""
  from jaxkv._sharding import validate_mesh   # pylint: disable=g-import-not-at-top
  model_mesh = getattr(model, "mesh", None)
  mesh = model_mesh if mesh is None else mesh
  kv_axis = kv_axis or getattr(model, "kv_axis", None) or "tp"
  if model_mesh is not None and mesh is not model_mesh and mesh != model_mesh:
    raise ValueError(f"mesh={mesh} differs from the model's mesh {model_mesh}")
  validate_mesh(config, mesh, kv_axis)
  return mesh, kv_axis


def _split_placed(model, mesh):
  """`(graphdef, params)`, the params placed on `mesh` by their sharding metadata."""
  from jaxkv.nnx import shard_state, split_model   # pylint: disable=g-import-not-at-top
  graphdef, params = split_model(model)
  return graphdef, (params if mesh is None else shard_state(params, mesh))


MIN_MIDDLE_WIDTH = 128
# Prefill widths halve down to this many rows (where dense layers are compute-bound on
# a Hopper GPU for a 1B-8B model), then shrink by 4.
HALVING_WIDTH = 512


def default_widths(config: CacheConfig) -> tuple[int, ...]:
  """`(W, W / 2, ..., 512, 128, ..., narrow)`: the full width, prefill widths, decode.

  `narrow` is one decode slot per column rounded up to 8. Between `W` and
  `narrow`, widths halve while they stay at least `HALVING_WIDTH` rows and then
  shrink by 4, kept while they are at least `MIN_MIDDLE_WIDTH` and twice `narrow`
  (multiples of 8). A step runs at the narrowest width that holds its tokens
  (a prompt chunk next to the running decodes, the common step of a busy
  engine), so it pays for at most twice its rows where rows cost (dense layers
  cost about the weight read up to a few hundred rows on a Hopper GPU and grow
  with the rows past that: a 2048-wide step costs ~4x a 512-wide one,
  docs/PERFORMANCE.md), and below `MIN_MIDDLE_WIDTH` rows a width would cost its
  compilation and save nothing.
  """
  width = config.step_width
  narrow = -(-config.max_seqs // 8) * 8
  if narrow >= width:
    return (width,)
  widths = [width]
  shrink = lambda w: (w // 2 if w // 2 >= HALVING_WIDTH else w // 4) // 8 * 8
  middle = shrink(width)
  while middle >= max(MIN_MIDDLE_WIDTH, 2 * narrow):
    widths.append(middle)
    middle = shrink(middle)
  return tuple(widths) + (narrow,)


def _grow(config: CacheConfig, ls: LoopState, rows: int) -> LoopState:
  return dataclasses.replace(ls, cache=pure.grow(config, ls.cache, rows))


class Engine(IncrementalAPI):
  """Continuous batching over a request queue, the serving loop in one `jax.jit`.

  Args:
    model: a `jaxkv.serve.StepModel` (checked at construction).
    max_len: longest prompt + max_tokens of any request (the per-column token
      buffer); default `min(seq_len_limit, 4096)` (`seq_len_limit`: the cache's
      `max_seq_len`, else `capacity`). A sequence holds prompt + max_tokens - 1
      positions, so `max_len - 1` must not pass `max_seq_len`.
    max_steps: most steps per loop entry (bounds the time between host visits:
      `on_progress` is called after each entry).
    max_stop_tokens: most stop tokens per request.
    widths: step widths compiled into the loop, descending, the first the
      cache's `W` (default `default_widths`: `W`, prefill widths halving down
      to 512 rows, then a factor 4 apart, and one slot per column). A
      step runs at the narrowest width that holds every wanted token.
    mesh: optional `jax.sharding.Mesh` for tensor parallelism; default the
      model's `mesh` attribute (`jaxkv.models.Decoder(..., mesh=)`). The
      cache's K/V are split over `kv_axis`, the parameters are placed by their
      sharding metadata (`jaxkv.nnx.shard_state`), the rest is replicated, and
      the same jitted loop runs on the mesh.
    kv_axis: the mesh axis splitting KV heads; default the model's `kv_axis`
      attribute, else `"tp"`.
    device: optional `jax.Device` (without `mesh`): the parameters are copied there
      and the cache and loop live there (`DataParallelEngine` runs one engine per
      device).
    max_logprobs: most top logprobs a request may ask for per token
      (`SamplingParams.logprobs`; default 20, vLLM's, or the vocabulary if
      smaller). It sizes the logprob
      outputs, which exist only while a request wants logprobs (`run`) or hold
      a short window per output row (incremental API).
    prefix_cache: paged storage only (`CacheConfig(page_size=...)`): full pages
      of prompt tokens are kept after their requests finish (as retained
      sequences, evicted least recently used) and a request whose prompt starts
      with them adopts them instead of prefilling them (`paged_claims.py`). They
      live as long as the loop state: one `run`, or the incremental API's cache.
    scheduling: the order in which the incremental API (`add_request`, the
      server) moves waiting requests into the loop: `"fcfs"` (arrival order,
      the default) or `"longest_first"` (the largest `max_tokens` first, ties in
      arrival order: `Engine.run`'s default, which keeps a long request from
      decoding alone at the end of a burst, at the cost of later first tokens
      for short ones).
    compiler_options: XLA options for compiling the serving loop (`jax.jit`'s
      `compiler_options`: a mapping of XLA option name to value, e.g.
      `{"xla_gpu_enable_triton_gemm": False}`); default none (XLA's defaults,
      which served the e2e model fastest on H200: docs/PERFORMANCE.md,
      "Serving speed" §10). An option XLA does not know fails the first `run`.

  Over paged storage the engine admits by claims, not by prompt + max_tokens,
  and preempts the latest admitted sequence when a step would pass `capacity`
  (recomputing it later, with the same tokens); size such a cache from a byte
  budget with `jaxkv.serve.paged_cache_config`.

  Attributes:
    implementations: which attention implementation serves each cache layer and
      why (`jaxkv.serve.report.layer_implementations`; also on every `EngineStats`).
    gemm: the model's decode GEMM choice (`Decoder.gemm`, CONTRACT §10.8), or None for a
      model without one.
    stats: `EngineStats` of the last `run` (or of the incremental API): counters,
      compile time apart from serving time, tokens/s after warm-up.
    completions: the last run's completions, also when it failed; each carries
      its latency figures (`Completion.timing`).
  """

  def __init__(self, model, *, max_len: int | None = None, max_steps: int = 4096,
               max_stop_tokens: int = 8, widths: Sequence[int] | None = None, mesh=None,
               kv_axis: str | None = None, device=None, max_logprobs: int | None = None,
               prefix_cache: bool = False, compiler_options: Mapping[str, object] | None = None,
               scheduling: str = "fcfs"):
    for name, value in (("max_len", max_len), ("max_steps", max_steps),
                        ("max_stop_tokens", max_stop_tokens), ("max_logprobs", max_logprobs)):
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
        raise TypeError(f"{name}={value!r} must be an int")
    self.config, self.vocab_size = check_step_model(model)
    config = self.config
    if scheduling not in ADMISSION_ORDERS:
      raise ValueError(f"scheduling={scheduling!r} must be one of {ADMISSION_ORDERS}")
    self.scheduling = scheduling
    if not isinstance(prefix_cache, bool):
      raise TypeError(f"prefix_cache={prefix_cache!r} must be a bool")
    if prefix_cache and not config.is_paged:
      raise ValueError("prefix_cache=True needs paged storage: the model's cache_config has "
                       "page_size=None (see jaxkv.serve.paged_cache_config)")
    self.prefix_cache = prefix_cache
    self.mesh, self.kv_axis = _model_mesh(model, config, mesh, kv_axis)
    self.max_len = min(config.seq_len_limit, 4096) if max_len is None else int(max_len)
    if not 2 <= self.max_len < 2**31:
      raise ValueError(f"max_len={self.max_len} must be in [2, 2**31)")
    if config.has_flat and self.max_len - 1 > config.seq_len_limit:   # rings wrap: no bound
      raise ValueError(f"max_len={self.max_len} must be <= the cache's longest sequence + 1 = "
                       f"{config.seq_len_limit + 1} (max_seq_len, else capacity): a request "
                       "holds prompt + max_tokens - 1 positions")
    if max_steps < 1:
      raise ValueError(f"max_steps={max_steps} must be >= 1")
    if max_stop_tokens < 1:
      raise ValueError(f"max_stop_tokens={max_stop_tokens} must be >= 1")
    if max_logprobs is None:
      max_logprobs = min(MAX_LOGPROBS, self.vocab_size)
    if not 0 <= max_logprobs <= self.vocab_size:
      raise ValueError(f"max_logprobs={max_logprobs} must be in [0, vocab_size={self.vocab_size}]")
    self.max_logprobs = int(max_logprobs)
    self.widths = default_widths(config) if widths is None else tuple(widths)
    if (not self.widths or any(isinstance(w, bool) or not isinstance(w, int) for w in self.widths)
        or self.widths[0] != config.step_width or list(self.widths) != sorted(set(self.widths),
                                                                             reverse=True)
        or self.widths[-1] < 1):
      raise ValueError(f"widths={widths!r} must be distinct descending ints >= 1 starting at "
                       f"W={config.step_width}")
    self.max_steps, self.max_stop = int(max_steps), int(max_stop_tokens)
    check_engine_fits(config, self.max_len, self.max_stop, mesh=self.mesh, kv_axis=self.kv_axis)
    if device is not None and self.mesh is not None:
      raise ValueError("device= and mesh= exclude each other: a mesh places the engine already")
    self.device = device
    compiler_options = {} if compiler_options is None else compiler_options
    if not isinstance(compiler_options, Mapping) or not all(
        isinstance(k, str) for k in compiler_options):
      raise TypeError(f"compiler_options={compiler_options!r} must be a mapping of XLA option "
                      "names (str) to values")
    self.compiler_options = dict(compiler_options)
    jit = functools.partial(jax.jit, donate_argnums=1,
                            compiler_options=self.compiler_options or None)
    self.graphdef, self.params = _split_placed(model, self.mesh)
    if device is not None:
      self.params = jax.device_put(self.params, device)
    # The parameters travel as a flat list of arrays: flattening the model's nnx.State on
    # every loop entry is Python work per parameter, paid once per entry on the host.
    self._param_leaves, treedef = jax.tree.flatten(self.params)
    # Looked up here, not at import, so a test can wrap `serve_loop` (chex.assert_max_traces).
    # The static arguments are bound once: as jit static arguments, the model's GraphDef
    # would be hashed on every loop entry. `self._loop(leaves, ls, max_steps)`.
    loop_fn = serve_loop

    def entry(greedy):
      return jit(lambda leaves, ls, max_steps: loop_fn(
          self.graphdef, self.config, self.widths, jax.tree.unflatten(treedef, leaves), ls,
          max_steps, greedy=greedy))
    self._loop = entry(False)
    # A queue of plain greedy requests (the common offline case) runs a loop with no sampler
    # `lax.cond` (a host sync per step on a GPU); compiled on first use only.
    self._greedy_loop = entry(True)
    self._budgets: dict = {}   # max_steps -> its int32 scalar, made once (a dispatch each)
    self.state: LoopState | None = None
    self.implementations = layer_implementations(model, config)
    self.gemm = getattr(model, "gemm", None)   # the decode GEMM (CONTRACT §10.8), if it says
    self.stats = EngineStats(implementations=self.implementations)
    self.completions: list[Completion] = []   # of the last run, also when it failed
    self._live: LiveQueue | None = None

  def enter(self, ls: LoopState, max_steps: int, *, greedy: bool = False) -> LoopState:
    """One loop entry of at most `max_steps` steps over `ls` (donated); the new loop state."""
    budget = self._budgets.get(max_steps)
    if budget is None:
      budget = self._budgets[max_steps] = jnp.int32(max_steps)
    loop = self._greedy_loop if greedy else self._loop
    return loop(self._param_leaves, ls, budget)

  def lower(self, ls: LoopState, max_steps: int, *, greedy: bool = False):
    """The `jax.stages.Lowered` loop entry `enter` would run on `ls` (for HLO inspection)."""
    loop = self._greedy_loop if greedy else self._loop
    return loop.lower(self._param_leaves, ls, jnp.int32(max_steps))

  def check(self, request: Request) -> None:
    """Raises TypeError/ValueError, naming the request and field, unless this engine can serve it."""
    check_request(request, vocab_size=self.vocab_size, max_len=self.max_len,
                  max_seqs=self.config.max_seqs, capacity=self.config.capacity,
                  max_stop_tokens=self.max_stop, max_logprobs=self.max_logprobs)

  def run(self, requests: Sequence[Request], *,
          on_progress: Callable[[EngineStats, list[Completion]], None] | None = None,
          admission: str = "longest_first") -> list[Completion]:
    """Serves every request; returns completions ordered by (request order, sample index).

    Every request is checked before anything is served. The queue is packed on
    the device and served by the jitted loop, which admits, forks and retires
    on its own: the host is visited once per `max_steps` steps (and for flat
    growth, done once up front for the whole queue).

    `self.stats` reports the run (compile time apart from serving time,
    tokens/s of serving time), and every completion its latency figures
    (`Completion.timing`): the loop records, per sample, the step count at its
    admission, first token and last token, which are converted to seconds with
    the run's mean step time (`EngineStats.step_seconds`; see `RequestTiming`).

    Args:
      requests: the queue.
      on_progress: called after every loop entry with the running stats and the
        completions finished since the last call.
      admission: the order in which queued requests take free columns.
        `"longest_first"` (the default) admits the requests with the largest
        `max_tokens` first (ties in queue order, so a queue of equal budgets,
        e.g. one sharing a cached prefix, is served first come first served): the
        whole queue is known up front, and a long request admitted last would
        decode alone at the end (the makespan of a queue served on `max_seqs`
        columns is at least its longest request; longest-first scheduling
        keeps it near `max(longest, total tokens / columns)`).
        `"fcfs"` admits in queue order. Completions are returned in queue order
        either way, and the tokens of each request do not depend on the order
        (sampling is keyed by each request's seed).

    Raises:
      ValueError, TypeError: a request that is malformed or can never fit
        (nothing is served then).
      EngineError: the cache refused a step, or the model or `on_progress`
        raised; its `completions` (and `self.completions`) hold every sample
        finished before, the cause is chained, and the engine stays usable.
    """
    check_admission(admission)
    requests = labelled(requests)
    # A None seed is drawn here, on the host, and reported on the completions.
    requests = [r if r.params.seed is not None else r.replace(
        params=dataclasses.replace(r.params, seed=secrets.randbelow(2**31)))
                for r in requests]
    for r in requests:
      self.check(r)
    order = queue_order(requests)
    if self._live is not None and self._live.has_unfinished():
      raise RuntimeError("run: requests added with add_request are still in flight (one cache "
                         "at a time): step until has_unfinished() is False, or abort them")
    self._live = None   # its state goes with it, below
    self.completions: list[Completion] = []
    self.stats = EngineStats(implementations=self.implementations)
    if not requests:
      return []
    with contextlib.nullcontext() if self.device is None else jax.default_device(self.device):
      return self._run(admission_order(requests, admission), order, on_progress)

  def _run(self, requests, order, on_progress) -> list[Completion]:
    stats = self.stats
    config = self.config
    started, compiled = time.perf_counter(), compile_seconds()
    host_queue = pack_queue([r.prompt for r in requests], [r.params for r in requests],
                            max_len=self.max_len, max_stop=self.max_stop,
                            num_logprobs=self.max_logprobs)
    # Queue and output rows are padded to powers of two (the output's token axis is
    # `max_len`), so the loop compiles once per size class, not once per queue.
    # One cache at a time: the previous run's state goes before the new one is allocated.
    self.state = None
    ls = init_loop_state(config, host_queue, num_widths=len(self.widths), mesh=self.mesh,
                         kv_axis=self.kv_axis, prefix_cache=self.prefix_cache)
    ls = self._grow_for(ls, requests)
    self.state = ls
    owner, lp_rows = {}, {}
    for r in requests:
      base = len(owner)
      for j in range(r.params.n):
        owner[base + j] = (r, j)
        if r.params.logprobs is not None:   # pack_queue's order: logprob rows in queue order
          lp_rows[base + j] = len(lp_rows)
    greedy = all(plain_greedy(r.params) for r in requests)
    collected = np.zeros((host_queue.rows,), bool)
    collected[len(owner):] = True   # padding rows
    step_counts = []   # (completion, admitted, first token, finished) for its timing
    stats.setup_seconds = time.perf_counter() - started
    steps_before = 0   # a fresh loop state counts from 0
    try:
      while True:
        self.state = None   # donated below: never left pointing at a deleted buffer
        entered = time.perf_counter()
        ls = self.enter(ls, self.max_steps, greedy=greedy)
        self.state = ls
        stats.loop_entries += 1
        o = ls.out
        host = jax.device_get({k: getattr(ls, k) for k in (
            "steps", "step_tokens", "occupancy", "status", "peak_rows", "width_steps",
            *PAGED_COUNTERS)} | {
                "out_done": o.done, "out_len": o.length, "out_stop": o.stop,
                "out_admitted": o.admitted, "out_first": o.first, "out_finished": o.finished,
                "active": ls.cols.active, "used": ls.cols.used, "next": ls.queue.next})
        stats.loop_seconds += time.perf_counter() - entered
        new_rows = np.flatnonzero(host["out_done"].astype(bool) & ~collected)
        new_results = []
        if new_rows.size:
          out = np.asarray(jax.device_get(ls.out.tokens))
          lps = None
          for row in new_rows:
            request, index = owner[int(row)]
            n_tok = int(host["out_len"][row])
            logprobs = None
            if request.params.logprobs is not None:
              if lps is None:
                lps = jax.device_get((ls.out.logprob, ls.out.top_ids, ls.out.top_logprobs))
              logprobs = token_logprobs(lps, lp_rows[int(row)], out[row, :n_tok],
                                        range(n_tok), request.params.logprobs)
            new_results.append(Completion(request.request_id, index, request.prompt,
                                          out[row, :n_tok].tolist(),
                                          "stop" if host["out_stop"][row] else "length",
                                          request.params.seed, logprobs=logprobs))
            step_counts.append((new_results[-1], int(host["out_admitted"][row]),
                                int(host["out_first"][row]), int(host["out_finished"][row])))
          collected[new_rows] = True
          self.completions.extend(new_results)
        stats.steps, stats.step_tokens = int(host["steps"]), int(host["step_tokens"])
        stats.occupancy, stats.peak_rows = int(host["occupancy"]), int(host["peak_rows"])
        stats.width_steps = {w: int(c) for w, c in zip(self.widths, host["width_steps"])}
        read_paged_counters(stats, host)
        stats.generated = sum(len(c.tokens) for c in self.completions)
        stats.seconds = time.perf_counter() - started
        stats.compile_seconds = compile_seconds() - compiled
        if int(host["status"]) != Status.OK:
          raise EngineError(f"the cache refused a step: {Status(int(host['status'])).name}",
                            self.completions)
        if on_progress is not None:
          on_progress(stats, new_results)
        if collected.all():
          break
        # An entry that ended on its budget may have retired every column before admitting.
        spent = int(host["steps"]) - steps_before >= self.max_steps
        steps_before = int(host["steps"])
        if not spent and not host["active"].any() and not host["used"].any():
          raise EngineError(f"request {requests[int(host['next'])].request_id!r} cannot be "
                            "admitted into an empty engine", self.completions)
    except EngineError:
      raise
    except Exception as e:   # pylint: disable=broad-except  (model, device or callback failure)
      raise EngineError(f"Engine.run failed after {len(self.completions)} finished samples: "
                        f"{type(e).__name__}: {e}", self.completions) from e
    finally:
      stats.seconds = time.perf_counter() - started
      stats.compile_seconds = compile_seconds() - compiled
      for c, admitted, first, finished in step_counts:   # now that the mean step time is known
        c.timing = RequestTiming.from_steps(admitted, first, finished, len(c.tokens),
                                            stats.step_seconds)
    return sorted(self.completions, key=lambda c: (order[c.request_id], c.index))

  def _grow_for(self, ls: LoopState, requests) -> LoopState:
    """Grows flat rows once so that no request of the queue can hit NEEDS_ROWS in the loop."""
    config = self.config
    if not config.has_flat or config.page_size is not None:   # a paged pool never grows
      return ls
    current = next(ls.cache.k[l].shape[0] for l, layer in enumerate(config.layers)
                   if not layer.policy.is_ring)
    needed = max(len(r.prompt) + r.params.max_tokens - 1 for r in requests)
    if needed <= current:
      return ls
    # `pure.grow` runs on the host (it builds each grown layer in place on its devices).
    return _grow(config, ls, _grown_rows(config, current, needed))
