"""Page-table bookkeeping of paged storage (CONTRACT §3.1), pure and static-shaped.

A live column `c` holds exactly the pages `page_table[c, :ceil(e_c / P)]` for an
extent `e_c` (its committed length, or the end of its prepared step); every other
entry, and the whole scratch row, holds the scratch page. `page_refs[p]` counts
the entries of live columns that hold page `p`; a page with count 0 is free.
Full pages may be shared between columns (`seq_clone`); a column's shared pages
all lie at or below its first write page `pos // P`, so copy on write only ever
concerns that one page per column.

Every function here returns new `(page_table, page_refs)`; the verbs select the
old ones on refusal (`apply_step_pages` takes the verdict and applies nothing on
refusal), so a refused verb leaves both bitwise unchanged.

`prepare_step` runs every step, so its bookkeeping (`plan_step_pages`,
`apply_step_pages`) touches only a window of `step_slots` table slots per column
from its first write slot `pos // P` (a `[max_seqs, K]` gather and scatter): a
step of at most `W` tokens changes no slot outside it (see `step_slots`). The
only pass over `[num_pages]` finds the free pages, lowest first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._config import CacheConfig
from jaxkv._state import CacheState


def pages_for(config: CacheConfig, extent):
  """Pages that hold positions `[0, extent)`: `ceil(extent / page_size)`."""
  return (extent + config.page_size - 1) // config.page_size


def share_prefix(config: CacheConfig, table, refs, src, dst, keep):
  """Column `dst` (holding nothing) shares `src`'s full pages below `keep`."""
  slots = jnp.arange(config.max_pages_per_seq, dtype=jnp.int32)
  shared = slots < keep // config.page_size
  row = jnp.where(shared, table[src], config.scratch_page)
  refs = refs.at[jnp.where(shared, row, config.num_pages)].add(1, mode="drop")
  return table.at[dst].set(row), refs


def copy_pages(config: CacheConfig, pools, src, dst, count):
  """Copies page `src[i]` to page `dst[i]` of every pool, for `i < count`.

  A loop of `count` (usually 0) whole-page in-place updates: the pools are
  loop carries, so XLA updates them in place under donation (no pool copy).

  Args:
    pools: tuple of `[num_pages, P, K, D]` arrays.
    src, dst: `int32[N]` page ids; count: `int32[]`, `<= N`.
  """
  def body(i, pools):
    def one(pool):
      page = jax.lax.dynamic_slice_in_dim(pool, src[i], 1, axis=0)
      return jax.lax.dynamic_update_slice_in_dim(pool, page, dst[i], axis=0)
    return tuple(one(pool) for pool in pools)
  return jax.lax.fori_loop(0, count, body, tuple(pools))


# --------------------------------------------------------------------------- per verb


def committed_extents(state: CacheState):
  """`int32[max_seqs]`: each live column's committed length, 0 for the others."""
  return jnp.where(state.live == 1, state.pos, 0)


def paged_layers(config: CacheConfig) -> list[int]:
  """The layers stored in the pool (the flat ones of a paged config)."""
  return [l for l in range(config.num_layers) if config.is_paged_layer(l)]


def copy_pool_pages(config: CacheConfig, state: CacheState, src, dst, count):
  """`(k, v)` with pages `src[i] -> dst[i]` (`i < count`) copied in every paged layer."""
  paged = paged_layers(config)
  pools = [state.k[l] for l in paged] + [state.v[l] for l in paged]
  pools = copy_pages(config, pools, src, dst, count)
  k, v = list(state.k), list(state.v)
  for i, l in enumerate(paged):
    k[l], v[l] = pools[i], pools[len(paged) + i]
  return tuple(k), tuple(v)


