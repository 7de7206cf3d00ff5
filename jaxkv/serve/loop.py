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
`paged_admission.outer_body` instead: admission by claims, preemption of the latest
admitted sequence when a step would pass `capacity`, and the prefix cache
(`paged_claims.py`); the step loops also stop when the next step does not fit.

No width is chosen by recompiling and no `lax.cond` wraps the model, so a
decode-only step pays for `w` rows, not `W`. The loop returns to the host
only when the queue is served, the step budget is spent, or a status is not OK.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve import columns, paged_admission, paged_claims
from jaxkv.serve.columns import i32
from jaxkv.serve.sampling import RowParams, greedy_rows, sample_rows
from jaxkv.serve.speculative import (SpeculativeConfig, accepted, pause_after, propose,
                                     speculates)
from jaxkv.serve.state import ColumnParams, Columns, LoopState, merge_status
from pallas_kernels.common import prefix_sum


def _first_bad(*statuses):
  out = i32(Status.OK)
  for st in reversed(statuses):
    out = jnp.where(st != Status.OK, st, out)
  return out


def _wanted(cols: Columns):
  """`int32[S]` tokens each column could feed now (prompt remainder, or its next token and
  its draft)."""
  return jnp.where(cols.active == 1,
                   jnp.maximum(jnp.minimum(cols.length + cols.draft, cols.hold) - cols.fed, 0), 0)


def _column_totals(*per_column):
  """`int32[k]`: the sums over the columns of `k` per-column `[S]` values, as one reduction.

  The step and its loop condition each need several such sums; XLA runs a
  reduction per `sum` (a GPU kernel each), and one per stacked array.
  """
  return jnp.stack([i32(v) for v in per_column]).sum(axis=1, dtype=jnp.int32)


def width_index(widths: tuple[int, ...], cols: Columns, total=None):
  """Index of the narrowest width that holds every wanted token (widest when none does).

  `total`: the wanted tokens' sum (`_wanted(cols).sum()`), when the caller has it.
  """
  total = _wanted(cols).sum() if total is None else total
  index = i32(0)
  for i, w in enumerate(widths[1:], start=1):   # widths are descending
    index = jnp.where(total <= w, i, index)
  return index


def _schedule(width: int, cols: Columns, room=None):
  """Tokens per column this step: one per wanting column first, then prefill chunks.

  With `room` (paged storage: `capacity - held`), the prefill chunks are cut so
  the step carries at most `room` tokens (the loop ensures the first ones fit).

  Returns:
    `(alloc int32[S], start int32[S])`: tokens each column carries and where
    its run starts on the step axis (columns in order, one run each).
  """
  want = _wanted(cols)
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


def _step_tokens(config: CacheConfig, width: int, cols: Columns, alloc, start, n):
  """`(seq_ids int32[W], tokens int32[width])` of the scheduled step of `n` tokens."""
  s = config.max_seqs
  idx = jnp.arange(width, dtype=jnp.int32)
  # One fused compare: the default scan is a loop of ~7 gathers, ~16 launches a step on GPU.
  col = jnp.searchsorted(start + alloc, idx, side="right", method="compare_all").astype(jnp.int32)
  is_real = idx < n
  col = jnp.where(is_real, col, s)
  safe = jnp.clip(col, 0, s - 1)
  offset = jnp.clip(cols.fed[safe] + idx - start[safe], 0, cols.tokens.shape[1] - 1)
  tokens = jnp.where(is_real, cols.tokens[safe, offset], 0)
  seq_ids = jnp.full((config.step_width,), s, jnp.int32).at[:width].set(col)
  return seq_ids, tokens


