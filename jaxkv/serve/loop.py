"""The jitted serving loop: its carried state, the step schedule, one step, admission and forks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import CacheConfig, CacheState, Status, init_state, pure
from jaxkv.serve.sampling import sample


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