def clone_pages(config: CacheConfig, state: CacheState, src_col, dst, keep):
  """A clone's page tables: `(fields, enough, (src page, dst page, copies))`.

  Every column is first trimmed to its committed length (an abandoned step's
  pages go back), then `dst` shares `src`'s full pages below `keep` and takes a
  fresh page for the partial last one, whose rows are copied from `src`'s.
  """
  live_pos = committed_extents(state)
  table, refs = release_past(config, state.page_table, state.page_refs, live_pos)
  table, refs = share_prefix(config, table, refs, src_col, dst, keep)
  # The one page a clone takes, the lowest free one: a first-true search of the
  # pool, not a pass that fits the whole table.
  slot = jnp.minimum(keep // config.page_size, config.max_pages_per_seq - 1)
  is_partial = keep % config.page_size != 0
  pages = jnp.arange(config.num_pages, dtype=jnp.int32)
  free = (refs == 0) & (pages != config.scratch_page)
  page = jnp.argmax(free).astype(jnp.int32)
  enough = ~is_partial | jnp.any(free)
  table = table.at[dst, slot].set(jnp.where(is_partial, page, table[dst, slot]))
  refs = refs.at[jnp.where(is_partial, page, config.num_pages)].add(1, mode="drop")
  partial = (table[src_col, slot][None], table[dst, slot][None], is_partial.astype(jnp.int32))
  return dict(page_table=table, page_refs=refs), enough, partial


def release_past(config: CacheConfig, table, refs, extents):
  """`(table, refs)` with every column's entries at or past `ceil(extents[c] / P)` released.

  For verbs that only shrink extents (`seq_rm`, `rewind`, and a clone's trim of
  an abandoned step): no page is taken, so no free list is needed.
  """
  body = table[:config.max_seqs]
  slots = jnp.arange(config.max_pages_per_seq, dtype=jnp.int32)
  release = (body != config.scratch_page) & (slots[None, :]
                                             >= pages_for(config, extents)[:, None])
  refs = refs.at[jnp.where(release, body, config.num_pages)].add(-1, mode="drop")
  body = jnp.where(release, config.scratch_page, body)
  return table.at[:config.max_seqs].set(body), refs


def fitted_pages(config: CacheConfig, state: CacheState, extents) -> dict:
  """`page_table`/`page_refs` fitted to `extents` (releases only), or nothing unpaged.

  Used by verbs that only shrink extents (`seq_rm`, `rewind`), which never take
  a page, so the fit cannot run out.
  """
  if not config.is_paged:
    return {}
  table, refs = release_past(config, state.page_table, state.page_refs, extents)
  return dict(page_table=table, page_refs=refs)


def step_slots(config: CacheConfig) -> int:
  """`K`: table slots from a column's first write slot `pos // P` that a step may change.

  No verb leaves a column holding a slot at or past `ceil((pos + W) / P)`
  (CONTRACT §3.1): a prepared or committed step adds at most `W` positions past
  `pos` (owner-block tokens included), and `seq_clone`, `rewind` and `seq_rm`
  trim every column to `ceil(pos / P)` slots. That bound, and the step's own
  end, are at most `pos // P + ceil((P - 1 + W) / P)`; slots below `pos // P`
  hold full pages the step keeps. Hence every slot a prepare takes, releases
  or copies lies in `[pos // P, pos // P + K)`.
  """
  p = config.page_size
  return min(config.max_pages_per_seq, (config.step_width + 2 * p - 2) // p)


_COMPARE_ELEMENTS = 1 << 22


def _exclusive_counts(mask):
  """`int32[S, K]`: how many entries of `mask` come before each, in row-major order.

  A compare-and-sum (`[S, S]` and `[S, K, K]`), not `cumsum`: XLA lowers a
  cumsum to a chain of reduce-windows, several kernels on the GPU per call.
  Within a row it falls back to `cumsum` when `[S, K, K]` would be large (tiny
  pages under a wide step).
  """
  s, k = mask.shape
  counts = mask.sum(axis=1, dtype=jnp.int32)                                  # [S]
  rows = jnp.arange(s)
  before_row = jnp.where(rows[None, :] < rows[:, None], counts[None, :], 0).sum(
      axis=1, dtype=jnp.int32)
  if s * k * k <= _COMPARE_ELEMENTS:
    slots = jnp.arange(k)
    in_row = (mask[:, None, :] & (slots[None, None, :] < slots[None, :, None])).sum(
        axis=2, dtype=jnp.int32)
  else:
    in_row = jnp.cumsum(mask, axis=1, dtype=jnp.int32) - mask.astype(jnp.int32)
  return before_row[:, None] + in_row


def plan_step_pages(config: CacheConfig, state: CacheState, step_ends):
  """What a step's `prepare_step` does to the pages, as `[max_seqs, K]` windows.

  Each live column must hold exactly the slots up to the end of its step tokens
  (pages of an abandoned earlier step past that are released); a writing
  column whose first write page is shared takes a fresh page for it (copy on
  write) and gives one reference back. New pages are the lowest free ones
  (after this step's releases), handed out in row-major order of the table.

  Args:
    step_ends: `int32[max_seqs]` one past the last position each column's step
      tokens write (0 for a column without tokens).

  Returns:
    A dict: `slots`, `new` (the window's new entries), `release`, `take`
    (`[max_seqs, K]`), `window` (old entries), `refs` (counts after the
    releases), `enough` (False when the free pages ran out: the caller
    refuses), and the copy on write pairs `cow_src`, `cow_dst`
    (`int32[max_seqs]`, the scratch page where none).
  """
  s, m, k = config.max_seqs, config.max_pages_per_seq, step_slots(config)
  scratch, num_pages = config.scratch_page, config.num_pages
  live = state.live == 1
  pos = jnp.where(live, state.pos, 0)
  extents = jnp.where(live, jnp.maximum(pos, step_ends), 0)
  slots = (pos // config.page_size)[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
  in_table = slots < m
  cols = jnp.arange(s, dtype=jnp.int32)[:, None]
  window = state.page_table[cols, jnp.minimum(slots, m - 1)]                 # [S, K]
  held = in_table & (window != scratch)
  want = in_table & (slots < pages_for(config, extents)[:, None])
  # Copy on write: only a writing column's first write slot (window column 0) can be shared.
  first = window[:, 0]
  cow = (extents > pos) & held[:, 0] & (state.page_refs[first] > 1)           # [S]
  is_cow = cow[:, None] & (jnp.arange(k) == 0)[None, :]
  release = held & (~want | is_cow)
  take = want & (~held | is_cow)
  refs = state.page_refs.at[jnp.where(release, window, num_pages)].add(-1, mode="drop")
  # The free pages, lowest first: one sort of the pool's page ids (free ones keep
  # their id, the others sort last as `num_pages`), not `nonzero` (a cumsum).
  pages = jnp.arange(num_pages, dtype=jnp.int32)
  free_list = jnp.sort(jnp.where((refs == 0) & (pages != scratch), pages, num_pages))
  free_list = jnp.pad(free_list, (0, max(s * k - num_pages, 0)), constant_values=num_pages)
  rank = _exclusive_counts(take)
  fresh = free_list[jnp.minimum(rank, s * k - 1)]
  enough = ~jnp.any(take & (fresh == num_pages))
  new = jnp.where(take, fresh, jnp.where(release, scratch, window))
  return dict(slots=slots, window=window, new=new, release=release, take=take, refs=refs,
              enough=enough, cow_src=jnp.where(cow, first, scratch),
              cow_dst=jnp.where(cow, new[:, 0], scratch))


def apply_step_pages(config: CacheConfig, state: CacheState, plan, ok) -> dict:
  """`page_table`/`page_refs` after `plan` where `ok`, else the state's own, bitwise.

  Only the window's `[max_seqs, K]` entries are scattered (none when refused).
  The counts already carry the plan's releases: one more scatter adds the takes
  when `ok` and undoes the releases when not, so the state's counts are updated
  in place and never selected whole.
  """
  m, num_pages = config.max_pages_per_seq, config.num_pages
  cols = jnp.arange(config.max_seqs, dtype=jnp.int32)[:, None]
  at = jnp.where(ok & (plan["slots"] < m), plan["slots"], m)    # out of the table: dropped
  table = state.page_table.at[cols, at].set(plan["new"], mode="drop")
  undo = jnp.where(~ok & plan["release"], plan["window"], num_pages)
  add = jnp.where(ok & plan["take"], plan["new"], num_pages)
  refs = plan["refs"].at[jnp.concatenate([undo.reshape(-1), add.reshape(-1)])].add(
      1, mode="drop")
  return dict(page_table=table, page_refs=refs)


def step_copies(config: CacheConfig, plan):
  """`(src pages, dst pages, count)` of the plan's copies on write, packed first.

  Packed by one sort of the column ids (copying columns keep theirs, the others
  sort last), not `nonzero` (a cumsum).
  """
  s, scratch = config.max_seqs, config.scratch_page
  is_cow = plan["cow_src"] != scratch
  order = jnp.sort(jnp.where(is_cow, jnp.arange(s, dtype=jnp.int32), s))
  count = is_cow.sum(dtype=jnp.int32)
  pick = lambda pages: jnp.where(order < s, pages[jnp.minimum(order, s - 1)], scratch)
  return pick(plan["cow_src"]), pick(plan["cow_dst"]), count
