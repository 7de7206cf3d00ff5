"""Admission, retirement and forks of the serving loop over paged storage (see `paged_claims`).

`outer_body` replaces the column loop's retire / admit / fork block when
`config.page_size` is set. It wraps the per-request helpers the column loop
uses too (`columns.admit_one`, `columns.fork_one`, `columns.fork_ready`), so the
request bookkeeping stays in one place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve import columns
from jaxkv.serve import paged_claims as pl
from jaxkv.serve.columns import update
from jaxkv.serve.state import LoopState, merge_status

_BIG = 2**31 - 1


# ----------------------------------------------------------------------------- the head


def _head(config: CacheConfig, ls: LoopState):
  """The next admission: the oldest parked column, else the queue's head.

  Returns:
    `(waiting, is_parked, parked column, columns taken, claim, hashes, tokens, cap pages)`.
  """
  c = ls.cols
  parked = c.parked == 1
  any_parked = jnp.any(parked)
  p = jnp.argmin(jnp.where(parked, c.stamp, _BIG)).astype(jnp.int32)
  q = ls.queue
  queued, i = columns.head_slot(q)
  n, plen = q.n[i], q.prompt_len[i]
  fork = (n > 1) & (plen > 1)
  waiting = any_parked | queued
  cols = jnp.where(any_parked, 0, jnp.where(fork, n, 1))
  claim = jnp.where(any_parked, c.length[p] * (1 + c.forks[p]), jnp.where(fork, n * plen, plen))
  num_hash = c.page_hash.shape[1]
  tokens = jnp.where(any_parked, c.tokens[p], q.prompt[i])
  hashes, cap = c.page_hash[p], jnp.int32(0)
  if num_hash:
    hashes = jnp.where(any_parked, hashes, pl.page_hashes(q.prompt[i], num_hash, config.page_size))
    cap = jnp.where(any_parked, pl.cap_pages(config, c.prompt_len[p], c.length[p], num_hash),
                    pl.cap_pages(config, plen, plen, num_hash))
  return waiting, any_parked, p, cols, claim, hashes, tokens, cap


def _admission(config: CacheConfig, ls: LoopState):
  """`(admit now, evict first, wait)` for the head.

  It fits when the claims of running columns, one more token for each of them
  (the watermark), its own claim and the retained prefixes fit `capacity`; it
  fits after eviction when they would without the retained prefixes. A head
  that shares pages a running column is still prefilling waits for them.
  """
  waiting, any_parked, p, cols, claim, hashes, tokens, cap = _head(config, ls)
  c = ls.cols
  watermark = (pl.running(c) & (c.active == 1)).sum(dtype=jnp.int32)
  base = pl.claims(ls) - pl.prefix_positions(ls) + watermark + claim
  prefixes = pl.prefix_positions(ls)
  cols_ok = c.used.sum() + c.forks.sum() + cols <= config.max_seqs
  wait = jnp.asarray([-1, 0], jnp.int32)
  if pl.has_prefix_cache(ls):
    _, _, wait = pl.best_source(config, ls, hashes, tokens, cap, jnp.where(any_parked, p, -1))
  has_id, _ = pl.lowest_free_id(ls)
  open_ = waiting & cols_ok & (ls.status == Status.OK) & (wait[0] < 0)
  now = open_ & (base + prefixes <= config.capacity) & has_id
  evict = open_ & ~now & (base <= config.capacity) & jnp.any(c.cached == 1)
  return now, evict, jnp.where(waiting, wait, jnp.asarray([-1, 0], jnp.int32))


def can_admit(config: CacheConfig, ls: LoopState):
  """Whether the admission block would admit or evict for the head."""
  now, evict, _ = _admission(config, ls)
  return now | evict


def _readmit_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Brings the oldest parked column back: a new sequence, its tokens to be recomputed."""
  p = jnp.argmin(jnp.where(ls.cols.parked == 1, ls.cols.stamp, _BIG)).astype(jnp.int32)
  cache, status, new_id = pure.seq_new(config, ls.cache)
  ok = status == Status.OK
  ls = dataclasses.replace(ls, cache=cache, status=merge_status(ls.status, status))
  col = jnp.where(ok, new_id, p)
  ls = pl.swap(ls, p, col)
  ls = dataclasses.replace(ls, cols=update(ls.cols, col, ok, active=1, fed=0))
  ls = pl.stamped(ls, col, ok)
  return pl.adopt(config, ls, col, ok) if pl.has_prefix_cache(ls) else ls