def _plan(config: CacheConfig, width: int, ls: LoopState, gated: bool):
  """A step's schedule at `width`, declared and prepared on the cache.

  Returns `(alloc, start, n, occupancy, held, held_added, tokens, cache, status)`: each
  column's tokens and first slot, the step's tokens and occupied columns, the used columns'
  positions now and those the step adds if it succeeds (`peak_rows`), the step's token ids,
  and the cache with the first failure of the two verbs. `gated`: see `_step`.
  """
  c = ls.cols
  alloc, start = _schedule(width, c, paged_claims.room(config, ls) if config.is_paged else None)
  if gated:
    run = ls.status == Status.OK
    if config.is_paged:
      run &= paged_admission.step_may_run(config, ls)
    alloc = jnp.where(run, alloc, 0)
  used = c.used == 1
  n, occupancy, held, held_added = _column_totals(
      alloc, alloc > 0, jnp.where(used, c.fed, 0), jnp.where(used, alloc, 0))
  seq_ids, tokens = _step_tokens(config, width, c, alloc, start, n)
  blocks = jnp.zeros((config.step_width, 2), jnp.int32)
  cache, st_declare = pure.declare_step(config, ls.cache, seq_ids, n, blocks)
  cache, st_prepare = pure.prepare_step(config, cache)
  return (alloc, start, n, occupancy, held, held_added, tokens, cache,
          _first_bad(st_declare, st_prepare))


def _counted(ls: LoopState, widths, which: int, gated: bool, *, cache, cols, out, ok, n,
             occupancy, held, status, **counters) -> LoopState:
  """`ls` after a step: its new cache, columns and outputs, the step counted (`gated`: only
  if it carried tokens) and its counters added, `counters` replaced as given."""
  as_int = lambda b: b.astype(jnp.int32)
  counted = ok & (n > 0) if gated else ok
  return dataclasses.replace(
      ls, cache=cache, cols=cols, out=out,
      steps=ls.steps + as_int(counted), step_tokens=ls.step_tokens + jnp.where(ok, n, 0),
      occupancy=ls.occupancy + jnp.where(ok, occupancy, 0),
      peak_rows=jnp.maximum(ls.peak_rows, held),
      # Elementwise, not `.at[which].add` (a dynamic-update-slice kernel of its own per step).
      width_steps=ls.width_steps + as_int(counted & (jnp.arange(len(widths)) == which)),
      status=merge_status(ls.status, status), **counters)


def _recorded(ls: LoopState, tokens, generated, out_at, lp_at, drawn, fin_at, is_stop, first_at,
              **more):
  """`ls.out` after a step: the new `tokens` table, each emitting column's `generated`
  count at its row `out_at`, its draw's `(logprob, top_ids, top_logprobs)` at `lp_at`
  (`(rows, slots)`), the finished rows `fin_at` (`is_stop`: by a stop token) and the
  first-token rows `first_at` stamped with the step; `more` fields replaced as given.
  Rows past the tables are dropped."""
  o = ls.out
  lp, top_ids, top_lp = drawn
  return dataclasses.replace(
      o, tokens=tokens,
      length=o.length.at[out_at].set(generated, mode="drop"),   # so far
      logprob=o.logprob.at[lp_at].set(lp, mode="drop"),
      top_ids=o.top_ids.at[lp_at].set(top_ids, mode="drop"),
      top_logprobs=o.top_logprobs.at[lp_at].set(top_lp, mode="drop"),
      stop=o.stop.at[fin_at].set(is_stop.astype(jnp.int32), mode="drop"),
      done=o.done.at[fin_at].set(1, mode="drop"),
      first=o.first.at[first_at].set(ls.steps + 1, mode="drop"),
      finished=o.finished.at[fin_at].set(ls.steps + 1, mode="drop"), **more)


