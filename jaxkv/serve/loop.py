"""The jitted serving loop: admission, forks, retirement and steps at a few compiled widths.

One `jax.jit` of `serve_loop` serves a whole queue (`LoopState.queue`):

- **outer loop** (`lax.while_loop`): retire the columns that finished
  (`pure.seq_rm`), admit queued requests while a column and the reserved
  room allow (`pure.seq_new`, prompt copied from the device queue), fork
  parallel samples whose prompt is prefilled (`pure.seq_clone`), then run steps;
- **steps, in phases by width**: for each compiled width `w` (widest first),
  an inner `lax.while_loop` runs steps while the tokens wanted fit `w` and no
  wider width is needed. A step packs every active column's pending tokens on a
  `w`-wide axis (one decode token per column first, then prefill chunks),
  declares and prepares it (`W`-wide plan), runs the model on `w` rows
  (`pure.run_narrow`), commits, samples one token for each column whose last
  pending token was in the step, and writes it to the column and its output
  row. An inner loop ends when a column finishes or is ready to fork (the outer
  loop acts on it), when the wanted width changes, after the step budget, or on
  a non-OK status.

Over paged storage (`config.page_size` set) the retire / admit / fork block is
`paged_admit.outer_body` instead: admission by claims, preemption of the latest
admitted sequence when a step would pass `capacity`, and the prefix cache
(`paged_loop.py`); the step loops also stop when the next step does not fit.

No width is chosen by recompiling and no `lax.cond` wraps the model, so a
decode-only step pays for `w` rows, not `W`. The loop returns to the host
only when the queue is served, the step budget is spent, or a status is not OK.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve import paged_admit, paged_loop
from jaxkv.serve.sampling import RowParams, greedy_rows, sample_rows
from jaxkv.serve.state import LoopState
from pallas_kernels.common import prefix_sum


def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _first_bad(*statuses):
  out = _i32(Status.OK)
  for st in reversed(statuses):
    out = jnp.where(st != Status.OK, st, out)
  return out


def _wanted(ls: LoopState):
  """`int32[S]` tokens each column could feed now (prompt remainder or its next token)."""
  return jnp.where(ls.active == 1, jnp.maximum(jnp.minimum(ls.length, ls.hold) - ls.fed, 0), 0)


def _column_totals(*per_column):
  """`int32[k]`: the sums over the columns of `k` per-column `[S]` values, as one reduction.

  The step and its loop condition each need several such sums; XLA runs a
  reduction per `sum` (a GPU kernel each), and one per stacked array.
  """
  return jnp.stack([_i32(v) for v in per_column]).sum(axis=1, dtype=jnp.int32)


def width_index(widths: tuple[int, ...], ls: LoopState, total=None):
  """Index of the narrowest width that holds every wanted token (widest when none does).

  `total`: the wanted tokens' sum (`_wanted(ls).sum()`), when the caller has it.
  """
  total = _wanted(ls).sum() if total is None else total
  index = _i32(0)
  for i, w in enumerate(widths[1:], start=1):   # widths are descending
    index = jnp.where(total <= w, i, index)
  return index


def _schedule(width: int, ls: LoopState, room=None):
  """Tokens per column this step: one per wanting column first, then prefill chunks.

  With `room` (paged storage: `capacity - held`), the prefill chunks are cut so
  the step carries at most `room` tokens (the loop ensures the first ones fit).

  Returns:
    `(alloc int32[S], start int32[S])`: tokens each column carries and where
    its run starts on the step axis (columns in order, one run each).
  """
  want = _wanted(ls)
  one = jnp.minimum(want, 1)
  # Every prefix sum below derives from these two, taken in one compare-and-sum
  # (`prefix_sum`; a cumsum is a chain of reduce-windows, several GPU kernels).
  cum_one, cum_want = prefix_sum(jnp.stack([one, want]))
  first = jnp.where(cum_one <= width, one, 0)
  cum_first = jnp.minimum(cum_one, width)   # the ones are taken in order while they fit
  rest = want - first
  cum_rest = cum_want - cum_first
  budget = (width if room is None else jnp.minimum(width, room)) - cum_first[-1]
  more = jnp.clip(budget - (cum_rest - rest), 0, rest)
  alloc = (first + more).astype(jnp.int32)
  # The chunks fill the budget in column order, so their prefix sums are capped by it.
  start = cum_first + jnp.minimum(cum_rest, jnp.maximum(budget, 0)) - alloc
  return alloc, start.astype(jnp.int32)


def _step_tokens(config: CacheConfig, width: int, ls: LoopState, alloc, start, n):
  """`(seq_ids int32[W], tokens int32[width])` of the scheduled step of `n` tokens."""
  s = config.max_seqs
  idx = jnp.arange(width, dtype=jnp.int32)
  # One fused compare: the default scan is a loop of ~7 gathers, ~16 launches a step on GPU.
  col = jnp.searchsorted(start + alloc, idx, side="right", method="compare_all").astype(jnp.int32)
  is_real = idx < n
  col = jnp.where(is_real, col, s)
  safe = jnp.clip(col, 0, s - 1)
  offset = jnp.clip(ls.fed[safe] + idx - start[safe], 0, ls.tokens.shape[1] - 1)
  tokens = jnp.where(is_real, ls.tokens[safe, offset], 0)
  seq_ids = jnp.full((config.step_width,), s, jnp.int32).at[:width].set(col)
  return seq_ids, tokens


def _step(config: CacheConfig, model, widths, which: int, ls: LoopState,
          greedy: bool = False) -> LoopState:
  """One step at width `widths[which]`: plan, model, commit, sample, record.

  `greedy` (static): every request is plain greedy (no temperature, penalty or
  logprobs), so the token is the argmax and no sampler `lax.cond` is compiled.
  """
  width = widths[which]
  s = config.max_seqs
  alloc, start = _schedule(width, ls, paged_loop.room(config, ls) if config.is_paged else None)
  # The step's tokens and occupied columns; the used columns' positions now and the ones
  # the step adds if it succeeds (`peak_rows`).
  used = ls.used == 1
  n, occupancy, held, held_added = _column_totals(
      alloc, alloc > 0, jnp.where(used, ls.fed, 0), jnp.where(used, alloc, 0))
  seq_ids, tokens = _step_tokens(config, width, ls, alloc, start, n)
  blocks = jnp.zeros((config.step_width, 2), jnp.int32)
  cache, st_declare = pure.declare_step(config, ls.cache, seq_ids, n, blocks)
  cache, st_prepare = pure.prepare_step(config, cache)
  rows = jnp.clip(start + alloc - 1, 0, width - 1)
  logits, cache, st_narrow = pure.run_narrow(config, cache, width,
                                             lambda c: model(tokens, c, rows=rows))
  cache, st_commit = pure.commit_step(config, cache)
  status = _first_bad(st_declare, st_prepare, st_narrow, st_commit)
  ok = status == Status.OK

  emits = ok & (alloc > 0) & (ls.fed + alloc == ls.length)
  generated = ls.length - ls.prompt_len
  num_logprobs = ls.out_top_ids.shape[2]
  if greedy:
    new, lp, top_ids, top_lp = greedy_rows(logits, num_logprobs)
  else:
    keys = jax.vmap(lambda seed, i, t: jax.random.fold_in(
        jax.random.fold_in(jax.random.key(seed), i), t))(ls.seed, ls.sample_index, generated)
    new, lp, top_ids, top_lp = sample_rows(
        logits, _row_params(ls), keys, sampling=emits, history=ls.tokens,
        prompt_len=ls.prompt_len, length=ls.length, num_logprobs=num_logprobs)
  cols = jnp.arange(s, dtype=jnp.int32)
  max_len = ls.tokens.shape[1]
  tokens_buf = ls.tokens.at[cols, jnp.where(emits, ls.length, max_len)].set(new, mode="drop")
  rows_out, max_new = ls.out_tokens.shape
  out_at = jnp.where(emits, ls.out_row, rows_out)
  out_tokens = ls.out_tokens.at[out_at, jnp.minimum(generated, max_new - 1)].set(new, mode="drop")
  lp_rows, window = ls.out_logprob.shape
  lp_at, lp_t = jnp.where(emits & (ls.logprobs >= 0), ls.lp_row, lp_rows), generated % window
  length = ls.length + emits.astype(jnp.int32)
  is_stop = jnp.any(ls.stop_tokens == new[:, None], axis=1)
  finished = emits & (is_stop | (length >= ls.limit))
  fin_at = jnp.where(finished, ls.out_row, rows_out)
  first_at = jnp.where(emits & (generated == 0), ls.out_row, rows_out)   # latency bookkeeping
  fed = jnp.where(ok, ls.fed + alloc, ls.fed)
  as_int = lambda b: b.astype(jnp.int32)
  held = held + jnp.where(ok, held_added, 0)
  return dataclasses.replace(
      ls, cache=cache, tokens=tokens_buf, length=length, fed=fed,
      active=jnp.where(finished, 0, ls.active), done=ls.done | as_int(finished),
      out_tokens=out_tokens,
      out_len=ls.out_len.at[out_at].set(length - ls.prompt_len, mode="drop"),   # so far
      out_logprob=ls.out_logprob.at[lp_at, lp_t].set(lp, mode="drop"),
      out_top_ids=ls.out_top_ids.at[lp_at, lp_t].set(top_ids, mode="drop"),
      out_top_logprobs=ls.out_top_logprobs.at[lp_at, lp_t].set(top_lp, mode="drop"),
      out_stop=ls.out_stop.at[fin_at].set(as_int(is_stop), mode="drop"),
      out_done=ls.out_done.at[fin_at].set(1, mode="drop"),
      out_first=ls.out_first.at[first_at].set(ls.steps + 1, mode="drop"),
      out_finished=ls.out_finished.at[fin_at].set(ls.steps + 1, mode="drop"),
      steps=ls.steps + as_int(ok), step_tokens=ls.step_tokens + jnp.where(ok, n, 0),
      occupancy=ls.occupancy + jnp.where(ok, occupancy, 0),
      peak_rows=jnp.maximum(ls.peak_rows, held),
      # Elementwise, not `.at[which].add` (a dynamic-update-slice kernel of its own per step).
      width_steps=ls.width_steps + as_int(ok & (jnp.arange(len(widths)) == which)),
      status=jnp.where(ls.status == Status.OK, status, ls.status))


def _row_params(ls: LoopState) -> RowParams:
  return RowParams(temperature=ls.temperature, top_k=ls.top_k, top_p=ls.top_p, min_p=ls.min_p,
                   repetition_penalty=ls.repetition_penalty,
                   presence_penalty=ls.presence_penalty,
                   frequency_penalty=ls.frequency_penalty, logprobs=ls.logprobs)


# ----------------------------------------------------------------------------- columns


def _fork_ready(ls: LoopState):
  """`bool[S]`: columns whose prompt (but its last token) is in the cache and that still fork."""
  return (ls.active == 1) & (ls.forks > 0) & (ls.fed >= ls.hold)


def _head_needs(config: CacheConfig, ls: LoopState):
  """`(columns, rows)` the queue's next admission takes, and whether one is waiting."""
  q = ls.queue
  i = jnp.minimum(q.next, q.prompt_len.shape[0] - 1)
  waiting = q.next < q.count
  n, plen = q.n[i], q.prompt_len[i]
  per_sample = plen + q.max_tokens[i] - 1
  fork = (n > 1) & (plen > 1)
  cols = jnp.where(fork, n, 1)   # a forking request holds its siblings' columns from the start
  rows = jnp.where(fork, n * per_sample, per_sample)
  return waiting, cols, rows


