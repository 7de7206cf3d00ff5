"""Serving on jaxkv: a continuous-batching engine whose decode loop is one `jax.jit`.

`Engine` serves a queue of `Request`s with any model that follows the step
protocol of `examples.models.Decoder`: `model(tokens, state, rows=rows)` takes
`int32[W]` step tokens and a `CacheState` whose step is prepared, and returns
`(logits float32[R, vocab], new_state)` for the step tokens in `rows`; the model
exposes its `cache_config`.

How a batch runs:

- **Admission** (host, between loop entries): a request gets a column with
  `jaxkv.pure.seq_new` when one is free and the shared capacity can hold its
  prompt plus its token limit (reserved up front, so no step is ever refused
  for room inside the loop). Flat rows are grown with `jaxkv.pure.grow` on the
  host before the loop when the admitted requests could need more.
- **The loop** (`decode_loop`, one `jax.jit`, the loop state donated): a
  `lax.while_loop` whose body packs every active sequence's pending tokens onto
  the static `W`-wide step axis (decode tokens first, then chunked prefill),
  runs declare → prepare → model → commit through `jaxkv.pure`, samples one
  token for every sequence whose last pending token was in the step (greedy,
  temperature, top-k, top-p, per-request seeds), and retires finished
  sequences with `jaxkv.pure.seq_rm`. It returns to the host only when a
  request finished, a parallel-sampling prompt is ready to fork, or
  `max_steps` steps ran.
- **Parallel sampling** (`n > 1`): the prompt but its last token is prefilled
  once, then `jaxkv.pure.seq_clone` forks it `n - 1` times; every sample then
  feeds the last prompt token itself and samples with its own key.

`ModelRunner` is the host-level companion for step-by-step work (speculative
decoding, DFlash blocks, tests): jitted declare/prepare/model/commit steps and
the sequence verbs, one call each.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import CacheConfig, CacheState, Status, init_state, pure

__all__ = ["Completion", "Engine", "EngineStats", "LoopState", "ModelRunner", "Request",
           "SamplingParams", "bytes_in_use", "decode_loop", "init_loop_state", "sample",
           "storage_bytes"]

_NEG = float(np.finfo(np.float32).min)
# Flat growth rounds rows up to this multiple (capped at capacity): the Mosaic GPU
# kernels need a row count that is a multiple of 8 and at least their key block
# (128), and refuse (falling back to the reference) otherwise.
ROW_MULTIPLE = 128


def _grown_rows(config: CacheConfig, current: int, needed: int) -> int:
  rows = max(needed, 2 * current)
  return min(config.capacity, -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE)


# ----------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is sampled.

  Attributes:
    max_tokens: most new tokens (`>= 1`).
    temperature: 0 is greedy; otherwise logits are divided by it.
    top_k: keep the `top_k` most likely tokens (0: all).
    top_p: keep the smallest set whose probability reaches `top_p` (1: all).
    seed: the request's seed; sample `i`'s token `t` uses
      `fold_in(fold_in(key(seed), i), t)`, independent of batching.
    stop_tokens: tokens that end the request (the stop token is kept).
    n: parallel samples of the prompt (forked with `seq_clone`).
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: tuple[int, ...] = ()
  n: int = 1

  def __post_init__(self):
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if self.n < 1:
      raise ValueError(f"n={self.n} must be >= 1")
    if not 0 <= self.seed < 2**31:
      raise ValueError(f"seed={self.seed} must be in [0, 2**31)")
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt and its sampling parameters.

  Attributes:
    prompt: token ids (at least one).
    params: `SamplingParams`.
    request_id: any hashable label (default: its index in the `run` call).
  """

  prompt: tuple[int, ...]
  params: SamplingParams = SamplingParams()
  request_id: object = None

  def __post_init__(self):
    prompt = tuple(int(t) for t in self.prompt)
    if not prompt:
      raise ValueError("prompt must hold at least one token")
    object.__setattr__(self, "prompt", prompt)


@dataclasses.dataclass
class Completion:
  """One finished sample.

  Attributes:
    request_id: the request's label.
    index: sample index (0..n-1).
    prompt: the prompt tokens.
    tokens: generated tokens.
    finish_reason: `"stop"` (a stop token) or `"length"` (token limit).
  """

  request_id: object
  index: int
  prompt: tuple[int, ...]
  tokens: list[int]
  finish_reason: str