def _draw(ls: LoopState, logits, emits, greedy: bool, branches: bool = True):
  """Each column's token from its logits row (`float32[S, V]`), as plain decoding draws it:
  `(tokens, logprob, top_ids, top_logprobs, grammar states, grammar tokens)`.

  `greedy` (static): no constrained column (`plain_greedy`): the argmax, no sampler.
  `branches` (static): the sampler skips unused stages with `lax.cond`s (`sample_rows`);
  False in `serve_step`, which holds no branch.
  """
  c = ls.cols
  num_logprobs = ls.out.top_ids.shape[2]
  if greedy:
    new, lp, top_ids, top_lp = greedy_rows(logits, num_logprobs)
    return new, lp, top_ids, top_lp, c.grammar, c.grammar_token
  generated = c.length - c.prompt_len
  keys = jax.vmap(lambda seed, i, t: jax.random.fold_in(
      jax.random.fold_in(jax.random.key(seed), i), t))(c.params.seed, c.sample_index, generated)
  # Before its min_tokens, a column's stop tokens are not drawn.
  banned = jnp.where((generated < c.params.min_tokens)[:, None], c.params.stop_tokens, -1)
  # A constrained column's token is consumed by its automaton at its next draw, inside the
  # sampler's logit branch: no lookup and no branch of its own on any step.
  new, lp, top_ids, top_lp, grammar = sample_rows(
      logits, _row_params(c.params), keys, sampling=emits, history=c.tokens,
      prompt_len=c.prompt_len, length=c.length, banned=banned,
      bias=(c.params.bias_tokens, c.params.bias, c.params.restrict),
      grammar=(ls.grammar, c.grammar, c.grammar_token, c.params.stop_tokens),
      num_logprobs=num_logprobs, branches=branches)
  grammar_token = jnp.where(emits & (c.grammar != -1), new,
                            jnp.where(emits, -1, c.grammar_token))
  return new, lp, top_ids, top_lp, grammar, grammar_token


def _step(config: CacheConfig, model, widths, which: int, ls: LoopState,
          greedy: bool = False, gated: bool = False,
          spec: SpeculativeConfig | None = None) -> LoopState:
  """One step at width `widths[which]`: plan, model, commit, sample, record.

  `greedy` (static): every request is plain greedy (no temperature, penalty or
  logprobs), so the token is the argmax and no sampler `lax.cond` is compiled.
  `gated` (static, `serve_step`): the step carries no token where the loop's phase
  condition would not run it (a failed status, or paged storage where the step
  does not fit or a waiting head may now adopt), and counts as a step only if it
  carried tokens, so the host sees a stall in `steps`.
  `spec` (static): speculative decoding (`_verify`): a column's draft is verified
  with its pending token and the next draft is proposed.
  """
  if spec is not None:
    return _verify(config, model, widths, which, ls, greedy, gated, spec)
  width = widths[which]
  s = config.max_seqs
  c, o = ls.cols, ls.out
  alloc, start, n, occupancy, held, held_added, tokens, cache, st_plan = _plan(
      config, width, ls, gated)
  rows = jnp.clip(start + alloc - 1, 0, width - 1)
  logits, cache, st_narrow = pure.run_narrow(config, cache, width,
                                             lambda kv: model(tokens, kv, rows=rows))
  cache, st_commit = pure.commit_step(config, cache)
  status = _first_bad(st_plan, st_narrow, st_commit)
  if gated:   # a step of no token: every verb refused it (EMPTY first) and changed nothing
    status = jnp.where(n > 0, status, Status.OK)
  ok = status == Status.OK

  emits = ok & (alloc > 0) & (c.fed + alloc == c.length)
  generated = c.length - c.prompt_len
  new, lp, top_ids, top_lp, grammar, grammar_token = _draw(ls, logits, emits, greedy,
                                                           branches=not gated)
  col_ids = jnp.arange(s, dtype=jnp.int32)
  max_len = c.tokens.shape[1]
  tokens_buf = c.tokens.at[col_ids, jnp.where(emits, c.length, max_len)].set(new, mode="drop")
  rows_out, max_new = o.tokens.shape
  out_at = jnp.where(emits, c.out_row, rows_out)
  out_tokens = o.tokens.at[out_at, jnp.minimum(generated, max_new - 1)].set(new, mode="drop")
  lp_rows, window = o.logprob.shape
  lp_at, lp_t = jnp.where(emits & (c.params.logprobs >= 0), c.lp_row, lp_rows), generated % window
  length = c.length + emits.astype(jnp.int32)
  is_stop = jnp.any(c.params.stop_tokens == new[:, None], axis=1)
  finished = emits & (is_stop | (length >= c.limit))
  fin_at = jnp.where(finished, c.out_row, rows_out)
  first_at = jnp.where(emits & (generated == 0), c.out_row, rows_out)   # latency bookkeeping
  fed = jnp.where(ok, c.fed + alloc, c.fed)
  as_int = lambda b: b.astype(jnp.int32)
  held = held + jnp.where(ok, held_added, 0)
  cols = dataclasses.replace(c, tokens=tokens_buf, length=length, fed=fed,
                             active=jnp.where(finished, 0, c.active),
                             done=c.done | as_int(finished), grammar=grammar,
                             grammar_token=grammar_token)
  out = _recorded(ls, out_tokens, length - c.prompt_len, out_at, (lp_at, lp_t),
                  (lp, top_ids, top_lp), fin_at, is_stop, first_at)
  return _counted(ls, widths, which, gated, cache=cache, cols=cols, out=out, ok=ok, n=n,
                  occupancy=occupancy, held=held, status=status)


