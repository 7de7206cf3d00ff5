"""The serving loop's admission, preemption and prefix cache over paged storage (issue 13).

With `CacheConfig.page_size` set, `loop.serve_loop` calls these instead of the
column admission. Everything is jitted inside the loop; nothing visits the host.

- **Claims, not reservations.** A running column claims the positions it will
  hold once its known tokens are fed (`length`, times `1 + forks` for a prompt
  still to be forked); a retained prefix claims its `pos`. A request is
  admitted while the cache's `capacity` minus the claims covers its prompt
  (`n` copies for a forking one) plus a watermark of one token per running
  column, not prompt + `max_tokens` up front. The pool holds
  `ceil(capacity / P) + max_seqs + 1` pages, so free pages cover every claim.
- **Preemption.** Decoding grows the claims; when the next step (one token for
  every column that wants one) or a fork would pass `capacity`, retained
  prefixes are evicted (least recently used first), then the most recently
  admitted running column is preempted: `seq_rm` drops its pages and the column
  is parked with its tokens (prompt + generated). Parked columns come back
  before any queued request (oldest first) and recompute their tokens as one
  longer prefill; the sampling key depends only on (seed, sample index, token
  index), so the tokens are the unpreempted run's.
- **Prefix cache** (`Columns.page_hash` non-empty). Each column keeps the
  chained hash of its full prompt pages (`page_hashes`). A column admitted (or
  brought back) adopts the longest matching leading pages of a live column
  (running or retained) as `seq_clone(source, m)` (full pages are shared, none
  copied) and prefills only the rest. A match is found by hash and confirmed
  token by token, so a collision costs a miss, never a wrong page. A finished
  column whose full prompt pages no other column holds is kept as a retained
  prefix (`rewind` to those pages, `cached = 1`, `used = 0`) instead of removed.
  A queued head that would match pages a running column is still prefilling
  waits for them (`adopt_wait`), so a burst sharing a system prompt prefills it
  once.

A parked column keeps its loop slot; its cache id is free. The loop's columns
are the cache's ids, so a column taken by `seq_new`/`seq_clone` (the lowest
free id) that holds parked data first swaps loop data with a free slot (`swap`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve.columns import i32, update
from jaxkv.serve.state import Columns, LoopState, merge_status

_MIX1, _MIX2 = 0x85EBCA6B, 0xC2B2AE35
_TOKEN, _POS = 0x9E3779B1, 0x7FEB352D


def _u32(x):
  return jnp.asarray(x, jnp.uint32)


def has_prefix_cache(ls: LoopState) -> bool:
  """Whether prefix caching is on (static: the shape of `page_hash`)."""
  return ls.cols.page_hash.shape[1] > 0


def _fmix(h):
  """MurmurHash3's 32-bit finaliser (uint32 in, uint32 out; wrapping arithmetic)."""
  h = h ^ (h >> 16)
  h = h * _u32(_MIX1)
  h = h ^ (h >> 13)
  h = h * _u32(_MIX2)
  return h ^ (h >> 16)


def page_hashes(tokens, num_pages: int, page_size: int):
  """`uint32[num_pages]`: entry `j` hashes tokens `[0, (j + 1) * page_size)`.

  Each token is mixed with its position, the mixes are summed (a prefix sum,
  so all pages hash in parallel) and the sum at each page end is mixed again:
  a page's key depends on every token before it, as a chained hash does.
  """
  n = num_pages * page_size
  positions = jnp.arange(n, dtype=jnp.uint32)
  mixed = _fmix(_u32(tokens[:n]) * _u32(_TOKEN) + positions * _u32(_POS) + _u32(1))
  sums = jnp.cumsum(mixed, dtype=jnp.uint32)
  return _fmix(sums[page_size - 1::page_size] ^ _u32(num_pages))


# ----------------------------------------------------------------------------- room


def running(cols: Columns):
  """`bool[S]`: columns holding a running sequence (not parked, not retained)."""
  return (cols.used == 1) & (cols.parked == 0)


def claims(ls: LoopState):
  """`int32[]`: positions running columns will hold once fed and forked, plus retained ones."""
  c = ls.cols
  held = jnp.where(running(c), c.length * (1 + c.forks), 0).sum(dtype=jnp.int32)
  return held + prefix_positions(ls)


def prefix_positions(ls: LoopState):
  return jnp.where(ls.cols.cached == 1, ls.cache.pos, 0).sum(dtype=jnp.int32)


