"""Page-table bookkeeping of paged storage (CONTRACT §3.1), pure and static-shaped.

A live column `c` holds exactly the pages `page_table[c, :ceil(e_c / P)]` for an
extent `e_c` (its committed length, or the end of its prepared step); every other
entry, and the whole scratch row, holds the scratch page. `page_refs[p]` counts
the entries of live columns that hold page `p`; a page with count 0 is free.
Full pages may be shared between columns (`seq_clone`); a column's shared pages
all lie at or below its first write page `pos // P`, so copy on write only ever
concerns that one page per column.

Every function here returns new `(page_table, page_refs)`; the verbs select the
old ones on refusal, so a refused verb leaves both bitwise unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._config import CacheConfig
from jaxkv._state import CacheState


def pages_for(config: CacheConfig, extent):
  """Pages that hold positions `[0, extent)`: `ceil(extent / page_size)`."""
  return (extent + config.page_size - 1) // config.page_size


def fit(config: CacheConfig, table, refs, extents, *, cow=None):
  """Makes every column hold exactly the pages covering `[0, extents[c])`.

  Entries past a column's extent are released (count - 1); missing entries,
  and the entries marked in `cow` (shared pages about to be written), get free
  pages, lowest page first, in row-major order of the table.

  Args:
    table: `int32[max_seqs + 1, M]`; refs: `int32[num_pages]`.
    extents: `int32[max_seqs]`; 0 for a column that should hold nothing.
    cow: optional `bool[max_seqs, M]`, entries to replace by a fresh page.

  Returns:
    `(table, refs, enough)`: `enough` is False when the free pages ran out (the
    pool size makes that impossible for states the verbs produce; a caller
    refuses then and keeps its old table and refs).
  """
  scratch, num_pages = config.scratch_page, config.num_pages
  body = table[:config.max_seqs]
  slots = jnp.arange(config.max_pages_per_seq, dtype=jnp.int32)
  want = slots[None, :] < pages_for(config, extents)[:, None]
  held = body != scratch
  release = held & ~want
  if cow is not None:
    release = release | (held & cow)
  refs = refs.at[jnp.where(release, body, num_pages)].add(-1, mode="drop")
  body = jnp.where(release, scratch, body)
  take = want & (body == scratch)
  free = (refs == 0).at[scratch].set(False)
  free_list = jnp.nonzero(free, size=num_pages, fill_value=scratch)[0].astype(jnp.int32)
  rank = jnp.cumsum(take.reshape(-1), dtype=jnp.int32).reshape(take.shape) - 1
  body = jnp.where(take, free_list[jnp.clip(rank, 0, num_pages - 1)], body)
  refs = refs.at[jnp.where(take, body, num_pages)].add(1, mode="drop")
  enough = take.sum(dtype=jnp.int32) <= free.sum(dtype=jnp.int32)
  return table.at[:config.max_seqs].set(body), refs, enough


def share_prefix(config: CacheConfig, table, refs, src, dst, keep):
  """Column `dst` (holding nothing) shares `src`'s full pages below `keep`."""
  slots = jnp.arange(config.max_pages_per_seq, dtype=jnp.int32)
  shared = slots < keep // config.page_size
  row = jnp.where(shared, table[src], config.scratch_page)
  refs = refs.at[jnp.where(shared, row, config.num_pages)].add(1, mode="drop")
  return table.at[dst].set(row), refs


def first_write_slots(config: CacheConfig, pos):
  """`int32[max_seqs]`: the table slot of each column's first write page, `pos // P`."""
  return jnp.minimum(pos // config.page_size, config.max_pages_per_seq - 1)


def shared_first_pages(config: CacheConfig, table, refs, pos, writes):
  """`bool[max_seqs, M]`: the first write page of each writing column, where shared."""
  slot = first_write_slots(config, pos)
  cols = jnp.arange(config.max_seqs, dtype=jnp.int32)
  page = table[cols, slot]
  is_shared = writes & (page != config.scratch_page) & (refs[page] > 1)
  slots = jnp.arange(config.max_pages_per_seq, dtype=jnp.int32)
  return is_shared[:, None] & (slots[None, :] == slot[:, None])


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


def compact(mask, values, fill):
  """`(values where mask, packed first, count)`: `values[mask]` padded to a static size."""
  index = jnp.nonzero(mask, size=mask.shape[0], fill_value=0)[0]
  count = mask.sum(dtype=jnp.int32)
  packed = jnp.where(jnp.arange(mask.shape[0]) < count, values[index], fill)
  return packed.astype(jnp.int32), count


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
  table, refs, _ = fit(config, state.page_table, state.page_refs, live_pos)
  table, refs = share_prefix(config, table, refs, src_col, dst, keep)
  table, refs, enough = fit(config, table, refs, live_pos.at[dst].set(keep))
  slot = jnp.minimum(keep // config.page_size, config.max_pages_per_seq - 1)
  copies = (keep % config.page_size != 0).astype(jnp.int32)
  partial = (table[src_col, slot][None], table[dst, slot][None], copies)
  return dict(page_table=table, page_refs=refs), enough, partial


def fitted_pages(config: CacheConfig, state: CacheState, extents) -> dict:
  """`page_table`/`page_refs` fitted to `extents` (releases only), or nothing unpaged.

  Used by verbs that only shrink extents (`seq_rm`, `rewind`), which never take
  a page, so the fit cannot run out.
  """
  if not config.is_paged:
    return {}
  table, refs, _ = fit(config, state.page_table, state.page_refs, extents)
  return dict(page_table=table, page_refs=refs)


def prepare_pages(config: CacheConfig, state: CacheState, seq_cols, ends):
  """A step's page tables: `(fields, enough, (src pages, dst pages, copies))`.

  Each live column holds the pages up to the end of its step tokens (pages of
  an abandoned earlier step past that are released), and a writing column
  whose first write page is shared gets a private copy of it.
  """
  live_pos = committed_extents(state)
  extents = jnp.maximum(live_pos, live_pos.at[seq_cols].max(ends, mode="drop"))
  extents = jnp.where(state.live == 1, extents, 0)
  writes = extents > live_pos
  table, refs, enough = fit(config, state.page_table, state.page_refs, extents)
  cow = shared_first_pages(config, table, refs, live_pos, writes)
  new_table, refs, enough_cow = fit(config, table, refs, extents, cow=cow)
  cols = jnp.arange(config.max_seqs, dtype=jnp.int32)
  slot = first_write_slots(config, live_pos)
  is_cow = jnp.any(cow, axis=1)
  src, count = compact(is_cow, table[cols, slot], config.scratch_page)
  dst, _ = compact(is_cow, new_table[cols, slot], config.scratch_page)
  return (dict(page_table=new_table, page_refs=refs), enough & enough_cow, (src, dst, count))
