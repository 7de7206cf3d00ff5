"""What the jitted serving loop carries: the cache, the columns, the device queue, the outputs.

`S = max_seqs` columns, `L = max_len` tokens per column, `Q` queued requests,
`R` output rows (one per sample: request `i`'s sample `j` is row
`out_base[i] + j`), `M` most new tokens of any request, `NS` stop-token slots,
`RL` logprob rows, `T` logprob tokens per row (a window: token `t` of a
sample is at `t % T`), `NL` top logprobs per token (the engine's `max_logprobs`).
Everything is a fixed-shape array, so one compiled loop serves every queue of
the same sizes.

`LoopState` groups them: the `CacheState`, the `Queue` (`[Q, ...]`), the
`Columns` (`[S, ...]`, with the sampling parameters as a `ColumnParams` record
that mirrors the queue's), the `Outputs` (`[R, ...]`) and the loop's counters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import CacheConfig, CacheState, Status, init_state
from jaxkv.serve.requests import MAX_LOGIT_BIAS, bias_slots
from jaxkv.structured.pool import Pool, empty_pool

# `lp_base`/`lp_row` of a request that wants no logprobs: past every logprob row, so its
# writes are dropped (a fork adds its sample index and stays out of range).
NO_ROW = 2**30
# The incremental API's logprob tokens per output row between host reads (it caps a loop entry's
# steps while a request wants logprobs); small: it costs rows x window x (1 + 2 NL) x 4 bytes.
LOGPROB_WINDOW = 64


def _register(cls):
  names = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_register
@dataclasses.dataclass(frozen=True)
class Queue:
  """Requests waiting for a column, packed on the device (admitted in order).

  Attributes:
    prompt: `int32[Q, L]` prompt tokens (zero padded).
    prompt_len, max_tokens, top_k, seed, n, out_base: `int32[Q]`.
    temperature, top_p, min_p, repetition_penalty, presence_penalty,
      frequency_penalty: `float32[Q]`.
    logprobs: `int32[Q]` top logprobs wanted (-1: none).
    lp_base: `int32[Q]` the request's first logprob row (`NO_ROW`: none).
    stop_tokens: `int32[Q, NS]` (-1 = unused).
    min_tokens: `int32[Q]` new tokens before a stop token may be sampled.
    bias_tokens, bias: `int32[Q, NB]` and `float32[Q, NB]` logit bias slots (-1: unused).
    restrict: `int32[Q]` 1: only the slots' tokens may be drawn (`allowed_token_ids`).
    grammar: `int32[Q]` the request's grammar's initial state in `LoopState.grammar`
      (-1: none).
    speculative: `int32[Q]` 1: the request may be drafted (`SamplingParams.speculative`).
    next: `int32[]` the first request not yet (fully) admitted.
    copies: `int32[]` columns already admitted for request `next` (a request
      of a one-token prompt and `n > 1` takes its `n` columns one at a time).
    count: `int32[]` requests in the queue.
  """

  prompt: jax.Array
  prompt_len: jax.Array
  max_tokens: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  n: jax.Array
  stop_tokens: jax.Array
  out_base: jax.Array
  min_p: jax.Array
  repetition_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  logprobs: jax.Array
  lp_base: jax.Array
  min_tokens: jax.Array
  bias_tokens: jax.Array
  bias: jax.Array
  restrict: jax.Array
  grammar: jax.Array
  speculative: jax.Array
  next: jax.Array
  copies: jax.Array
  count: jax.Array


@_register
@dataclasses.dataclass(frozen=True)
class ColumnParams:
  """A column's sampling parameters: its request's, copied from the queue at admission.

  Each field mirrors the `Queue` field of the same name (`[S, ...]` here,
  `[Q, ...]` there), so `of_request` takes them all by name.

  Attributes:
    temperature, top_p: `float32[S]`; top_k, seed: `int32[S]`.
    stop_tokens: `int32[S, NS]` (-1 = unused).
    min_p, repetition_penalty, presence_penalty, frequency_penalty: `float32[S]`.
    logprobs: `int32[S]` top logprobs wanted (-1: none).
    min_tokens: `int32[S]` new tokens before a stop token may be sampled.
    bias_tokens, bias: `int32[S, NB]` and `float32[S, NB]` logit bias slots (-1: unused).
    restrict: `int32[S]` 1: only the slots' tokens may be drawn (`allowed_token_ids`).
    speculative: `int32[S]` 1: the request may be drafted (`SamplingParams.speculative`).
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  stop_tokens: jax.Array
  min_p: jax.Array
  repetition_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  logprobs: jax.Array
  min_tokens: jax.Array
  bias_tokens: jax.Array
  bias: jax.Array
  restrict: jax.Array
  speculative: jax.Array

  @classmethod
  def of_request(cls, queue: Queue, i) -> ColumnParams:
    """Queued request `i`'s parameters, as one column's record."""
    return cls(**{f.name: getattr(queue, f.name)[i] for f in dataclasses.fields(cls)})


