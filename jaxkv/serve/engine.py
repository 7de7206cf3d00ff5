"""`Engine`: continuous batching over one engine core, offline (`run`) or incremental.

`Engine` checks its arguments and composes the pieces: the `EngineCore`
(`core.py`, the loop state and the programs over it), `Engine.run`'s client of
it (`offline.py`) and the incremental API's (`LiveQueue`, `live.py`), to which
`add_request`, `step`, `abort`, ... delegate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from typing import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from jaxkv import CacheConfig
from jaxkv.serve.admission import (ADMISSION_ORDERS, admission_order, check_admission, labelled,
                                   queue_order)
from jaxkv.serve.core import EngineCore
from jaxkv.serve.live import LiveQueue
from jaxkv.serve.memory import check_engine_fits
from jaxkv.serve.offline import serve_queue
from jaxkv.serve.step_model import check_step_model
from jaxkv.serve.report import layer_implementations
from jaxkv.serve.requests import MAX_LOGPROBS, Request, SamplingParams, check_request
from jaxkv.serve.results import Completion, Delta, EngineStats
from jaxkv.serve.speculative import check_speculative
from jaxkv.serve.state import LoopState
from jaxkv.structured.pool import default_capacity as default_grammar_pool, pack as pack_pool
from jaxkv.structured.pool import capacity_of, pool_bytes


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


MIN_MIDDLE_WIDTH = 128
# Prefill widths halve down to this many rows (where dense layers are compute-bound on
# a Hopper GPU for a 1B-8B model), then shrink by 4.
HALVING_WIDTH = 512


def default_widths(config: CacheConfig, per_column: int = 1) -> tuple[int, ...]:
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
  compilation and save nothing. `per_column` decode slots per column (speculative
  decoding: a pending token and `k` draft tokens) add that `narrow` to plain
  decoding's widths: a step where few columns draft (or none) runs at the rows it
  needs, not at the width of every column's draft.
  """
  if per_column > 1:
    return tuple(sorted(set(_widths(config, 1)) | set(_widths(config, per_column)),
                        reverse=True))
  return _widths(config, 1)