def _can_admit(config: CacheConfig, ls: LoopState):
  waiting, cols, rows = _head_needs(config, ls)
  cols_held = ls.used.sum() + ls.forks.sum()
  return (waiting & (cols_held + cols <= config.max_seqs)
          & (ls.reserve.sum() + rows <= config.capacity) & (ls.status == Status.OK))


# Per-column sampling values copied from the queue at admission and to forks.
_SAMPLING_EXTRAS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "logprobs")


def _put(a, col, v):
  return a.at[col].set(v, mode="drop")


def _admit_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Admits the queue's next column: a new sequence with the request's prompt and parameters."""
  q = ls.queue
  i = q.next
  _, _, rows = _head_needs(config, ls)
  n, plen = q.n[i], q.prompt_len[i]
  fork = (n > 1) & (plen > 1)
  cache, status, seq_id = pure.seq_new(config, ls.cache)
  ok = status == Status.OK
  col = jnp.where(ok, seq_id, config.max_seqs)   # out of range: every write below is dropped
  max_len = ls.tokens.shape[1]
  sample_index = jnp.where(fork, 0, q.copies)
  put = lambda a, v: _put(a, col, v)
  # The output rows this admission starts: all n of a forking request, else this copy's one.
  first_row = q.out_base[i] + sample_index
  out_rows = jnp.arange(ls.out_admitted.shape[0], dtype=jnp.int32)
  admitted = ok & (out_rows >= first_row) & (out_rows < first_row + jnp.where(fork, n, 1))
  ls = dataclasses.replace(
      ls, cache=cache, tokens=put(ls.tokens, q.prompt[i]), prompt_len=put(ls.prompt_len, plen),
      length=put(ls.length, plen), fed=put(ls.fed, 0),
      hold=put(ls.hold, jnp.where(fork, plen - 1, max_len)),
      forks=put(ls.forks, jnp.where(fork, n - 1, 0)), limit=put(ls.limit, plen + q.max_tokens[i]),
      used=put(ls.used, 1), active=put(ls.active, 1), done=put(ls.done, 0),
      reserve=put(ls.reserve, rows), out_row=put(ls.out_row, q.out_base[i] + sample_index),
      temperature=put(ls.temperature, q.temperature[i]), top_k=put(ls.top_k, q.top_k[i]),
      top_p=put(ls.top_p, q.top_p[i]), seed=put(ls.seed, q.seed[i]),
      sample_index=put(ls.sample_index, sample_index),
      stop_tokens=put(ls.stop_tokens, q.stop_tokens[i]),
      **{f: put(getattr(ls, f), getattr(q, f)[i]) for f in _SAMPLING_EXTRAS},
      lp_row=put(ls.lp_row, q.lp_base[i] + sample_index),
      out_admitted=jnp.where(admitted, ls.steps, ls.out_admitted))
  # A forking request is one admission; otherwise each of its n samples is one.
  copies = jnp.where(ok, q.copies + 1, q.copies)
  finished_request = ok & (fork | (copies >= n))
  queue = dataclasses.replace(q, next=jnp.where(finished_request, q.next + 1, q.next),
                              copies=jnp.where(finished_request, 0, copies))
  return dataclasses.replace(ls, queue=queue,
                             status=jnp.where(ok | (ls.status != Status.OK), ls.status, status))


def _fork_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Clones the first fork-ready column into its next sibling sample."""
  ready = _fork_ready(ls)
  src = jnp.argmax(ready).astype(jnp.int32)
  cache, status, seq_id = pure.seq_clone(config, ls.cache, src, pure.WHOLE)
  ok = status == Status.OK
  col = jnp.where(ok, seq_id, config.max_seqs)
  n_left = ls.forks[src]
  index = ls.sample_index[src] + n_left   # siblings get n-1, n-2, ..., 1
  per_sample = ls.limit[src] - 1
  copy = lambda a: a.at[col].set(a[src], mode="drop")
  fields = ("tokens", "prompt_len", "length", "fed", "limit", "used", "active", "done",
            "temperature", "top_k", "top_p", "seed", "stop_tokens") + _SAMPLING_EXTRAS
  ls = dataclasses.replace(ls, cache=cache, **{f: copy(getattr(ls, f)) for f in fields})
  forks_left = jnp.where(ok, n_left - 1, n_left)
  max_len = ls.tokens.shape[1]
  return dataclasses.replace(
      ls, sample_index=_put(ls.sample_index, col, index),
      lp_row=_put(ls.lp_row, col, ls.lp_row[src] + n_left),
      out_row=_put(ls.out_row, col, ls.out_row[src] + n_left),
      hold=_put(ls.hold, col, max_len).at[src].set(jnp.where(forks_left == 0, max_len,
                                                             ls.hold[src])),
      forks=_put(ls.forks, col, 0).at[src].set(forks_left),
      reserve=_put(ls.reserve, col, per_sample).at[src].add(jnp.where(ok, -per_sample, 0)),
      status=jnp.where(ok | (ls.status != Status.OK), ls.status, status))