@_register
@dataclasses.dataclass(frozen=True)
class Columns:
  """Per-column loop data: every leaf is `[S, ...]`, so a column is one record.

  A column moves (`paged_claims.swap`), is copied to a fork or written at
  admission (`columns.put`, `columns.update`) as a whole, by `jax.tree.map`.

  Attributes:
    tokens: `int32[S, L]` each column's prompt then generated tokens.
    prompt_len, length, fed: `int32[S]` prompt tokens, known tokens, tokens
      written to the cache (= the sequence's position).
    hold: `int32[S]` most tokens to feed before the column forks (`L`: none).
    forks: `int32[S]` sibling samples still to fork from the column.
    limit: `int32[S]` length at which the column finishes.
    used: `int32[S]` 1 while the column holds a sequence.
    active: `int32[S]` 1 while the column is generating.
    done: `int32[S]` 1 from its last step until the column is retired.
    reserve: `int32[S]` cache positions reserved for the column (and its
      pending forks), so no step inside the loop can run out of room.
    out_row: `int32[S]` the column's output row.
    sample_index: `int32[S]` the column's sample of its request (`0 .. n-1`).
    lp_row: `int32[S]` the column's logprob row (`NO_ROW`: none).
    params: the `ColumnParams`.
    parked: `int32[S]` paged storage: 1 while the column's sequence is
      preempted (its pages dropped, its tokens kept here to be recomputed).
    stamp: `int32[S]` admission order (the latest admitted is preempted first;
      parked columns come back oldest first; `LoopState.clock` is the next stamp).
    cached: `int32[S]` prefix caching: 1 while the column is a retained prefix
      (a live sequence holding prompt pages, `used = 0`); last_use: `int32[S]`
      its clock at creation or last adoption (the least recently used goes first).
    page_hash: `uint32[S, H]` prefix caching: the chained hash of each full
      prompt page of the column's tokens (`H = max_len // page_size`; `H = 0`
      turns prefix caching off).
    grammar: `int32[S]` the column's state in `LoopState.grammar` (-1: no grammar;
      `structured.pool.DEAD`: only a stop token may follow) before `grammar_token`.
    grammar_token: `int32[S]` the token the column drew last and its automaton has not
      consumed yet (-1: none); the sampler consumes it at the column's next draw.
    draft: `int32[S]` speculative decoding: draft tokens waiting in `tokens` past
      `length`, fed with the column's pending token and verified in its next step.
  """

  tokens: jax.Array
  prompt_len: jax.Array
  length: jax.Array
  fed: jax.Array
  hold: jax.Array
  forks: jax.Array
  limit: jax.Array
  used: jax.Array
  active: jax.Array
  done: jax.Array
  reserve: jax.Array
  out_row: jax.Array
  sample_index: jax.Array
  lp_row: jax.Array
  params: ColumnParams
  parked: jax.Array
  stamp: jax.Array
  cached: jax.Array
  last_use: jax.Array
  page_hash: jax.Array
  grammar: jax.Array
  grammar_token: jax.Array
  draft: jax.Array