def _widths(config: CacheConfig, per_column: int) -> tuple[int, ...]:
  """`default_widths`' ladder down to `per_column` slots per column."""
  width = config.step_width
  narrow = min(-(-config.max_seqs * per_column // 8) * 8, width)
  if narrow >= width:
    return (width,)
  widths = [width]
  shrink = lambda w: (w // 2 if w // 2 >= HALVING_WIDTH else w // 4) // 8 * 8
  middle = shrink(width)
  while middle >= max(MIN_MIDDLE_WIDTH, 2 * narrow):
    widths.append(middle)
    middle = shrink(middle)
  return tuple(widths) + (narrow,)


class Engine:
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
    grammar_pool: `(states, masks, transitions[, automata])` the structured-output automata of
      the requests on the device may hold together (`SamplingParams.grammar`;
      `jaxkv.structured`); part of the loop state's shape, counted in its memory.
      Default `structured.pool.default_capacity(vocab_size)`.
    speculative: a `jaxkv.serve.SpeculativeConfig`: the loop (`run` and the
      incremental API alike) drafts up to `k` tokens per plain greedy sequence and
      verifies them in one step, the tokens those of plain decoding; requests that
      sample, penalise, bias, want logprobs, follow a grammar or opt out with
      `SamplingParams(speculative=False)` decode one token a step beside them.
      `k` is checked against the cache here (`speculative.max_speculative_tokens`).

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
               scheduling: str = "fcfs", grammar_pool=None, speculative=None):
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
    self.speculative = check_speculative(speculative, config)
    spec_k = 0 if self.speculative is None else self.speculative.k
    self.widths = default_widths(config, 1 + spec_k) if widths is None else tuple(widths)
    if (not self.widths or any(isinstance(w, bool) or not isinstance(w, int) for w in self.widths)
        or self.widths[0] != config.step_width or list(self.widths) != sorted(set(self.widths),
                                                                             reverse=True)
        or self.widths[-1] < 1):
      raise ValueError(f"widths={widths!r} must be distinct descending ints >= 1 starting at "
                       f"W={config.step_width}")
    self.max_steps, self.max_stop = int(max_steps), int(max_stop_tokens)
    if grammar_pool is None:
      grammar_pool = default_grammar_pool(self.vocab_size)
    if (not isinstance(grammar_pool, (tuple, list)) or len(grammar_pool) not in (3, 4)
        or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
               for v in grammar_pool)):
      raise ValueError(f"grammar_pool={grammar_pool!r} must be (states, masks, transitions[, "
                       "automata]), ints >= 1")
    self.grammar_pool = capacity_of(grammar_pool)
    check_engine_fits(config, self.max_len, self.max_stop, mesh=self.mesh, kv_axis=self.kv_axis,
                      grammar_bytes=pool_bytes(self.vocab_size, self.grammar_pool))
    if device is not None and self.mesh is not None:
      raise ValueError("device= and mesh= exclude each other: a mesh places the engine already")
    self.device = device
    compiler_options = {} if compiler_options is None else compiler_options
    if not isinstance(compiler_options, Mapping) or not all(
        isinstance(k, str) for k in compiler_options):
      raise TypeError(f"compiler_options={compiler_options!r} must be a mapping of XLA option "
                      "names (str) to values")
    self.compiler_options = dict(compiler_options)
    self.core = EngineCore(model, config, self.widths, mesh=self.mesh, kv_axis=self.kv_axis,
                           device=device, prefix_cache=prefix_cache,
                           compiler_options=self.compiler_options,
                           speculative=self.speculative)
    self.implementations = layer_implementations(model, config)
    self.gemm = getattr(model, "gemm", None)   # the decode GEMM (CONTRACT §10.8), if it says
    self.stats = EngineStats(implementations=self.implementations)
    self.completions: list[Completion] = []   # of the last run, also when it failed
    self._live: LiveQueue | None = None
    self._empty_grammars = None   # Engine.run's grammar pool when no request has a grammar
    # The `AsyncEngine` whose threads drive it: one at a time, two would race for its entries.
    self.driver = None

  @property
  def capacity(self) -> int:
    """Cache positions of this engine (`CacheConfig.capacity`)."""
    return self.config.capacity

  @property
  def state(self) -> LoopState | None:
    """The loop state (`EngineCore.state`): of the last `run`, or the incremental API's."""
    return self.core.state

  def lower(self, ls: LoopState, max_steps: int, *, greedy: bool = False):
    """The `jax.stages.Lowered` loop entry the engine would run on `ls` (for HLO inspection)."""
    return self.core.lower(ls, max_steps, greedy=greedy)

  def check(self, request: Request) -> None:
    """Raises TypeError/ValueError, naming the request and field, unless this engine can serve it."""
    check_request(request, vocab_size=self.vocab_size, max_len=self.max_len,
                  max_seqs=self.config.max_seqs, capacity=self.config.capacity,
                  max_stop_tokens=self.max_stop, max_logprobs=self.max_logprobs,
                  grammar_room=self.grammar_pool)

  def _grammars(self, requests):
    """`(pool, {automaton.identity: initial state})` of the distinct automata of `requests`."""
    distinct = list({r.params.grammar.identity: r.params.grammar for r in requests
                     if r.params.grammar is not None}.values())
    if not distinct:   # the common case: one empty pool per engine, never written
      if self._empty_grammars is None:
        self._empty_grammars = self.pack_grammars([])[0]
      return self._empty_grammars, {}
    pool, initials = self.pack_grammars(distinct)
    return pool, {a.identity: s for a, s in zip(distinct, initials)}

  def pack_grammars(self, automata):
    """`(pool, initial states)`: `automata` in one pool of this engine's capacity (NumPy).

    Raises:
      ValueError: together they do not fit the pool (`grammar_pool=`).
    """
    need = (sum(a.num_states for a in automata), sum(a.masks.shape[0] for a in automata),
            sum(a.tokens.shape[0] for a in automata), len(automata))
    for what, n, room in zip(("states", "masks", "transitions", "automata"), need,
                             self.grammar_pool):
      if n > room:
        raise ValueError(f"the requests' grammars hold {n} {what}; the engine's grammar pool "
                         f"holds {room} (Engine(grammar_pool=...))")
    states, masks, transitions, rows = self.grammar_pool
    return pack_pool(automata, self.vocab_size, states=states, masks=masks,
                     transitions=transitions, rows=rows)

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
    grammars = self._grammars(requests)   # refused here (changing nothing) if they do not fit
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
      done = serve_queue(self, admission_order(requests, admission), on_progress, grammars)
    return sorted(done, key=lambda c: (order[c.request_id], c.index))

  # ------------------------------------------------------------------ incremental API
  # Each verb hands the work to the `LiveQueue` (made on first use; `live.py`).

  def _live_queue(self) -> LiveQueue:
    if self._live is None:
      self.core.drop()   # run's state goes before the persistent one is allocated
      self.stats = EngineStats(implementations=self.implementations)
      self._live = LiveQueue(self)
    return self._live

  @property
  def live(self) -> LiveQueue:
    """The incremental API's `LiveQueue` (made on first use): its `dispatch` and `collect`
    halves let a front run loop entries on one thread and read them back on another."""
    return self._live_queue()

  def add_request(self, request: Request):
    """Queues one request for `step`/`stream`; returns its id.

    The request is checked now (as by `run`); a refused request changes
    nothing. It may be called from any thread, also while a step runs; the
    request enters the loop at the next step. Its stop tokens may exceed
    `max_stop_tokens`: the rest are checked on the host after each step. A
    `seed` of None is drawn here and reported on every `Delta`.

    Args:
      request: the `Request`; its `request_id` (default: the lowest unused
        int) must not be in flight.

    Returns:
      The request id.

    Raises:
      ValueError, TypeError: a malformed request, one that can never fit, or
        an id already in flight.
    """
    return self._live_queue().add_request(request)

  def abort(self, request_id, index: int | None = None) -> bool:
    """Ends a request (or one running sample) at the next step, finish reason `"abort"`.

    Its columns are removed and their reserved room freed before the next
    loop entry, so waiting requests can take them.

    Args:
      request_id: the request.
      index: one sample of it (only once that sample has produced tokens);
        None: every unfinished sample.

    Returns:
      False (changing nothing) if the request or sample is not in flight.
    """
    return self._live is not None and self._live.abort(request_id, index)

  def abort_many(self, request_ids) -> int:
    """`abort` of every request in `request_ids` in one call (one lock, O(1) each): a client
    that sent many prompts and left. Returns how many of them were in flight."""
    return 0 if self._live is None else self._live.abort_many(request_ids)

  def has_unfinished(self) -> bool:
    """Whether a request added with `add_request` has not finished yet."""
    return self._live is not None and self._live.has_unfinished()

  def counts(self) -> tuple[int, int]:
    """`(running, waiting)` requests of the incremental API: admitted into the loop, and not yet."""
    return (0, 0) if self._live is None else self._live.counts()

  @property
  def waiting_tokens(self) -> int:
    """Prompt tokens of the incremental API's requests not yet admitted into the loop."""
    return 0 if self._live is None else self._live.waiting_tokens

  @property
  def held(self) -> int:
    """Cache positions held by the incremental API's sequences after its last step."""
    return 0 if self._live is None else self._live.held

  def step(self, max_steps: int | None = None, *, overlap: bool = False) -> list[Delta]:
    """One loop entry of at most `max_steps` steps over the persistent cache.

    Applies pending aborts, moves waiting requests into the device queue,
    runs the jitted loop (admission, forks, steps, retirement inside) and
    reports every sample's new tokens. One entry runs at a time.

    Args:
      max_steps: the streaming interval `k` (default: the engine's `max_steps`).
      overlap: dispatch the next entry before building this one's deltas, so
        the device never waits for the host's formatting: the call returns the
        deltas of the entry the previous call dispatched and leaves one entry in
        flight while work remains; aborts and host-side stop cuts then take
        effect one entry later. Off while a request that wants logprobs is in
        flight. `AsyncEngine` (and so the server) steps this way.

    Returns:
      `Delta`s of the samples that produced tokens or finished, in arrival
      order; the last delta of a request carries its `RequestTiming`.

    Raises:
      EngineError: the model, device or cache failed; the requests the
        device held are dropped (`error.failed`), requests still waiting on
        the host are kept, and the next step starts on a fresh cache;
        `error.deltas` holds the deltas read before the failure.
      RuntimeError: another step is running.
    """
    return self._live_queue().step(max_steps, overlap=overlap)

  def warm_up(self, steps=(1,), *, stepwise: bool = False) -> float:
    """Compiles what the incremental API runs, before any request; returns the compile seconds.

    For each entry length in `steps` (the `max_steps` the caller will step
    with), a greedy and a sampled one-token request run one entry (the loop
    without and with the sampler, which `step` picks by what is in flight, and
    the entry's snapshot compile) and are aborted (the abort helper compiles);
    nothing of them stays in the engine. With `stepwise` (the caller dispatches
    with `stepwise=True`, reading back at most `max(steps)` steps at once), the
    entries are steps (no loop is compiled), and every width's step programs (greedy
    and sampled) and every snapshot up to that many steps then run once on the idle
    engine.

    Raises:
      RuntimeError: requests added with `add_request` are in flight.
    """
    if self.has_unfinished():
      raise RuntimeError("warm_up: requests are in flight; call it before serving")
    before = self.stats.compile_seconds
    live = self._live_queue()
    for temperature in (0.0, 1.0):
      for k in steps:
        rid = self.add_request(Request((0,), SamplingParams(max_tokens=2, temperature=temperature),
                                       request_id="warm-up"))
        live.step(k, stepwise=stepwise)
        self.abort(rid)
        while self.has_unfinished() or stepwise and live.has_work():
          live.step(k, stepwise=stepwise)
    if stepwise:
      live.warm_steps(max(steps))
    return self.stats.compile_seconds - before

  def stream(self, max_steps: int | None = None) -> Iterator[Delta]:
    """Steps until every added request has finished, yielding the deltas as they come."""
    live = self._live_queue()
    while live.has_unfinished():
      yield from live.step(max_steps)