def _verify(config: CacheConfig, model, widths, which: int, ls: LoopState, greedy: bool,
            gated: bool, spec: SpeculativeConfig) -> LoopState:
  """`_step` with speculative decoding (docs/DESIGN.md, "Speculative decoding").

  A column whose step reaches its pending token carries the draft behind it (`nd`
  tokens, `Columns.draft`, as scheduled); the model returns `k + 1` rows per column,
  its pending token's and its draft's. The pending row's token is drawn as `_step`
  draws it; the draft's longest prefix equal to the argmax of the rows before it is
  accepted, and the tokens are emitted one by one as plain decoding would have:
  each checked for a stop token and the limit, the first that finishes ending the
  column. The rejected tail is rolled back (`pure.rewind_many`), and each column
  that emitted and goes on proposes its next draft (`speculative.propose`).
  """
  width, k = widths[which], spec.k
  s = config.max_seqs
  c, o = ls.cols, ls.out
  alloc, start, n, occupancy, held, held_added, tokens, cache, st_plan = _plan(
      config, width, ls, gated)
  # The draft tokens each column carries (the schedule may cut a draft short), and the
  # step rows of its pending token and of its draft: `k + 1` rows a column.
  drafted = jnp.clip(c.fed + alloc - c.length, 0, k)
  first_row = start + alloc - 1 - drafted
  j = jnp.arange(k + 1, dtype=jnp.int32)
  rows = jnp.clip(first_row[:, None] + j[None, :], 0, width - 1)
  if width < s * (k + 1):
    # Fewer step rows than columns' rows: the LM head runs on each step row once (a
    # paused or lightly drafted step pays its width, not `k + 1` rows a column).
    logits, cache, st_narrow = pure.run_narrow(
        config, cache, width, lambda kv: model(tokens, kv, rows=jnp.arange(width)))
    pending = logits[rows[:, 0]]
    after = jnp.argmax(logits, axis=-1).astype(jnp.int32)[rows[:, 1:]]
  else:
    logits, cache, st_narrow = pure.run_narrow(
        config, cache, width, lambda kv: model(tokens, kv, rows=rows.reshape(-1)))
    logits = logits.reshape(s, k + 1, -1)
    pending = logits[:, 0]
    after = jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)
  cache, st_commit = pure.commit_step(config, cache)
  status = _first_bad(st_plan, st_narrow, st_commit)
  if gated:
    status = jnp.where(n > 0, status, Status.OK)
  ok = status == Status.OK

  emits = ok & (alloc > 0) & (c.fed + alloc >= c.length)
  generated = c.length - c.prompt_len
  new, lp, top_ids, top_lp, grammar, grammar_token = _draw(ls, pending, emits, greedy,
                                                           branches=not gated)
  # Candidates: the pending row's token, then the argmax after each draft token (only
  # drafting columns, which are plain greedy, get past the first).
  col_ids = jnp.arange(s, dtype=jnp.int32)
  max_len = c.tokens.shape[1]
  cand = jnp.concatenate([new[:, None], after], axis=1)
  draft = jnp.take_along_axis(c.tokens, jnp.clip(c.length[:, None] + j[None, :k], 0,
                                                 max_len - 1), axis=1)
  took = accepted(draft, drafted, cand[:, :k])
  # Each candidate as plain decoding would have emitted it: the first stop token or the
  # limit ends the column, and nothing after it is emitted.
  length_j = c.length[:, None] + j[None, :] + 1
  stop_j = jnp.any(c.params.stop_tokens[:, None, :] == cand[:, :, None], axis=2)
  ends_j = stop_j | (length_j >= c.limit[:, None])
  ended_before = (jnp.cumsum(ends_j, axis=1, dtype=jnp.int32) - ends_j.astype(jnp.int32)) > 0
  emit_j = emits[:, None] & (j[None, :] <= took[:, None]) & ~ended_before
  count = emit_j.sum(axis=1, dtype=jnp.int32)
  finished = jnp.any(emit_j & ends_j, axis=1)
  last = jnp.clip(count - 1, 0, k)[:, None]
  is_stop = jnp.take_along_axis(stop_j, last, axis=1)[:, 0]
  tokens_buf = c.tokens.at[col_ids[:, None], jnp.where(emit_j, length_j - 1, max_len)].set(
      cand, mode="drop")
  rows_out, max_new = o.tokens.shape
  out_tokens = o.tokens.at[jnp.where(emit_j, c.out_row[:, None], rows_out),
                           jnp.minimum(generated[:, None] + j[None, :], max_new - 1)].set(
                               cand, mode="drop")
  out_at = jnp.where(emits, c.out_row, rows_out)
  lp_rows, window = o.logprob.shape
  lp_at, lp_t = jnp.where(emits & (c.params.logprobs >= 0), c.lp_row, lp_rows), generated % window
  length = c.length + count
  fin_at = jnp.where(finished, c.out_row, rows_out)
  first_at = jnp.where(emits & (generated == 0), c.out_row, rows_out)
  verified = jnp.where(emits, drafted, 0)
  kept = jnp.maximum(count - 1, 0)   # the emitted tokens that were draft tokens
  draft_at = jnp.where(verified > 0, c.out_row, rows_out)
  # A column that emitted keeps its pending token unfed, as after a plain step; the
  # cache keeps what was fed before it and rolls the rejected draft back.
  fed = jnp.where(ok, jnp.where(emits, length - 1, c.fed + alloc), c.fed)
  cache, st_rewind = pure.rewind_many(config, cache, jnp.where(emits, fed, cache.pos))
  status = _first_bad(status, st_rewind)
  active = jnp.where(finished, 0, c.active)
  # The next draft, of the columns that emitted and go on (the others keep theirs),
  # unless a round that accepted nothing paused drafting.
  round_drafted, round_kept = verified.sum(dtype=jnp.int32), kept.sum(dtype=jnp.int32)
  pause = pause_after(ls.draft_pause, round_drafted, round_kept, ok, spec.max_pause)
  proposal, proposed = propose(spec, tokens_buf, length)
  goes_on = emits & (active == 1) & speculates(c.params, c.grammar) & (pause[0] == 0)
  proposed = jnp.where(goes_on, jnp.clip(jnp.minimum(proposed, c.limit - length - 1), 0, k), 0)
  tokens_buf = tokens_buf.at[col_ids[:, None], jnp.where(j[None, :k] < proposed[:, None],
                                                         length[:, None] + j[None, :k], max_len)
                             ].set(proposal, mode="drop")
  as_int = lambda b: b.astype(jnp.int32)
  held = held + jnp.where(ok, held_added, 0)
  cols = dataclasses.replace(c, tokens=tokens_buf, length=length, fed=fed, active=active,
                             done=c.done | as_int(finished), grammar=grammar,
                             grammar_token=grammar_token,
                             draft=jnp.where(emits, proposed, c.draft))
  out = _recorded(
      ls, out_tokens, length - c.prompt_len, out_at, (lp_at, lp_t), (lp, top_ids, top_lp),
      fin_at, is_stop, first_at,
      draft_tokens=o.draft_tokens.at[draft_at].add(verified, mode="drop"),
      accepted_tokens=o.accepted_tokens.at[draft_at].add(kept, mode="drop"),
      draft_rounds=o.draft_rounds.at[draft_at].add(1, mode="drop"))
  return _counted(ls, widths, which, gated, cache=cache, cols=cols, out=out, ok=ok, n=n,
                  occupancy=occupancy, held=held, status=status,
                  draft_tokens=ls.draft_tokens + round_drafted,
                  accepted_tokens=ls.accepted_tokens + round_kept, draft_pause=pause)