@_register
@dataclasses.dataclass(frozen=True)
class Outputs:
  """Per-output-row results: leaves are `[R, ...]` (the logprobs `[RL, ...]`), not per column.

  Attributes:
    tokens: `int32[R, M]` each sample's generated tokens; length: `int32[R]`
      tokens generated so far; stop, done: `int32[R]` set when it finishes.
    logprob: `float32[RL, T]` each generated token's logprob, top_ids:
      `int32[RL, T, NL]` and top_logprobs: `float32[RL, T, NL]` the top
      alternatives (`sampling.sample_rows`); token `t` at `t % T`.
    admitted, first, finished: `int32[R]` the `steps` counter when the
      sample's request was admitted, after the step that sampled its first
      token, after the step that sampled its last (-1 until then; a reused row
      holds its last sample's values until they are set again). `Engine.run`
      turns them into latency figures (`RequestTiming`).
    draft_tokens, accepted_tokens, draft_rounds: `int32[R]` speculative decoding: the
      sample's draft tokens verified, those accepted, and the steps that verified one
      (reset when a request takes the row).
  """

  tokens: jax.Array
  length: jax.Array
  stop: jax.Array
  done: jax.Array
  logprob: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array
  admitted: jax.Array
  first: jax.Array
  finished: jax.Array
  draft_tokens: jax.Array
  accepted_tokens: jax.Array
  draft_rounds: jax.Array


@_register
@dataclasses.dataclass(frozen=True)
class LoopState:
  """Everything the jitted loop carries.

  Attributes:
    cache: the `CacheState`.
    queue: the `Queue`.
    cols: the `Columns` (per-column data).
    out: the `Outputs` (per-output-row results).
    steps, step_tokens, occupancy, peak_rows, status: `int32[]` counters, the
      most positions held at once, and the first non-OK cache status
      (`merge_status`).
    width_steps: `int32[len(widths)]` steps run at each compiled width.
    clock: `int32[]` the next admission stamp (`Columns.stamp`).
    preemptions, evictions, cached_tokens: `int32[]` sequences preempted,
      retained prefixes evicted, prompt tokens adopted instead of computed.
    adopt_wait: `int32[2]` prefix caching: `(column, length)` when the queue's
      head waits for a running column to prefill `length` prompt tokens it
      shares (the step loops stop then, to admit it); `(-1, 0)` otherwise.
    grammar: the structured-output automata of the requests (`structured.pool.Pool`),
      read by the sampler; the host places them (`HostQueue.grammar`,
      `EngineCore.set_grammar`).
    draft_tokens, accepted_tokens: `int32[]` speculative decoding: draft tokens
      verified, and those accepted and emitted.
    draft_pause: `int32[2]` speculative decoding: `(steps left, misses)` of the
      drafting pause (`speculative.pause_after`); no column drafts while steps are left.
  """

  cache: CacheState
  queue: Queue
  cols: Columns
  out: Outputs
  steps: jax.Array
  step_tokens: jax.Array
  occupancy: jax.Array
  peak_rows: jax.Array
  status: jax.Array
  width_steps: jax.Array
  clock: jax.Array
  preemptions: jax.Array
  evictions: jax.Array
  cached_tokens: jax.Array
  adopt_wait: jax.Array
  grammar: Pool
  draft_tokens: jax.Array
  accepted_tokens: jax.Array
  draft_pause: jax.Array


def merge_status(current, status, did=True):
  """The loop status after a verb that returned `status` where `did`: the first non-OK one stays."""
  return jnp.where(did & (status != Status.OK) & (current == Status.OK), status, current)


@dataclasses.dataclass(frozen=True)
class HostQueue:
  """A queue built on the host (NumPy), to be placed in a `LoopState`.

  `lp_rows` x `lp_window` x `num_logprobs` size the logprob outputs: 0 rows
  when no request of the queue wants logprobs, so they cost nothing then.
  """

  arrays: dict
  rows: int
  max_new: int
  count: int
  lp_rows: int = 0
  lp_window: int = 1
  num_logprobs: int = 0
  grammar: Pool | None = None   # NumPy arrays; None: an empty pool of one state


def _bucket(n: int) -> int:
  """`n` rounded up to a power of two (at least 8): few distinct shapes, few compilations."""
  return max(8, 1 << (max(n, 1) - 1).bit_length())