def _admit_queued(config: CacheConfig, ls: LoopState) -> LoopState:
  """`columns.admit_one` (the column loop's), then the paged bookkeeping of the new column."""
  _, col = pl.lowest_free_id(ls)
  before = ls.cache.live[col]
  ls = columns.admit_one(config, ls)
  did = (ls.cache.live[col] == 1) & (before == 0)
  ls = pl.stamped(ls, col, did)
  if not pl.has_prefix_cache(ls):
    return ls
  ls = pl.hash_column(config, ls, col, did)
  return pl.adopt(config, ls, col, did)


def admit_queued(config: CacheConfig, ls: LoopState):
  """Admits queued requests while the head fits and none is parked (the common admissions).

  The admission rule is computed once per state, in the loop's carry (before the
  loop, then after each admission), so the loop's check reads a flag and nothing
  recomputes the rule afterwards.

  Returns:
    `(ls, rest)`: the loop state (`adopt_wait` set) and whether an eviction or a
    parked column's return is now due (`admit_rest`).
  """
  def rule(ls):
    now, evict, wait = _admission(config, ls)
    parked = jnp.any(ls.cols.parked == 1)
    return now & ~parked, evict | (now & parked), wait

  def body(carry):
    ls = _admit_queued(config, carry[0])
    return (ls, *rule(ls))

  ls, _, rest, wait = jax.lax.while_loop(lambda carry: carry[1], body, (ls, *rule(ls)))
  return dataclasses.replace(ls, adopt_wait=wait), rest


def admit_rest(config: CacheConfig, ls: LoopState, rest) -> LoopState:
  """The rest of the admissions after `admit_queued`: evictions and parked columns first.

  Each state allows at most one admission action: evict (`evict`), bring a parked
  column back (`now` with one parked) or admit the queue's head (`now` with none
  parked); `_admission` makes `now` and `evict` exclusive. So loops that act only
  where their action is allowed and stop only where none is take the same actions
  in the same order as one loop around the three. Past `admit_queued` the first
  two are the only ones left to start (`rest`, its flag), and rarely any is (a
  preemption, retained prefixes in the way): `finish_block` runs this inside its
  loop, whose check folds in `rest`.
  """
  now = lambda ls: _admission(config, ls)[0]
  evict = lambda ls: _admission(config, ls)[1]
  any_parked = lambda ls: jnp.any(ls.cols.parked == 1)

  def body(carry):
    ls = jax.lax.while_loop(evict, lambda ls: pl.evict_one(config, ls), carry[0])
    ls = jax.lax.while_loop(lambda ls: now(ls) & any_parked(ls),
                            lambda ls: _readmit_one(config, ls), ls)
    return admit_queued(config, ls)

  return jax.lax.while_loop(lambda carry: carry[1], body, (ls, rest))[0]


# ----------------------------------------------------------------------------- retirement