def _retire_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Removes the first finished column's sequence and frees its reservation."""
  col = jnp.argmax(ls.done == 1).astype(jnp.int32)
  cache, status = pure.seq_rm(config, ls.cache, col)
  ok = status == Status.OK
  return dataclasses.replace(
      ls, cache=cache, done=ls.done.at[col].set(jnp.where(ok, 0, 1)),
      used=ls.used.at[col].set(jnp.where(ok, 0, ls.used[col])),
      reserve=ls.reserve.at[col].set(jnp.where(ok, 0, ls.reserve[col])),
      status=jnp.where(ok | (ls.status != Status.OK), ls.status, status))


# ----------------------------------------------------------------------------- the loop


def serve_loop(graphdef, config: CacheConfig, widths: tuple[int, ...], params, ls: LoopState,
               max_steps, *, greedy: bool = False):
  """Serves the queue in `ls` until it is done, `max_steps` more steps ran, or a status fails.

  Jit it with `graphdef`, `config` and `widths` static and `ls` donated
  (`jax.jit(serve_loop, static_argnums=(0, 1, 2), donate_argnums=4)`); `Engine`
  does.

  Args:
    graphdef: the model's `nnx.GraphDef` (static).
    config: the model's `CacheConfig` (static).
    widths: descending step widths, the first `config.step_width` (static).
    params: the model's `nnx.State`.
    ls: `LoopState`; donated.
    max_steps: `int32[]` step budget of this entry.
    greedy: (static) every request in the queue is plain greedy (temperature 0,
      no penalty, no logprobs): tokens are the argmax with no sampler
      `lax.cond`, whose predicate costs a host sync per step on a GPU. Tokens are
      the same as the general loop's for such requests; `Engine.run` picks it.

  Returns:
    The new `LoopState`.
  """
  from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
  model = merge_model(graphdef, params)
  first_step = ls.steps
  ok = lambda ls: (ls.status == Status.OK) & (ls.steps - first_step < max_steps)

  paged = config.is_paged
  can_admit = (lambda ls: paged_admit.can_admit(config, ls)) if paged else (
      lambda ls: _can_admit(config, ls))

  def phase(which):
    def cond(ls):
      wanted = _wanted(ls)
      # Paged storage: the columns wanting a token (`paged_loop.step_need`) in the same sum.
      totals = _column_totals(ls.active == 1, ls.done == 1, _fork_ready(ls), wanted,
                              *((wanted > 0,) if paged else ()))
      num_active, num_done, num_forking, num_wanted = totals[0], totals[1], totals[2], totals[3]
      may_run = paged_admit.step_may_run(config, ls, totals[4]) if paged else True
      return (ok(ls) & (num_active > 0) & (num_done == 0) & (num_forking == 0)
              & (width_index(widths, ls, num_wanted) == which) & may_run)
    return lambda ls: jax.lax.while_loop(
        cond, lambda ls: _step(config, model, widths, which, ls, greedy), ls)

  def columns(ls):
    """Retire, admit and fork (column storage: admission reserves prompt + max_tokens)."""
    ls = jax.lax.while_loop(lambda ls: jnp.any(ls.done == 1) & (ls.status == Status.OK),
                            lambda ls: _retire_one(config, ls), ls)
    ls = jax.lax.while_loop(lambda ls: _can_admit(config, ls),
                            lambda ls: _admit_one(config, ls), ls)
    return jax.lax.while_loop(lambda ls: jnp.any(_fork_ready(ls)) & (ls.status == Status.OK),
                              lambda ls: _fork_one(config, ls), ls)

  def body(ls):
    if paged:   # claims, preemption and the prefix cache (paged_loop.py)
      ls = paged_admit.outer_body(config, ls, admit_one=_admit_one, fork_one=_fork_one,
                                  fork_ready=_fork_ready)
    else:
      ls = columns(ls)
    for which in range(len(widths)):
      ls = phase(which)(ls)
    return ls

  def cond(ls):
    return ok(ls) & (jnp.any(ls.done == 1) | jnp.any(ls.active == 1) | can_admit(ls))

  ls = jax.lax.while_loop(cond, body, ls)
  # Columns that finished on the budget's last step retire now, not at the next entry: an
  # engine with nothing left to serve then holds no K/V and no reserved room.
  retire = (lambda ls: paged_admit.retire_one(config, ls)) if paged else (
      lambda ls: _retire_one(config, ls))
  return jax.lax.while_loop(lambda ls: jnp.any(ls.done == 1) & (ls.status == Status.OK),
                            retire, ls)