@dataclasses.dataclass
class EngineStats:
  """Counters of one `Engine.run`.

  Attributes:
    steps: cache steps run.
    step_tokens: real tokens carried by those steps (prefill + decode).
    generated: tokens sampled.
    occupancy: sum over steps of sequences in the step (mean = occupancy/steps).
    loop_entries: entries into the jitted loop (host round trips).
    seconds: wall time.
    peak_rows: most cache rows (positions) held at once.
  """

  steps: int = 0
  step_tokens: int = 0
  generated: int = 0
  occupancy: int = 0
  loop_entries: int = 0
  seconds: float = 0.0
  peak_rows: int = 0


# ----------------------------------------------------------------------------- sampling


def _sample_row(logits, temperature, top_k, top_p, key):
  """One token from `float32[V]` logits; greedy when `temperature == 0`."""
  vocab = logits.shape[-1]
  greedy = jnp.argmax(logits).astype(jnp.int32)
  scaled = logits / jnp.maximum(temperature, jnp.float32(1e-6))
  ordered = jnp.sort(scaled)[::-1]   # descending
  ranks = jnp.arange(vocab, dtype=jnp.int32)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_k = ranks < k
  probs = jax.nn.softmax(jnp.where(in_k, ordered, _NEG))
  # A token is kept while the mass of the tokens before it is below top_p (the first always is).
  keep = in_k & ((jnp.cumsum(probs) - probs) < top_p)
  threshold = ordered[jnp.maximum(keep.sum(dtype=jnp.int32) - 1, 0)]
  masked = jnp.where(scaled >= threshold, scaled, _NEG)
  drawn = jax.random.categorical(key, masked).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def sample(logits, temperature, top_k, top_p, keys):
  """Samples one token per row.

  Args:
    logits: `float32[S, V]`.
    temperature: `float32[S]` (0: greedy).
    top_k: `int32[S]` (0: all).
    top_p: `float32[S]`.
    keys: `[S]` typed PRNG keys.

  Returns:
    `int32[S]`. The sort is skipped entirely when every row is greedy.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(
      jnp.any(temperature > 0),
      lambda: jax.vmap(_sample_row)(logits, temperature, top_k, top_p, keys),
      lambda: greedy)


# ----------------------------------------------------------------------------- loop state


def _register(cls):
  names = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_register
@dataclasses.dataclass(frozen=True)
class LoopState:
  """Everything the jitted loop carries (`S = max_seqs` columns, `L = max_len`).

  Attributes:
    cache: the `CacheState`.
    tokens: `int32[S, L]` each column's prompt then generated tokens.
    prompt_len: `int32[S]`.
    length: `int32[S]` known tokens (prompt + generated).
    fed: `int32[S]` tokens written to the cache (= the sequence's pos).
    hold: `int32[S]` most tokens to feed before a fork (`L` when none is pending).
    limit: `int32[S]` length at which the column finishes (prompt + max_tokens).
    active: `int32[S]` 1 while the column is generating.
    done: `int32[S]` 1 once finished, until the host collects it.
    stopped: `int32[S]` 1 when a stop token ended the column.
    temperature, top_p: `float32[S]`; top_k, seed, sample_index: `int32[S]`.
    stop_tokens: `int32[S, NS]` (-1 = unused).
    steps, step_tokens, occupancy, status: `int32[]` counters and the first
      non-OK cache status (the loop exits on it).
  """

  cache: CacheState
  tokens: jax.Array
  prompt_len: jax.Array
  length: jax.Array
  fed: jax.Array
  hold: jax.Array
  limit: jax.Array
  active: jax.Array
  done: jax.Array
  stopped: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  sample_index: jax.Array
  stop_tokens: jax.Array
  steps: jax.Array
  step_tokens: jax.Array
  occupancy: jax.Array
  status: jax.Array


def init_loop_state(config: CacheConfig, max_len: int, max_stop: int, *, mesh=None,
                    kv_axis: str = "tp") -> LoopState:
  """A loop state with an empty cache and no column in use.

  With `mesh`, the cache's K/V are split over their heads along `kv_axis` and
  everything else is replicated on the mesh.
  """
  s = config.max_seqs
  zeros = lambda dtype=jnp.int32: jnp.zeros((s,), dtype)
  scalar = lambda: jnp.zeros((), jnp.int32)
  ls = LoopState(
      cache=init_state(config), tokens=jnp.zeros((s, max_len), jnp.int32),
      prompt_len=zeros(), length=zeros(), fed=zeros(), hold=jnp.full((s,), max_len, jnp.int32),
      limit=zeros(), active=zeros(), done=zeros(), stopped=zeros(),
      temperature=zeros(jnp.float32), top_k=zeros(), top_p=jnp.ones((s,), jnp.float32),
      seed=zeros(), sample_index=zeros(), stop_tokens=jnp.full((s, max_stop), -1, jnp.int32),
      steps=scalar(), step_tokens=scalar(), occupancy=scalar(), status=scalar())
  if mesh is None:
    return ls
  rest = jax.device_put(dataclasses.replace(ls, cache=None), NamedSharding(mesh, P()))
  return dataclasses.replace(rest, cache=init_state(config, mesh=mesh, kv_axis=kv_axis))


def _schedule(config: CacheConfig, ls: LoopState):
  """Tokens per column this step: one per active column first, then prefill chunks.

  Returns:
    `(alloc int32[S], start int32[S])`: tokens each column carries and where
    its run starts on the step axis (columns in order, one run each).
  """
  width = config.step_width
  want = jnp.where(ls.active == 1, jnp.maximum(jnp.minimum(ls.length, ls.hold) - ls.fed, 0), 0)
  one = jnp.minimum(want, 1)
  first = jnp.where(jnp.cumsum(one) <= width, one, 0)
  rest = want - first
  budget = width - first.sum()
  more = jnp.clip(budget - (jnp.cumsum(rest) - rest), 0, rest)
  alloc = (first + more).astype(jnp.int32)
  start = (jnp.cumsum(alloc) - alloc).astype(jnp.int32)
  return alloc, start


def _step_tokens(config: CacheConfig, ls: LoopState, alloc, start):
  """`(seq_ids int32[W], tokens int32[W], n)` of the scheduled step."""
  width, s = config.step_width, config.max_seqs
  n = alloc.sum(dtype=jnp.int32)
  idx = jnp.arange(width, dtype=jnp.int32)
  col = jnp.searchsorted(start + alloc, idx, side="right").astype(jnp.int32)
  is_real = idx < n
  col = jnp.where(is_real, col, s)
  safe = jnp.clip(col, 0, s - 1)
  offset = jnp.clip(ls.fed[safe] + idx - start[safe], 0, ls.tokens.shape[1] - 1)
  tokens = jnp.where(is_real, ls.tokens[safe, offset], 0)
  return col, tokens, n


def _first_bad(*statuses):
  out = jnp.int32(Status.OK)
  for st in reversed(statuses):
    out = jnp.where(st != Status.OK, st, out)
  return out


def _loop_body(config: CacheConfig, model, ls: LoopState) -> LoopState:
  """One step: schedule, declare, prepare, model, commit, sample, retire."""
  s, width = config.max_seqs, config.step_width
  alloc, start = _schedule(config, ls)
  seq_ids, tokens, n = _step_tokens(config, ls, alloc, start)
  blocks = jnp.zeros((width, 2), jnp.int32)
  cache, st_declare = pure.declare_step(config, ls.cache, seq_ids, n, blocks)
  cache, st_prepare = pure.prepare_step(config, cache)
  rows = jnp.clip(start + alloc - 1, 0, width - 1)
  logits, cache = model(tokens, cache, rows=rows)
  cache, st_commit = pure.commit_step(config, cache)
  status = _first_bad(st_declare, st_prepare, st_commit)
  ok = status == Status.OK

  emits = ok & (alloc > 0) & (ls.fed + alloc == ls.length)
  generated = ls.length - ls.prompt_len
  cols = jnp.arange(s, dtype=jnp.int32)
  keys = jax.vmap(lambda seed, i, t: jax.random.fold_in(
      jax.random.fold_in(jax.random.key(seed), i), t))(ls.seed, ls.sample_index, generated)
  new = sample(logits, ls.temperature, ls.top_k, ls.top_p, keys)
  max_len = ls.tokens.shape[1]
  write_at = jnp.where(emits, jnp.minimum(ls.length, max_len - 1), max_len)
  tokens_buf = ls.tokens.at[cols, write_at].set(new, mode="drop")
  length = ls.length + emits.astype(jnp.int32)
  is_stop = jnp.any(ls.stop_tokens == new[:, None], axis=1)
  finished = emits & (is_stop | (length >= ls.limit))
  fed = jnp.where(ok, ls.fed + alloc, ls.fed)

  def retire(i, c):
    return pure.seq_rm(config, c, jnp.where(finished[i], i, -1))[0]

  # Most steps finish nothing: skip the per-column removals then.
  cache = jax.lax.cond(jnp.any(finished), lambda c: jax.lax.fori_loop(0, s, retire, c),
                       lambda c: c, cache)
  as_int = lambda b: b.astype(jnp.int32)
  return dataclasses.replace(
      ls, cache=cache, tokens=tokens_buf, length=length, fed=fed,
      active=jnp.where(finished, 0, ls.active), done=ls.done | as_int(finished),
      stopped=ls.stopped | as_int(finished & is_stop),
      steps=ls.steps + as_int(ok), step_tokens=ls.step_tokens + jnp.where(ok, n, 0),
      occupancy=ls.occupancy + jnp.where(ok, (alloc > 0).sum(dtype=jnp.int32), 0),
      status=jnp.where(ls.status == Status.OK, status, ls.status))


def _fork_ready(ls: LoopState):
  return jnp.any((ls.active == 1) & (ls.hold < ls.tokens.shape[1]) & (ls.fed >= ls.hold))


def decode_loop(graphdef, config: CacheConfig, params, ls: LoopState, max_steps):
  """The multi-step loop: runs steps until a request finishes or a fork is ready.

  Jit it with `graphdef` and `config` static and `ls` donated
  (`jax.jit(decode_loop, static_argnums=(0, 1), donate_argnums=3)`); `Engine`
  does. It stops after a step in which a sequence finished, when a
  parallel-sampling prompt waits for its forks, when no column is active, after
  `max_steps` steps, or on a non-OK cache status (kept in `ls.status`).

  Args:
    graphdef: the model's `nnx.GraphDef` (static).
    config: the model's `CacheConfig` (static).
    params: the model's `nnx.State`.
    ls: `LoopState`; donated.
    max_steps: `int32[]` step budget of this entry.

  Returns:
    The new `LoopState`.
  """
  from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
  model = merge_model(graphdef, params)
  first_step = ls.steps
  done_before = ls.done.sum()

  def cond(ls):
    return ((ls.status == Status.OK) & jnp.any(ls.active == 1) & (ls.steps - first_step < max_steps)
            & (ls.done.sum() == done_before) & ~_fork_ready(ls))

  return jax.lax.while_loop(cond, lambda ls: _loop_body(config, model, ls), ls)


def _admit(config: CacheConfig, ls: LoopState, prompt, prompt_len, limit, hold, temperature,
           top_k, top_p, seed, sample_index, stop_tokens):
  """Makes a new sequence and fills its column; `(ls, status, id)`."""
  cache, status, seq_id = pure.seq_new(config, ls.cache)
  ok = status == Status.OK
  col = jnp.where(ok, seq_id, config.max_seqs)   # out of range: dropped
  put = lambda a, v: a.at[col].set(v, mode="drop")
  ls = dataclasses.replace(
      ls, cache=cache, tokens=put(ls.tokens, prompt), prompt_len=put(ls.prompt_len, prompt_len),
      length=put(ls.length, prompt_len), fed=put(ls.fed, 0), hold=put(ls.hold, hold),
      limit=put(ls.limit, limit), active=put(ls.active, 1), done=put(ls.done, 0),
      stopped=put(ls.stopped, 0), temperature=put(ls.temperature, temperature),
      top_k=put(ls.top_k, top_k), top_p=put(ls.top_p, top_p), seed=put(ls.seed, seed),
      sample_index=put(ls.sample_index, sample_index),
      stop_tokens=put(ls.stop_tokens, stop_tokens))
  return ls, status, seq_id


def _fork(config: CacheConfig, ls: LoopState, src, sample_index):
  """Clones column `src` (whole prefix) into a new column with its own sample index."""
  cache, status, seq_id = pure.seq_clone(config, ls.cache, src, pure.WHOLE)
  ok = status == Status.OK
  col = jnp.where(ok, seq_id, config.max_seqs)
  copy = lambda a: a.at[col].set(a[src], mode="drop")
  fields = ("tokens", "prompt_len", "length", "fed", "limit", "active", "done", "stopped",
            "temperature", "top_k", "top_p", "seed", "stop_tokens")
  ls = dataclasses.replace(ls, cache=cache, **{f: copy(getattr(ls, f)) for f in fields})
  ls = dataclasses.replace(
      ls, sample_index=ls.sample_index.at[col].set(sample_index, mode="drop"),
      hold=ls.hold.at[col].set(ls.tokens.shape[1], mode="drop"))
  return ls, status, seq_id


def _release(config: CacheConfig, ls: LoopState, src):
  """Lets column `src` feed past its fork point."""
  return dataclasses.replace(ls, hold=ls.hold.at[src].set(ls.tokens.shape[1]))


def _grow(config: CacheConfig, ls: LoopState, rows: int) -> LoopState:
  return dataclasses.replace(ls, cache=pure.grow(config, ls.cache, rows))


# ----------------------------------------------------------------------------- engine


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


_jit_admit = jax.jit(_admit, static_argnums=0, donate_argnums=1)
_jit_fork = jax.jit(_fork, static_argnums=0, donate_argnums=1)
_jit_release = jax.jit(_release, static_argnums=0, donate_argnums=1)


class Engine:
  """Continuous batching over a request queue, the decode loop in one `jax.jit`.

  Args:
    model: an NNX model following the step protocol (see the module docstring),
      with a `cache_config` attribute.
    max_len: longest prompt + max_tokens of any request (the per-column token
      buffer); default `min(capacity, 4096)`.
    max_steps: most steps per loop entry (bounds the time between host visits).
    max_stop_tokens: most stop tokens per request.
    mesh: optional `jax.sharding.Mesh` for tensor parallelism; default the
      model's `mesh` attribute (`examples.models.Decoder(..., mesh=)`). The
      cache's K/V are split over `kv_axis`, the parameters are placed by their
      sharding metadata (`jaxkv.nnx.shard_state`), the rest is replicated, and
      the same jitted loop runs on the mesh.
    kv_axis: the mesh axis splitting KV heads; default the model's `kv_axis`
      attribute, else `"tp"`.
  """

  def __init__(self, model, *, max_len: int | None = None, max_steps: int = 4096,
               max_stop_tokens: int = 8, mesh=None, kv_axis: str | None = None):
    config = getattr(model, "cache_config", None)
    if not isinstance(config, CacheConfig):
      raise ValueError(f"model={type(model).__name__} must have a CacheConfig `cache_config`")
    self.config = config
    self.mesh, self.kv_axis = _model_mesh(model, config, mesh, kv_axis)
    self.max_len = min(config.capacity, 4096) if max_len is None else int(max_len)
    if self.max_len < 2:
      raise ValueError(f"max_len={self.max_len} must be >= 2")
    if max_steps < 1:
      raise ValueError(f"max_steps={max_steps} must be >= 1")
    if max_stop_tokens < 1:
      raise ValueError(f"max_stop_tokens={max_stop_tokens} must be >= 1")
    self.max_steps, self.max_stop = int(max_steps), int(max_stop_tokens)
    self.graphdef, self.params = _split_placed(model, self.mesh)
    # Looked up here, not at import, so a test can wrap `decode_loop` (chex.assert_max_traces).
    self._loop = jax.jit(decode_loop, static_argnums=(0, 1), donate_argnums=3)
    self._admit, self._fork, self._release = _jit_admit, _jit_fork, _jit_release
    self.state: LoopState | None = None
    self.stats = EngineStats()

  def _check(self, request: Request) -> None:
    p = request.params
    total = len(request.prompt) + p.max_tokens
    if total > self.max_len:
      raise ValueError(f"request {request.request_id!r}: prompt ({len(request.prompt)}) + "
                       f"max_tokens ({p.max_tokens}) must be <= max_len={self.max_len}")
    if p.n > self.config.max_seqs:
      raise ValueError(f"request {request.request_id!r}: n={p.n} must be <= "
                       f"max_seqs={self.config.max_seqs}")
    if p.n * (total - 1) > self.config.capacity:
      raise ValueError(f"request {request.request_id!r} needs {p.n * (total - 1)} cache rows; "
                       f"capacity={self.config.capacity}")
    if len(p.stop_tokens) > self.max_stop:
      raise ValueError(f"request {request.request_id!r}: {len(p.stop_tokens)} stop_tokens; "
                       f"at most max_stop_tokens={self.max_stop}")

  def run(self, requests: Sequence[Request], *,
          on_progress: Callable[[EngineStats, list[Completion]], None] | None = None
          ) -> list[Completion]:
    """Serves every request; returns completions ordered by (request order, sample index).

    Args:
      requests: the queue, admitted first come first served.
      on_progress: called after every loop entry with the running stats and the
        completions finished since the last call.

    Raises:
      ValueError: a request that can never fit (see `Engine`'s arguments).
      RuntimeError: the cache refused a step (a bug: admission reserves room).
    """
    requests = [r if r.request_id is not None else dataclasses.replace(r, request_id=i)
                for i, r in enumerate(requests)]
    for r in requests:
      self._check(r)
    order = {r.request_id: i for i, r in enumerate(requests)}
    if len(order) != len(requests):
      raise ValueError("request_id values must be unique")
    config = self.config
    self.stats = stats = EngineStats()
    started = time.perf_counter()
    self.state = ls = init_loop_state(config, self.max_len, self.max_stop, mesh=self.mesh,
                                      kv_axis=self.kv_axis)
    queue = list(requests)
    columns: dict[int, tuple[Request, int]] = {}   # column -> (request, sample index)
    reserved: dict[int, int] = {}                   # column -> cache rows reserved
    pending_forks: dict[int, Request] = {}          # column -> request still to fork
    results: list[Completion] = []
    while queue or columns:
      ls = self._admit_waiting(ls, queue, columns, reserved, pending_forks)
      ls = self._grow_if_needed(ls, reserved)
      ls = self._loop(self.graphdef, config, self.params, ls, jnp.int32(self.max_steps))
      stats.loop_entries += 1
      host = jax.device_get({k: getattr(ls, k) for k in (
          "done", "stopped", "length", "fed", "hold", "active", "prompt_len", "steps",
          "step_tokens", "occupancy", "status")})
      if int(host["status"]) != Status.OK:
        raise RuntimeError(f"the cache refused a step: {Status(int(host['status'])).name}")
      stats.steps, stats.step_tokens = int(host["steps"]), int(host["step_tokens"])
      stats.occupancy = int(host["occupancy"])
      stats.peak_rows = max(stats.peak_rows, int(host["fed"][host["active"] == 1].sum()))
      finished = [c for c in columns if host["done"][c]]
      new_results = []
      if finished:
        tokens = np.asarray(jax.device_get(ls.tokens))
        for c in finished:
          request, index = columns.pop(c)
          reserved.pop(c)
          start, end = int(host["prompt_len"][c]), int(host["length"][c])
          new_results.append(Completion(request.request_id, index, request.prompt,
                                        tokens[c, start:end].tolist(),
                                        "stop" if host["stopped"][c] else "length"))
          stats.generated += end - start
        collected = np.zeros((config.max_seqs,), bool)
        collected[finished] = True   # a fixed-shape mask: no new compilation per count
        ls = dataclasses.replace(ls, done=jnp.where(jnp.asarray(collected), 0, ls.done))
      for c in [c for c in pending_forks
                if host["fed"][c] >= host["hold"][c] and host["hold"][c] < self.max_len]:
        ls = self._fork_column(ls, c, pending_forks.pop(c), columns, reserved)
      results.extend(new_results)
      stats.seconds = time.perf_counter() - started
      if on_progress is not None:
        on_progress(stats, new_results)
      if not columns and queue and not self._can_admit(queue[0], columns, reserved):
        raise RuntimeError("a queued request cannot be admitted into an empty engine")
    self.state = ls
    stats.seconds = time.perf_counter() - started
    return sorted(results, key=lambda c: (order[c.request_id], c.index))

  def _needs(self, request: Request) -> tuple[int, int]:
    """(columns, rows) a request reserves: each sample holds prompt + max_tokens - 1."""
    p = request.params
    return p.n, p.n * (len(request.prompt) + p.max_tokens - 1)

  def _can_admit(self, request, columns, reserved) -> bool:
    cols, rows = self._needs(request)
    return (len(columns) + cols <= self.config.max_seqs
            and sum(reserved.values()) + rows <= self.config.capacity)

  def _admit_waiting(self, ls, queue, columns, reserved, pending_forks):
    while queue and self._can_admit(queue[0], columns, reserved):
      request = queue.pop(0)
      p = request.params
      prompt_len = len(request.prompt)
      fork = p.n > 1 and prompt_len > 1
      copies = 1 if fork else p.n
      for index in range(copies):
        prompt = np.zeros((self.max_len,), np.int32)
        prompt[:prompt_len] = request.prompt
        stops = np.full((self.max_stop,), -1, np.int32)
        stops[:len(p.stop_tokens)] = p.stop_tokens
        ls, status, seq_id = self._admit(
            self.config, ls, jnp.asarray(prompt), jnp.int32(prompt_len),
            jnp.int32(prompt_len + p.max_tokens),
            jnp.int32(prompt_len - 1 if fork else self.max_len), jnp.float32(p.temperature),
            jnp.int32(p.top_k), jnp.float32(p.top_p), jnp.int32(p.seed), jnp.int32(index),
            jnp.asarray(stops))
        if int(status) != Status.OK:
          raise RuntimeError(f"seq_new refused: {Status(int(status)).name}")
        seq_id = int(seq_id)
        columns[seq_id] = (request, index)
        reserved[seq_id] = (prompt_len + p.max_tokens - 1) * (p.n if fork else 1)
        if fork:
          pending_forks[seq_id] = request
    return ls

  def _fork_column(self, ls, src, request, columns, reserved):
    """Clones a prefilled prompt into its `n - 1` sibling samples."""
    per_sample = reserved[src] // request.params.n
    reserved[src] = per_sample
    for index in range(1, request.params.n):
      ls, status, seq_id = self._fork(self.config, ls, jnp.int32(src), jnp.int32(index))
      if int(status) != Status.OK:
        raise RuntimeError(f"seq_clone refused: {Status(int(status)).name}")
      columns[int(seq_id)] = (request, index)
      reserved[int(seq_id)] = per_sample
    return self._release(self.config, ls, jnp.int32(src))

  def _grow_if_needed(self, ls, reserved):
    """Grows flat rows on the host so no admitted sequence can hit NEEDS_ROWS in the loop."""
    config = self.config
    if not config.has_flat or not reserved:
      return ls
    current = next(ls.cache.k[l].shape[0] for l, layer in enumerate(config.layers)
                   if not layer.policy.is_ring)
    needed = max(reserved.values())
    if needed <= current:
      return ls
    return _grow(config, ls, _grown_rows(config, current, needed))


# ----------------------------------------------------------------------------- step runner


def _run_step(graphdef, config, params, cache, tokens):
  from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
  model = merge_model(graphdef, params)
  cache, st_prepare = pure.prepare_step(config, cache)
  logits, cache = model(tokens, cache)
  cache, st_commit = pure.commit_step(config, cache)
  return cache, logits, _first_bad(st_prepare, st_commit)


_RUNNER_VERBS = {name: jax.jit(getattr(pure, name), static_argnums=0, donate_argnums=1)
                 for name in ("seq_new", "seq_clone", "seq_rm", "rewind", "declare_step")}
_jit_rows_needed = jax.jit(pure.rows_needed, static_argnums=0)
_jit_run_step = jax.jit(_run_step, static_argnums=(0, 1), donate_argnums=3)


class ModelRunner:
  """Host-level, step-by-step driving of a model on its own cache.

  Each `step` is one declare (jitted), an optional host-side flat growth, and one
  jitted prepare → model → commit with the cache donated. Refused sequence verbs
  return None/False as on `jaxkv.BatchedSequenceCache`.

  Args:
    model: an NNX model following the step protocol, with `cache_config`.
    mesh, kv_axis: as for `Engine` (default: the model's).
  """

  def __init__(self, model, *, mesh=None, kv_axis: str | None = None):
    config = getattr(model, "cache_config", None)
    if not isinstance(config, CacheConfig):
      raise ValueError(f"model={type(model).__name__} must have a CacheConfig `cache_config`")
    self.config = config
    self.mesh, self.kv_axis = _model_mesh(model, config, mesh, kv_axis)
    self.graphdef, self.params = _split_placed(model, self.mesh)
    self.cache = init_state(config, mesh=self.mesh, kv_axis=self.kv_axis)
    self._seq_new, self._seq_clone = _RUNNER_VERBS["seq_new"], _RUNNER_VERBS["seq_clone"]
    self._seq_rm, self._rewind = _RUNNER_VERBS["seq_rm"], _RUNNER_VERBS["rewind"]
    self._declare = _RUNNER_VERBS["declare_step"]
    self._rows_needed = _jit_rows_needed
    self._step = _jit_run_step

  def seq_new(self) -> int | None:
    self.cache, status, seq_id = self._seq_new(self.config, self.cache)
    return int(seq_id) if int(status) == Status.OK else None

  def seq_clone(self, src: int, upto: int | None = None) -> int | None:
    upto = pure.WHOLE if upto is None else upto
    self.cache, status, seq_id = self._seq_clone(self.config, self.cache, jnp.int32(src),
                                                 jnp.int32(upto))
    return int(seq_id) if int(status) == Status.OK else None

  def seq_rm(self, seq_id: int) -> bool:
    self.cache, status = self._seq_rm(self.config, self.cache, jnp.int32(seq_id))
    return int(status) == Status.OK

  def rewind(self, seq_id: int, position: int) -> bool:
    self.cache, status = self._rewind(self.config, self.cache, jnp.int32(seq_id),
                                      jnp.int32(position))
    return int(status) == Status.OK

  def pos(self, seq_id: int) -> int:
    return int(self.cache.pos[seq_id]) if int(self.cache.live[seq_id]) else 0

  def step(self, seq_ids: Sequence[int], tokens: Sequence[int], owner_blocks=None) -> np.ndarray:
    """Runs one step; returns the logits of the real tokens, `float32[n, vocab]`.

    Args:
      seq_ids: sequence of each step token (at most `W`).
      tokens: token id of each step token.
      owner_blocks: optional `[(start, length), ...]` owner blocks (SPEC §9).

    Raises:
      ValueError: `seq_ids` and `tokens` differ in length, or the declaration
        is refused (the status is named).
    """
    config, width = self.config, self.config.step_width
    n = len(seq_ids)
    if len(tokens) != n:
      raise ValueError(f"tokens has {len(tokens)} entries; seq_ids has {n}")
    if not 1 <= n <= width:
      raise ValueError(f"seq_ids must hold 1..W={width} entries; got {n}")
    ids = np.full((width,), config.max_seqs, np.int32)
    ids[:n] = seq_ids
    toks = np.zeros((width,), np.int32)
    toks[:n] = tokens
    blocks = np.zeros((width, 2), np.int32)
    for i, (start, length) in enumerate(owner_blocks or ()):
      blocks[i] = (start, length)
    self.cache, status = self._declare(config, self.cache, jnp.asarray(ids), jnp.int32(n),
                                       jnp.asarray(blocks))
    if int(status) != Status.OK:
      raise ValueError(f"seq_ids={list(seq_ids)} (owner_blocks={owner_blocks}) refused: "
                       f"{Status(int(status)).name}")
    needed = int(self._rows_needed(config, self.cache))
    if config.has_flat:
      current = next(self.cache.k[l].shape[0] for l, layer in enumerate(config.layers)
                     if not layer.policy.is_ring)
      if needed > current:
        self.cache = pure.grow(config, self.cache, _grown_rows(config, current, needed))
    self.cache, logits, status = self._step(self.graphdef, config, self.params, self.cache,
                                            jnp.asarray(toks))
    if int(status) != Status.OK:
      raise RuntimeError(f"step failed: {Status(int(status)).name}")
    return np.asarray(logits[:n])


def bytes_in_use(config: CacheConfig, positions: Sequence[int]) -> int:
  """K+V bytes that sequences at `positions` occupy (a ring layer holds at most its rows)."""
  total = 0
  for l, layer in enumerate(config.layers):
    per_row = 2 * layer.n_kv_heads * layer.head_dim * config.kv_dtype.itemsize
    cap = config.ring_rows(l) if layer.policy.is_ring else None
    total += per_row * sum(p if cap is None else min(p, cap) for p in positions)
  return total


def storage_bytes(cache: CacheState) -> int:
  """Bytes allocated for K/V storage (all layers, all columns)."""
  return sum(int(math.prod(a.shape)) * a.dtype.itemsize for a in cache.k + cache.v)