def _row_params(p: ColumnParams) -> RowParams:
  """The sampler's parameters: the `ColumnParams` fields of the same names."""
  return RowParams(**{f.name: getattr(p, f.name) for f in dataclasses.fields(RowParams)})


# ----------------------------------------------------------------------------- columns


def _can_admit(config: CacheConfig, ls: LoopState):
  waiting, cols, rows = columns.head_needs(ls.queue)
  cols_held = ls.cols.used.sum() + ls.cols.forks.sum()
  return (waiting & (cols_held + cols <= config.max_seqs)
          & (ls.cols.reserve.sum() + rows <= config.capacity) & (ls.status == Status.OK))


def _retire_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Removes the first finished column's sequence and frees its reservation."""
  col = jnp.argmax(ls.cols.done == 1).astype(jnp.int32)
  cache, status = pure.seq_rm(config, ls.cache, col)
  ok = status == Status.OK
  return dataclasses.replace(
      ls, cache=cache,
      cols=columns.update(ls.cols, col, done=jnp.where(ok, 0, 1),
                          used=jnp.where(ok, 0, ls.cols.used[col]),
                          reserve=jnp.where(ok, 0, ls.cols.reserve[col])),
      status=merge_status(ls.status, status))


def _column_block(config: CacheConfig, ls: LoopState) -> LoopState:
  """Retire, admit and fork (column storage: admission reserves prompt + max_tokens)."""
  ls = jax.lax.while_loop(lambda ls: jnp.any(ls.cols.done == 1) & (ls.status == Status.OK),
                          lambda ls: _retire_one(config, ls), ls)
  ls = jax.lax.while_loop(lambda ls: _can_admit(config, ls),
                          lambda ls: columns.admit_one(config, ls), ls)
  return jax.lax.while_loop(
      lambda ls: jnp.any(columns.fork_ready(ls.cols)) & (ls.status == Status.OK),
      lambda ls: columns.fork_one(config, ls), ls)


