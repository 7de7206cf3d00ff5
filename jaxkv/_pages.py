"""Page-table bookkeeping of paged storage (CONTRACT §3.1), pure and static-shaped.

A live column `c` holds exactly the pages `page_table[c, :ceil(e_c / P)]` for an
extent `e_c` (its committed length, or the end of its prepared step); every other
entry, and the whole scratch row, holds the scratch page. `page_refs[p]` counts
the entries of live columns that hold page `p`; a page with count 0 is free.
Full pages may be shared between columns (`seq_clone`). Every page a column
holds at or past its first write slot `pos // P` is its own (CONTRACT §3.1):
`seq_clone` shares only full pages below its `keep` and copies a partial last
page, and `rewind` copies the page it ends in when that page is shared (copy on
write, `rewind_pages`). So a step never writes a shared page and `prepare_step`
copies nothing.

Every function here returns new `(page_table, page_refs)`; the verbs select the
old ones on refusal (`apply_step_pages` takes the verdict and applies nothing on
refusal), so a refused verb leaves both bitwise unchanged.

`prepare_step` runs every step, so its bookkeeping (`plan_step_pages`,
`apply_step_pages`) touches only a window of `step_slots` table slots per column
from its first write slot `pos // P` (a `[max_seqs, K]` gather and scatter): a
step of at most `W` tokens changes no slot outside it (see `step_slots`). The
only pass over `[num_pages]` finds the free pages, lowest first, without a sort
(`lowest_free`), and keeps only as many as a step can take (`step_takes`). It has no loop
and no `lax.cond`: on a GPU each loop with a traced trip count and each
conditional reads its predicate back to the host, a round trip per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._config import CacheConfig
from jaxkv._state import CacheState
from pallas_kernels.common import prefix_sum


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


def copy_page(config: CacheConfig, state: CacheState, src, dst, do):
  """`(k, v)` with page `src` copied onto page `dst` in every paged layer, where `do`.

  One whole-page `dynamic_slice` and in-place `dynamic_update_slice` per pool
  (donated, XLA updates it in place), with no loop and no `lax.cond`, whose
  predicates a GPU would read back to the host. Where `do` is false the page
  `src` is written onto itself, which changes no byte. The verbs that copy
  (`seq_clone`, `rewind`) run per fork, adoption or rewind, not per step; they
  pay these small kernels on every call where a branch would pay a host round
  trip.

  Args:
    src, dst: `int32[]` page ids; do: `bool[]`.
  """
  dst = jnp.where(do, dst, src)
  k, v = list(state.k), list(state.v)
  paged = paged_layers(config)
  for layer in paged:
    for arrays in (k, v):
      page = jax.lax.dynamic_slice_in_dim(arrays[layer], src, 1, axis=0)
      arrays[layer] = jax.lax.dynamic_update_slice_in_dim(arrays[layer], page, dst, axis=0)
  # The barrier keeps XLA from folding a later read of a page (the next verb's copy)
  # into a read of the pools before this update, which would keep both alive and
  # copy a whole pool.
  pools = jax.lax.optimization_barrier(tuple((k[l], v[l]) for l in paged))
  for layer, (new_k, new_v) in zip(paged, pools):
    k[layer], v[layer] = new_k, new_v
  return tuple(k), tuple(v)


# --------------------------------------------------------------------------- per verb


def committed_extents(state: CacheState):
  """`int32[max_seqs]`: each live column's committed length, 0 for the others."""
  return jnp.where(state.live == 1, state.pos, 0)


def paged_layers(config: CacheConfig) -> list[int]:
  """The layers stored in the pool (the flat ones of a paged config)."""
  return [l for l in range(config.num_layers) if config.is_paged_layer(l)]


def _free_pages(config: CacheConfig, refs):
  """`bool[num_pages]`: the pages no entry holds (count 0), the scratch page never."""
  pages = jnp.arange(config.num_pages, dtype=jnp.int32)
  return (refs == 0) & (pages != config.scratch_page)


def _take_one(config: CacheConfig, table, refs, col, slot, take):
  """`(table, refs, enough, page)`: where `take`, entry `[col, slot]` gets a fresh page.

  The fresh page is the lowest free one (a first-true search of the pool, not a
  pass that fits the whole table); the entry's old page, if any, gives one
  reference back. `enough` is False when `take` finds no free page (the caller
  refuses, so the new `table`/`refs` are then never used).
  """
  free = _free_pages(config, refs)
  page = jnp.argmax(free).astype(jnp.int32)
  old = table[col, slot]
  table = table.at[col, slot].set(jnp.where(take, page, old))
  gone = jnp.where(take & (old != config.scratch_page), old, config.num_pages)
  refs = refs.at[gone].add(-1, mode="drop")
  refs = refs.at[jnp.where(take, page, config.num_pages)].add(1, mode="drop")
  return table, refs, ~take | jnp.any(free), page