def step_need(cols: Columns):
  """`int32[]`: positions the next step needs at least: one per column wanting a token."""
  wants = (cols.active == 1) & (jnp.minimum(cols.length, cols.hold) > cols.fed)
  return wants.sum(dtype=jnp.int32)


def step_fits(config: CacheConfig, ls: LoopState, need=None):
  """Whether the next step's first tokens fit `capacity` (the phase loops stop otherwise).

  `need`: `step_need(ls.cols)`, when the caller has it (the phase condition sums it with
  its other column totals, in one reduction).
  """
  return ls.cache.held + (step_need(ls.cols) if need is None else need) <= config.capacity


def room(config: CacheConfig, ls: LoopState):
  """`int32[]`: positions a step may carry: `capacity - held` (prefill chunks are cut to it)."""
  return config.capacity - ls.cache.held


def remove(config: CacheConfig, ls: LoopState, col, did) -> tuple:
  """`(cache, loop status)` after `seq_rm(col)` where `did` (a refused no-op elsewhere)."""
  cache, status = pure.seq_rm(config, ls.cache, jnp.where(did, col, -1))
  return cache, merge_status(ls.status, status, did)


def evict_one(config: CacheConfig, ls: LoopState, did=True) -> LoopState:
  """Removes the least recently used retained prefix (where `did`)."""
  big = jnp.iinfo(jnp.int32).max
  col = jnp.argmin(jnp.where(ls.cols.cached == 1, ls.cols.last_use, big)).astype(jnp.int32)
  did = did & (ls.cols.cached[col] == 1)
  cache, status = remove(config, ls, col, did)
  return dataclasses.replace(ls, cache=cache, status=status,
                             cols=update(ls.cols, col, did, cached=0),
                             evictions=ls.evictions + did.astype(jnp.int32))


def preempt_one(config: CacheConfig, ls: LoopState, did=True) -> LoopState:
  """Preempts the most recently admitted running column (where `did`): pages dropped, parked."""
  can = running(ls.cols) & (ls.cols.active == 1)
  col = jnp.argmax(jnp.where(can, ls.cols.stamp, -1)).astype(jnp.int32)
  did = did & can[col]
  cache, status = remove(config, ls, col, did)
  return dataclasses.replace(ls, cache=cache, status=status,
                             cols=update(ls.cols, col, did, parked=1, active=0, fed=0),
                             preemptions=ls.preemptions + did.astype(jnp.int32))


def can_free(ls: LoopState):
  return jnp.any(ls.cols.cached == 1) | jnp.any(running(ls.cols) & (ls.cols.active == 1))


def free_one(config: CacheConfig, ls: LoopState) -> LoopState:
  """Evicts a retained prefix if there is one, else preempts the latest running column."""
  has_prefix = jnp.any(ls.cols.cached == 1)
  ls = evict_one(config, ls, has_prefix)
  return preempt_one(config, ls, ~has_prefix)


def needs_room(config: CacheConfig, ls: LoopState):
  """Whether to evict or preempt before the next step: its first tokens pass `capacity`.

  `paged_admission.finish_block` frees room while this holds (and no fork is ready), in
  the same loop as the forks, so the common outer iteration checks one predicate.
  """
  return (ls.status == Status.OK) & ~step_fits(config, ls) & can_free(ls)


# ----------------------------------------------------------------------------- columns


def swap(ls: LoopState, a, b) -> LoopState:
  """Swaps the loop data of columns `a` and `b` (both without a live sequence)."""
  idx = jnp.stack([a, b])
  return dataclasses.replace(
      ls, cols=jax.tree.map(lambda arr: arr.at[idx].set(arr[idx[::-1]]), ls.cols))


def lowest_free_id(ls: LoopState):
  """`(exists, id)`: the id `seq_new`/`seq_clone` would take."""
  free = ls.cache.live == 0
  return jnp.any(free), jnp.argmax(free).astype(jnp.int32)


def spare(ls: LoopState):
  """`(exists, col)`: the highest column with neither a sequence nor parked data."""
  is_spare = (ls.cache.live == 0) & (ls.cols.used == 0)
  s = is_spare.shape[0]
  return jnp.any(is_spare), (s - 1 - jnp.argmax(is_spare[::-1])).astype(jnp.int32)