def admit_block(config: CacheConfig, ls: LoopState) -> LoopState:
  """The outer loop's block before its steps: retire, admit, fork (and, paged, make room)."""
  if config.is_paged:   # claims, preemption and the prefix cache (paged_claims.py)
    return paged_admission.outer_body(config, ls)
  return _column_block(config, ls)


# ----------------------------------------------------------------------------- the loop


def serve_loop(graphdef, config: CacheConfig, widths: tuple[int, ...], params, ls: LoopState,
               max_steps, *, greedy: bool = False, speculative: SpeculativeConfig | None = None):
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
    speculative: (static) draft and verify several tokens a step for the columns
      that may (`speculative.SpeculativeConfig`); the tokens are the same.

  Returns:
    The new `LoopState`.
  """
  from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
  model = merge_model(graphdef, params)
  first_step = ls.steps
  ok = lambda ls: (ls.status == Status.OK) & (ls.steps - first_step < max_steps)

  paged = config.is_paged
  can_admit = (lambda ls: paged_admission.can_admit(config, ls)) if paged else (
      lambda ls: _can_admit(config, ls))

  def phase(which):
    def cond(ls):
      c = ls.cols
      wanted = _wanted(c)
      # Paged storage: the columns wanting a token (`paged_claims.step_need`) in the same sum.
      totals = _column_totals(c.active == 1, c.done == 1, columns.fork_ready(c), wanted,
                              *((wanted > 0,) if paged else ()))
      num_active, num_done, num_forking, num_wanted = totals[0], totals[1], totals[2], totals[3]
      may_run = paged_admission.step_may_run(config, ls, totals[4]) if paged else True
      return (ok(ls) & (num_active > 0) & (num_done == 0) & (num_forking == 0)
              & (width_index(widths, c, num_wanted) == which) & may_run)
    return lambda ls: jax.lax.while_loop(
        cond, lambda ls: _step(config, model, widths, which, ls, greedy, spec=speculative), ls)

  def body(ls):
    ls = admit_block(config, ls)
    for which in range(len(widths)):
      ls = phase(which)(ls)
    return ls

  def cond(ls):
    return ok(ls) & (jnp.any(ls.cols.done == 1) | jnp.any(ls.cols.active == 1) | can_admit(ls))

  ls = jax.lax.while_loop(cond, body, ls)
  # Columns that finished on the budget's last step retire now, not at the next entry: an
  # engine with nothing left to serve then holds no K/V and no reserved room.
  retire = (lambda ls: paged_admission.retire_one(config, ls)) if paged else (
      lambda ls: _retire_one(config, ls))
  return jax.lax.while_loop(lambda ls: jnp.any(ls.cols.done == 1) & (ls.status == Status.OK),
                            retire, ls)


# ----------------------------------------------------------------------------- stepping


def serve_step(graphdef, config: CacheConfig, widths: tuple[int, ...], which: int, params,
               ls: LoopState, *, greedy: bool = True,
               speculative: SpeculativeConfig | None = None) -> LoopState:
  """One step at width `widths[which]` (static), with no loop and no branch around it.

  On a GPU a jitted program holding a `while` or a `cond` returns to the host only
  when the device has run it (each predicate is read back), so the host cannot
  queue the next program meanwhile. This one holds neither, so the host dispatches
  steps ahead of the device and reads each one back later. `greedy` (static): every
  request in flight is plain greedy (the argmax, no sampler); otherwise the draw alone,
  with no branch (`sample_rows(branches=False)`), which gives the loop sampler's tokens to
  the requests `admission.plain_sampled` admits (the driver runs loop entries for others). It
  runs what the loop's phases would: the tokens `_schedule` picks at this width
  (more are left for later steps, a wider width than needed costs rows), nothing
  where the loop would not step (a failed status; paged storage: the step does
  not fit, or a waiting head may now adopt), and counts a step only when it
  carried tokens. Retirements, admissions, forks and preemptions are
  `admit_block`'s, which the host runs alone when one is due (its loops read
  their predicates back, so the host waits for it).

  Jit it with `graphdef`, `config`, `widths` and `which` static and `ls` donated
  (`speculative` too: drafts are verified as in the loop, still with no branch).

  Returns:
    `(ls, steps)`: the new state, and its step counter apart from it (the state is
    donated to the next program; the host waits on this one to pace itself).
  """
  from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
  ls = _step(config, merge_model(graphdef, params), widths, which, ls, greedy=greedy, gated=True,
             spec=speculative)
  return ls, ls.steps