def pack_queue(prompts, params, *, max_len: int, max_stop: int,
               num_logprobs: int = 0, grammar_starts=None, grammar: Pool | None = None
               ) -> HostQueue:
  """Packs validated requests (prompt tuples and their `SamplingParams`) into arrays.

  The queue and the output rows are padded to powers of two and every output
  row holds `max_len` tokens, so queues of similar size share one compiled loop.
  Samples that want logprobs get logprob rows of their own (`max_len` tokens,
  `num_logprobs` alternatives each), also padded to a power of two; none when
  no request wants them. `grammar_starts` holds each request's initial state in
  `grammar` (the pool the queue's automata were placed in), -1 for none.
  """
  q = _bucket(len(prompts))
  a = {
      "prompt": np.zeros((q, max_len), np.int32),
      "prompt_len": np.zeros((q,), np.int32), "max_tokens": np.zeros((q,), np.int32),
      "temperature": np.zeros((q,), np.float32), "top_k": np.zeros((q,), np.int32),
      "top_p": np.ones((q,), np.float32), "seed": np.zeros((q,), np.int32),
      "n": np.zeros((q,), np.int32), "stop_tokens": np.full((q, max_stop), -1, np.int32),
      "out_base": np.zeros((q,), np.int32),
      "min_p": np.zeros((q,), np.float32), "repetition_penalty": np.ones((q,), np.float32),
      "presence_penalty": np.zeros((q,), np.float32),
      "frequency_penalty": np.zeros((q,), np.float32),
      "logprobs": np.full((q,), -1, np.int32), "lp_base": np.full((q,), NO_ROW, np.int32),
      "min_tokens": np.zeros((q,), np.int32),
      "bias_tokens": np.full((q, MAX_LOGIT_BIAS), -1, np.int32),
      "bias": np.zeros((q, MAX_LOGIT_BIAS), np.float32), "restrict": np.zeros((q,), np.int32),
      "grammar": np.full((q,), -1, np.int32), "speculative": np.ones((q,), np.int32)}
  if grammar_starts is not None:
    a["grammar"][:len(prompts)] = grammar_starts
  row = lp_row = 0
  for i, (prompt, p) in enumerate(zip(prompts, params)):
    a["prompt"][i, :len(prompt)] = prompt
    a["prompt_len"][i], a["max_tokens"][i] = len(prompt), p.max_tokens
    a["temperature"][i], a["top_k"][i], a["top_p"][i] = p.temperature, p.top_k, p.top_p
    a["seed"][i], a["n"][i], a["out_base"][i] = p.seed, p.n, row
    a["stop_tokens"][i, :len(p.stop_tokens)] = p.stop_tokens
    a["min_tokens"][i] = p.min_tokens
    a["speculative"][i] = int(p.speculative)
    slots, a["restrict"][i] = bias_slots(p)
    if slots:
      a["bias_tokens"][i, :len(slots)], a["bias"][i, :len(slots)] = zip(*slots)
    row += p.n
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
      a[name][i] = getattr(p, name)
    if p.logprobs is not None:
      a["logprobs"][i], a["lp_base"][i] = p.logprobs, lp_row
      lp_row += p.n
  return HostQueue(a, _bucket(row), max_len, len(prompts),
                   lp_rows=_bucket(lp_row) if lp_row else 0, lp_window=max_len,
                   num_logprobs=num_logprobs, grammar=grammar)