def retire_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Retires the first finished column: kept as a retained prefix, or removed.

  With prefix caching, a column whose full prompt pages no other live column
  holds is rewound to them and kept (`cached = 1`, `used = 0`).
  """
  c = ls.cols
  col = jnp.argmax(c.done == 1).astype(jnp.int32)
  p = config.page_size
  keep = jnp.bool_(False)
  # Without prefix caching nothing is kept, so no rewind is traced: even a refused one
  # runs its static page copy (a no-op) on every pool.
  if pl.has_prefix_cache(ls):
    aligned = jnp.minimum(c.prompt_len[col], ls.cache.pos[col]) // p * p
    pages = jnp.minimum(aligned // p, c.page_hash.shape[1])
    aligned = pages * p
    held, _, _ = pl.best_source(config, ls, c.page_hash[col], c.tokens[col], pages, col)
    keep = (aligned > 0) & (aligned >= pure.floor(config, ls.cache, col)) & (held < aligned)
    # A page multiple: the rewind never ends inside a page, so it never copies one.
    cache, status = pure.rewind(config, ls.cache, jnp.where(keep, col, -1), aligned)
    ls = dataclasses.replace(ls, cache=cache, status=merge_status(ls.status, status, keep))
  cache, status = pl.remove(config, ls, col, ~keep)
  ok = status == Status.OK
  cols = update(c, col, done=0, used=0, reserve=0, cached=jnp.where(keep & ok, 1, 0),
                last_use=ls.clock)
  return dataclasses.replace(ls, cache=cache, status=status, cols=cols, clock=ls.clock + 1)


# ----------------------------------------------------------------------------- forks


def finish_block(config: CacheConfig, ls: LoopState, rest) -> LoopState:
  """After `admit_queued`: the rare admissions, the forks, then room for the next step.

  One loop (`rest | ready | room`), so an outer iteration with none of them due
  evaluates one predicate where three loops in a row would evaluate three. The
  actions run in the order of those three loops:
  - the rare admissions (`admit_rest`), on the loop's first trip only and only if
    due when it starts (`rest`, from `admit_queued`, in the carry): forks and
    preemptions below may allow one again (a preempted column may come back),
    which in the order kept here waits for the next outer iteration;
  - while a fork is ready: free room for it, evict for a spare column, swap parked
    data up, fork (each allowed only where the ones before it are not, and none
    makes an earlier one allowed but a fork, after which the next trip starts over);
  - once none is ready (nothing here makes one ready again): free room for the
    step (`paged_claims.needs_room`).
  """
  ready = lambda ls: jnp.any(columns.fork_ready(ls.cols)) & (ls.status == Status.OK)
  src = lambda ls: jnp.argmax(columns.fork_ready(ls.cols)).astype(jnp.int32)
  fits = lambda ls: ls.cache.held + ls.cache.pos[src(ls)] <= config.capacity
  room = lambda ls: pl.needs_room(config, ls)

  def parked_lowest(ls):
    exists, low = pl.lowest_free_id(ls)
    return exists & (ls.cols.parked[low] == 1)

  def swap_up(ls):
    _, low = pl.lowest_free_id(ls)
    return pl.swap(ls, low, pl.spare(ls)[1])

  def fork_paged(ls):
    """`columns.fork_one` (its sibling copies the source's page hashes), then the stamp."""
    _, dst = pl.lowest_free_id(ls)
    before = ls.cache.live[dst]
    ls = columns.fork_one(config, ls)
    return pl.stamped(ls, dst, (ls.cache.live[dst] == 1) & (before == 0))

  def cond(carry):
    ls, rest = carry
    return rest | ready(ls) | room(ls)

  def body(carry):
    ls, rest = carry
    ls = admit_rest(config, ls, rest)
    ls = jax.lax.while_loop(lambda ls: ready(ls) & ~fits(ls) & pl.can_free(ls),
                            lambda ls: pl.free_one(config, ls), ls)
    ls = jax.lax.while_loop(lambda ls: ready(ls) & ~pl.spare(ls)[0] & jnp.any(ls.cols.cached == 1),
                            lambda ls: pl.evict_one(config, ls), ls)
    ls = jax.lax.while_loop(lambda ls: ready(ls) & parked_lowest(ls) & pl.spare(ls)[0],
                            swap_up, ls)
    can = lambda ls: ready(ls) & fits(ls) & ~parked_lowest(ls) & pl.spare(ls)[0]
    ls = jax.lax.while_loop(can, fork_paged, ls)
    ls = jax.lax.while_loop(lambda ls: ~ready(ls) & room(ls),
                            lambda ls: pl.free_one(config, ls), ls)
    return ls, jnp.bool_(False)

  return jax.lax.while_loop(cond, body, (ls, rest))[0]


def outer_body(config: CacheConfig, ls: LoopState) -> LoopState:
  """Retire, admit, fork, then make room for the next step (the paged outer loop's block).

  On the common path (nothing to evict, park or fork) that is as many loop
  predicates as the column block: retire (`r + 1` for `r` finished columns), admit
  (`k + 1` for `k` admitted requests), the rest (1). On a GPU each predicate is a
  device-to-host read and a host decision.
  """
  ls = jax.lax.while_loop(lambda ls: jnp.any(ls.cols.done == 1) & (ls.status == Status.OK),
                          lambda ls: retire_one(config, ls), ls)
  ls, rest = admit_queued(config, ls)
  return finish_block(config, ls, rest)


def step_may_run(config: CacheConfig, ls: LoopState, need=None):
  """The phase loops' extra condition: the step fits, and no waiting head can now adopt.

  `need`: `paged_claims.step_need(ls.cols)`, when the caller has it.
  """
  w_col, w_len = ls.adopt_wait[0], ls.adopt_wait[1]
  c = ls.cols
  col = jnp.clip(w_col, 0, c.fed.shape[0] - 1)
  resumed = (w_col >= 0) & ((c.fed[col] >= w_len) | (c.active[col] == 0))
  return pl.step_fits(config, ls, need) & ~resumed