def clone_pages(config: CacheConfig, state: CacheState, src_col, dst, keep):
  """A clone's page tables: `(fields, enough, (src page, dst page, copy))`.

  Every column is first trimmed to its committed length (an abandoned step's
  pages go back), then `dst` shares `src`'s full pages below `keep` and takes a
  fresh page for the partial last one (`copy`: `keep % P != 0`), whose rows are
  copied from `src`'s. The fork's page holding `keep` is thus its own, and the
  source's is untouched (CONTRACT §3.1's invariant).
  """
  live_pos = committed_extents(state)
  table, refs = release_past(config, state.page_table, state.page_refs, live_pos)
  table, refs = share_prefix(config, table, refs, src_col, dst, keep)
  slot = jnp.minimum(keep // config.page_size, config.max_pages_per_seq - 1)
  is_partial = keep % config.page_size != 0
  table, refs, enough, page = _take_one(config, table, refs, dst, slot, is_partial)
  copy = (table[src_col, slot], page, is_partial)
  return dict(page_table=table, page_refs=refs), enough, copy


def rewind_pages(config: CacheConfig, state: CacheState, col, position):
  """A rewind's page tables: `(fields, enough, (src page, dst page, copy))`.

  Every column is trimmed to its committed length and `col` to `position`
  (releases only). Copy on write (CONTRACT §3.1): when `position` ends inside a
  page (`position % P != 0`) that another column also holds, `col` takes the
  lowest free page for that slot, gives the shared page one reference back, and
  the caller copies the shared page's rows into the new one (`copy`), so the
  steps that write from `position` on never touch a page another sequence
  reads. Only a rewind can end a column inside a shared page: every other verb
  keeps each column's page at `pos // P` its own. `enough` is False when a copy
  is needed and no page is free (a state no verb produces: the caller refuses
  with NO_ROOM).

  Args:
    col: `int32[]` a column index; position: `int32[]` in `[0, pos[col]]`.
  """
  extents = committed_extents(state).at[col].set(position)
  table, refs = release_past(config, state.page_table, state.page_refs, extents)
  slot = jnp.minimum(position // config.page_size, config.max_pages_per_seq - 1)
  shared = table[col, slot]
  # `refs[scratch] == 0`, so an unheld slot never counts as shared.
  is_shared = (position % config.page_size != 0) & (refs[shared] > 1)
  table, refs, enough, page = _take_one(config, table, refs, col, slot, is_shared)
  return dict(page_table=table, page_refs=refs), enough, (shared, page, is_shared)


def release_past(config: CacheConfig, table, refs, extents):
  """`(table, refs)` with every column's entries at or past `ceil(extents[c] / P)` released.

  For verbs that shrink extents (`seq_rm`, `rewind`, and a clone's trim of an
  abandoned step): no page is taken, so no free list is needed.
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

  Used by `seq_rm`, which only shrinks extents and never takes a page, so the
  fit cannot run out.
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
  hold full pages the step keeps. Hence every slot a prepare takes or releases
  lies in `[pos // P, pos // P + K)`.
  """
  p = config.page_size
  return min(config.max_pages_per_seq, (config.step_width + 2 * p - 2) // p)


def step_takes(config: CacheConfig) -> int:
  """The most pages one `prepare_step` takes in all: `M + (W - M) // P`, `M = min(S, W)`.

  A live column holds at least the slots `[0, ceil(pos / P))` (CONTRACT §3.1), and
  its `n_c` step tokens sit at consecutive positions from `pos` (owner blocks
  included), so it takes at most `ceil((pos + n_c) / P) - ceil(pos / P) <=
  ceil(n_c / P) = 1 + (n_c - 1) // P` pages. Over the `m` columns with tokens
  (`m <= M`, `sum n_c <= W`) that is at most `m + (W - m) // P`, which grows with
  `m`: at most `M + (W - M) // P` (reached: `M` page-aligned columns, one token each
  and the rest on one). Below `ceil(W / P) + S`, and never more than `S * K`.
  """
  s, w, p = config.max_seqs, config.step_width, config.page_size
  m = min(s, w)
  return min(s * step_slots(config), m + (w - m) // p)


_WORD = 32


def lowest_free(config: CacheConfig, refs, length: int):
  """`int32[length]`: the `length` lowest free pages in increasing order, `num_pages` past the last.

  No sort of the pool (two kernels per step on a GPU for a few thousand pages). Each
  free page's rank among the free ones, by bit counting: the free mask is packed
  into one `uint32` word per 32 pages (a sum of distinct bits), a page's rank within
  its word is the population count of the bits below it, and the free pages before
  its word come from a compare-and-sum over the words' counts (not `cumsum`, which
  XLA lowers to a chain of reduce-windows). Nothing larger than the padded pool is
  built but that `[words, words]` compare. One scatter then puts each free page at
  its rank, dropping ranks past `length`. The same list as sorting the free pages'
  ids (`tests/jaxkv/test_paged_free.py`).
  """
  num_pages = config.num_pages
  words = -(-num_pages // _WORD)
  free = jnp.pad(_free_pages(config, refs), (0, words * _WORD - num_pages))
  free = free.reshape(words, _WORD)
  bits = jnp.left_shift(jnp.uint32(1), jnp.arange(_WORD, dtype=jnp.uint32))
  packed = jnp.where(free, bits, jnp.uint32(0)).sum(axis=1, dtype=jnp.uint32)       # [words]
  in_word = jax.lax.population_count(packed[:, None] & (bits - 1)[None, :]).astype(jnp.int32)
  counts = jax.lax.population_count(packed).astype(jnp.int32)
  before = prefix_sum(counts) - counts   # a compare-and-sum up to 2**16 pages
  rank = before[:, None] + in_word
  pages = jnp.arange(words * _WORD, dtype=jnp.int32).reshape(words, _WORD)
  at = jnp.where(free & (rank < length), rank, length)
  return jnp.full((length,), num_pages, jnp.int32).at[at.reshape(-1)].set(
      pages.reshape(-1), mode="drop")


def _exclusive_counts(mask):
  """`int32[S, K]`: how many entries of `mask` come before each, in row-major order.

  Compare-and-sums (`prefix_sum`: `[S, S]` and `[S, K, K]`), not `cumsum`: XLA
  lowers a cumsum to a chain of reduce-windows, several kernels on the GPU per
  call. `prefix_sum` falls back to `cumsum` past `COMPARE_ELEMENTS` (tiny pages
  under a wide step).
  """
  counts = mask.sum(axis=1, dtype=jnp.int32)                                  # [S]
  mask = mask.astype(jnp.int32)
  return (prefix_sum(counts) - counts)[:, None] + prefix_sum(mask) - mask


def plan_step_pages(config: CacheConfig, state: CacheState, step_ends):
  """What a step's `prepare_step` does to the pages, as `[max_seqs, K]` windows.

  Each live column must hold exactly the slots up to the end of its step tokens
  (pages of an abandoned earlier step past that are released). New pages are the
  lowest free ones (after this step's releases), handed out in row-major order
  of the table. Nothing is copied: every page a column holds from its first
  write slot `pos // P` on is its own (CONTRACT §3.1; `rewind` copies a shared
  page it ends in), so a step's writes never reach a page another column reads.

  Args:
    step_ends: `int32[max_seqs]` one past the last position each column's step
      tokens write (0 for a column without tokens).

  Returns:
    A dict: `slots`, `new` (the window's new entries), `release`, `take`
    (`[max_seqs, K]`), `window` (old entries), `refs` (counts after the
    releases) and `enough` (False when the free pages ran out: the caller
    refuses).
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
  release = held & ~want
  take = want & ~held
  refs = state.page_refs.at[jnp.where(release, window, num_pages)].add(-1, mode="drop")
  length = step_takes(config)
  free_list = lowest_free(config, refs, length)
  rank = _exclusive_counts(take)
  fresh = free_list[jnp.minimum(rank, length - 1)]
  # A take past the free pages gets `num_pages` (refused). `rank < length` always
  # (`step_takes`); were that bound broken, the take refuses rather than share a page.
  enough = ~jnp.any(take & ((fresh == num_pages) | (rank >= length)))
  new = jnp.where(take, fresh, jnp.where(release, scratch, window))
  return dict(slots=slots, window=window, new=new, release=release, take=take, refs=refs,
              enough=enough)


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