def init_loop_state(config: CacheConfig, host_queue: HostQueue, *, num_widths: int,
                    mesh=None, kv_axis: str = "tp", prefix_cache: bool = False) -> LoopState:
  """A loop state with an empty cache, no column in use and `host_queue` waiting.

  With `mesh`, the cache's K/V are split over their heads along `kv_axis` and
  everything else is replicated on the mesh. `prefix_cache` (paged storage
  only) sizes `Columns.page_hash` for every full page of `max_len` tokens.
  """
  if prefix_cache and not config.is_paged:
    raise ValueError("prefix_cache=True needs paged storage: CacheConfig(page_size=...)")
  max_len, max_stop = host_queue.arrays["prompt"].shape[1], host_queue.arrays["stop_tokens"].shape[1]
  # One transfer of the queue and one compiled call for every other leaf: made op
  # by op they were ~100 dispatches per `Engine.run` before the loop could start.
  fresh = _fresh_fields_fn(config.max_seqs, max_len, max_stop, host_queue.rows, host_queue.max_new,
                           (host_queue.lp_rows, host_queue.lp_window), host_queue.num_logprobs,
                           num_widths, max_len // config.page_size if prefix_cache else 0)
  cols, out, counters, queue_counters = fresh(np.int32(host_queue.count))
  queue = Queue(**jax.device_put(host_queue.arrays), **queue_counters)
  pool = host_queue.grammar if host_queue.grammar is not None else empty_pool(32)
  ls = LoopState(cache=None, queue=queue, cols=cols, out=out, grammar=Pool(
      *jax.device_put(tuple(pool))), **counters)
  if mesh is not None:
    ls = jax.device_put(ls, NamedSharding(mesh, P()))
  return dataclasses.replace(ls, cache=init_state(config, mesh=mesh, kv_axis=kv_axis))


@functools.lru_cache(maxsize=64)
def _fresh_fields_fn(s: int, max_len: int, max_stop: int, rows: int, m: int, lp_shape: tuple,
                     nl: int, num_widths: int, hash_pages: int):
  """A jitted builder of a fresh `LoopState`'s parts but the cache and the queue's arrays.

  Returns `(Columns, Outputs, the loop's counters, the queue's counters)`.
  """
  def fresh(count):
    zeros = lambda dtype=jnp.int32: jnp.zeros((s,), dtype)
    scalar = lambda v=0: jnp.asarray(v, jnp.int32)
    unset = lambda n: jnp.full((n,), -1, jnp.int32)
    f32 = lambda v: jnp.full((s,), v, jnp.float32)
    params = ColumnParams(
        temperature=zeros(jnp.float32), top_k=zeros(), top_p=jnp.ones((s,), jnp.float32),
        seed=zeros(), stop_tokens=jnp.full((s, max_stop), -1, jnp.int32),
        min_p=f32(0.0), repetition_penalty=f32(1.0), presence_penalty=f32(0.0),
        frequency_penalty=f32(0.0), logprobs=jnp.full((s,), -1, jnp.int32), min_tokens=zeros(),
        bias_tokens=jnp.full((s, MAX_LOGIT_BIAS), -1, jnp.int32),
        bias=jnp.zeros((s, MAX_LOGIT_BIAS), jnp.float32), restrict=zeros(), speculative=zeros())
    cols = Columns(
        tokens=jnp.zeros((s, max_len), jnp.int32),
        prompt_len=zeros(), length=zeros(), fed=zeros(), hold=jnp.full((s,), max_len, jnp.int32),
        forks=zeros(), limit=zeros(), used=zeros(), active=zeros(), done=zeros(), reserve=zeros(),
        out_row=zeros(), sample_index=zeros(), lp_row=jnp.full((s,), NO_ROW, jnp.int32),
        params=params, parked=zeros(), stamp=zeros(), cached=zeros(), last_use=zeros(),
        page_hash=jnp.zeros((s, hash_pages), jnp.uint32), grammar=unset(s),
        grammar_token=unset(s), draft=zeros())
    out = Outputs(
        tokens=jnp.zeros((rows, m), jnp.int32), length=jnp.zeros((rows,), jnp.int32),
        stop=jnp.zeros((rows,), jnp.int32), done=jnp.zeros((rows,), jnp.int32),
        logprob=jnp.zeros(lp_shape, jnp.float32),
        top_ids=jnp.zeros(lp_shape + (nl,), jnp.int32),
        top_logprobs=jnp.zeros(lp_shape + (nl,), jnp.float32),
        admitted=unset(rows), first=unset(rows), finished=unset(rows),
        draft_tokens=jnp.zeros((rows,), jnp.int32), accepted_tokens=jnp.zeros((rows,), jnp.int32),
        draft_rounds=jnp.zeros((rows,), jnp.int32))
    counters = dict(
        steps=scalar(), step_tokens=scalar(), occupancy=scalar(), peak_rows=scalar(),
        status=scalar(), width_steps=jnp.zeros((num_widths,), jnp.int32), clock=scalar(),
        preemptions=scalar(), evictions=scalar(), cached_tokens=scalar(),
        adopt_wait=jnp.asarray([-1, 0], jnp.int32), draft_tokens=scalar(),
        accepted_tokens=scalar(), draft_pause=jnp.zeros((2,), jnp.int32))
    return cols, out, counters, dict(next=scalar(), copies=scalar(), count=count.astype(jnp.int32))
  return jax.jit(fresh)
