"""The serving loop's per-column helpers, shared by both storages' admission.

`loop.serve_loop` (column storage) and `paged_admission` (paged storage) both admit
a queued request into a column (`admit_one`) and fork a prefilled prompt into
its sibling samples (`fork_ready`, `fork_one`) with these; the paged block adds
its claims, stamps and prefix bookkeeping around them.

A column's loop data is one `state.Columns` record: `column` reads one, `put`
writes a whole one, `update` writes some of its fields (each a `jax.tree.map`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve.state import ColumnParams, Columns, LoopState, Queue, merge_status


def i32(x):
  return jnp.asarray(x, jnp.int32)


# ----------------------------------------------------------------------------- records


def column(cols: Columns, col) -> Columns:
  """Column `col`'s record: every leaf of `cols` at `col`."""
  return jax.tree.map(lambda a: a[col], cols)


def put(cols: Columns, col, record: Columns) -> Columns:
  """`cols` with `record` written at column `col` (dropped where `col` is out of range)."""
  return jax.tree.map(lambda a, v: a.at[col].set(v, mode="drop"), cols, record)


def update(cols: Columns, col, did=None, **values) -> Columns:
  """`cols` with `values` (some fields of one column; `params` a `ColumnParams` record)
  written at column `col`: only where `did` when given, dropped where `col` is out of range."""
  def write(a, v):
    return a.at[col].set(v if did is None else jnp.where(did, v, a[col]), mode="drop")
  return dataclasses.replace(
      cols, **{name: jax.tree.map(write, getattr(cols, name), v) for name, v in values.items()})


# ----------------------------------------------------------------------------- requests


def head_slot(q: Queue):
  """`(waiting, slot)`: whether a request waits in `q`, and the slot of the next one.

  The queue is a ring: `next` and `count` only grow (requests admitted, requests
  ever enqueued; int32 arithmetic wraps, and `Q` is a power of two, so the slot
  `next % Q` and the difference stay right), so the incremental API appends a
  request without rewriting the others (`live_ops.enqueue`).
  """
  return q.count - q.next > 0, q.next % q.prompt_len.shape[0]


def head_needs(q: Queue):
  """`(waiting, columns, rows)`: whether a request waits, the columns and the reserved
  positions its next admission takes."""
  waiting, i = head_slot(q)
  n, plen = q.n[i], q.prompt_len[i]
  per_sample = plen + q.max_tokens[i] - 1
  fork = (n > 1) & (plen > 1)
  cols = jnp.where(fork, n, 1)   # a forking request holds its siblings' columns from the start
  rows = jnp.where(fork, n * per_sample, per_sample)
  return waiting, cols, rows


def admit_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Admits the queue's next column: a new sequence with the request's prompt and parameters."""
  q = ls.queue
  _, i = head_slot(q)
  _, _, rows = head_needs(q)
  n, plen = q.n[i], q.prompt_len[i]
  fork = (n > 1) & (plen > 1)
  cache, status, seq_id = pure.seq_new(config, ls.cache)
  ok = status == Status.OK
  col = jnp.where(ok, seq_id, config.max_seqs)   # out of range: every write below is dropped
  max_len = ls.cols.tokens.shape[1]
  sample_index = jnp.where(fork, 0, q.copies)
  # The output rows this admission starts: all n of a forking request, else this copy's one.
  first_row = q.out_base[i] + sample_index
  out_rows = jnp.arange(ls.out.admitted.shape[0], dtype=jnp.int32)
  admitted = ok & (out_rows >= first_row) & (out_rows < first_row + jnp.where(fork, n, 1))
  cols = update(
      ls.cols, col, tokens=q.prompt[i], prompt_len=plen, length=plen, fed=0,
      hold=jnp.where(fork, plen - 1, max_len), forks=jnp.where(fork, n - 1, 0),
      limit=plen + q.max_tokens[i], used=1, active=1, done=0, reserve=rows, out_row=first_row,
      sample_index=sample_index, lp_row=q.lp_base[i] + sample_index,
      params=ColumnParams.of_request(q, i), grammar=q.grammar[i], grammar_token=-1,
      draft=0)
  o = ls.out
  out = dataclasses.replace(o, admitted=jnp.where(admitted, ls.steps, o.admitted),
                            draft_tokens=jnp.where(admitted, 0, o.draft_tokens),
                            accepted_tokens=jnp.where(admitted, 0, o.accepted_tokens),
                            draft_rounds=jnp.where(admitted, 0, o.draft_rounds))
  # A forking request is one admission; otherwise each of its n samples is one.
  copies = jnp.where(ok, q.copies + 1, q.copies)
  finished_request = ok & (fork | (copies >= n))
  queue = dataclasses.replace(q, next=jnp.where(finished_request, q.next + 1, q.next),
                              copies=jnp.where(finished_request, 0, copies))
  return dataclasses.replace(ls, cache=cache, queue=queue, cols=cols, out=out,
                             status=merge_status(ls.status, status))


def fork_ready(cols: Columns):
  """`bool[S]`: columns whose prompt (but its last token) is in the cache and that still fork."""
  return (cols.active == 1) & (cols.forks > 0) & (cols.fed >= cols.hold)


def fork_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Clones the first fork-ready column into its next sibling sample."""
  c = ls.cols
  src = jnp.argmax(fork_ready(c)).astype(jnp.int32)
  cache, status, seq_id = pure.seq_clone(config, ls.cache, src, pure.WHOLE)
  ok = status == Status.OK
  col = jnp.where(ok, seq_id, config.max_seqs)
  n_left = c.forks[src]
  per_sample = c.limit[src] - 1
  max_len = c.tokens.shape[1]
  # The sibling is its source's copy but for its sample (siblings get n-1, n-2, ..., 1)
  # and its own reservation; it forks no further.
  sibling = dataclasses.replace(
      column(c, src), sample_index=c.sample_index[src] + n_left, lp_row=c.lp_row[src] + n_left,
      out_row=c.out_row[src] + n_left, hold=max_len, forks=0, reserve=per_sample)
  forks_left = jnp.where(ok, n_left - 1, n_left)
  cols = update(put(c, col, sibling), src, hold=jnp.where(forks_left == 0, max_len, c.hold[src]),
                forks=forks_left, reserve=c.reserve[src] + jnp.where(ok, -per_sample, 0))
  return dataclasses.replace(ls, cache=cache, cols=cols, status=merge_status(ls.status, status))