def stamped(ls: LoopState, col, did) -> LoopState:
  """Marks `col` newly admitted (where `did`): running, not parked, not retained."""
  return dataclasses.replace(ls, cols=update(ls.cols, col, did, stamp=ls.clock, parked=0, cached=0),
                             clock=ls.clock + did.astype(jnp.int32))


# ----------------------------------------------------------------------------- prefix match


def cap_pages(config: CacheConfig, prompt_len, length, num_hash: int):
  """Pages a target may adopt: full prompt pages, leaving at least one token to feed."""
  p = config.page_size
  return jnp.minimum(jnp.minimum(prompt_len, length - 1) // p, num_hash)


def best_source(config: CacheConfig, ls: LoopState, hashes, tokens, max_pages, exclude):
  """The longest adoptable prefix for a target: `(length m, source column, potential)`.

  Args:
    hashes: `uint32[H]` the target's page hashes; tokens: `int32[L]` its tokens.
    max_pages: `int32[]` most pages it may adopt; exclude: its own column (or -1).

  Returns:
    `m` (a multiple of `page_size`, 0 for none; confirmed token by token), the
    source column, and the longest match a running column is still prefilling
    (`(column, length)`: worth waiting for when longer than `m`).
  """
  c = ls.cols
  p, num_hash = config.page_size, c.page_hash.shape[1]
  s = c.used.shape[0]
  slots = jnp.arange(num_hash, dtype=jnp.int32)
  src_pages = jnp.minimum(c.prompt_len // p, num_hash)
  valid = (slots[None, :] < src_pages[:, None]) & (slots[None, :] < max_pages)
  run = jnp.cumprod((c.page_hash == hashes[None, :]) & valid, axis=1, dtype=jnp.int32)
  match = run.sum(axis=1, dtype=jnp.int32) * p                             # [S]
  cols = jnp.arange(s, dtype=jnp.int32)
  floors = jax.vmap(lambda c: pure.floor(config, ls.cache, c))(cols)
  is_source = (ls.cache.live == 1) & (cols != exclude) & ((c.cached == 1) | running(c))
  avail = jnp.minimum(match, ls.cache.pos // p * p)
  avail = jnp.where(is_source & (avail >= floors), avail, 0)
  src = jnp.argmax(avail).astype(jnp.int32)
  m = avail[src]
  same = jnp.where(jnp.arange(tokens.shape[0]) < m, c.tokens[src] == tokens, True)
  m = jnp.where(jnp.all(same), m, 0)
  pending = is_source & (c.active == 1) & (c.fed < match) & (match > m)
  wait_col = jnp.argmax(jnp.where(pending, match, 0)).astype(jnp.int32)
  wait = jnp.where(jnp.any(pending), jnp.stack([wait_col, match[wait_col]]), i32([-1, 0]))
  return m, src, wait


def adopt(config: CacheConfig, ls: LoopState, col, did) -> LoopState:
  """Column `col`, just admitted with an empty sequence, adopts the best cached prefix.

  Its empty sequence is removed and `seq_clone(source, m)` takes the same id
  back (the lowest free one), sharing the source's `m / page_size` full pages.
  """
  c = ls.cols
  cap = cap_pages(config, c.prompt_len[col], c.length[col], c.page_hash.shape[1])
  m, src, _ = best_source(config, ls, c.page_hash[col], c.tokens[col], cap, col)
  did = did & (m > 0)
  cache, status = remove(config, ls, col, did)
  ls = dataclasses.replace(ls, cache=cache, status=status)
  cache, status, new_id = pure.seq_clone(config, ls.cache, jnp.where(did, src, -1), m)
  status = merge_status(ls.status, status, did)
  status = jnp.where(did & (status == Status.OK) & (new_id != col), i32(Status.NO_FREE_ID),
                     status)
  cols = update(update(c, col, did, fed=m), src, did, last_use=ls.clock)
  return dataclasses.replace(ls, cache=cache, status=status, cols=cols,
                             cached_tokens=ls.cached_tokens + jnp.where(did, m, 0))


def hash_column(config: CacheConfig, ls: LoopState, col, did) -> LoopState:
  """Stores the page hashes of column `col`'s tokens (where `did`; prefix caching only)."""
  if not has_prefix_cache(ls):
    return ls
  h = page_hashes(ls.cols.tokens[col], ls.cols.page_hash.shape[1], config.page_size)
  return dataclasses.replace(ls, cols=update(ls.cols, col, did, page_hash=h))
