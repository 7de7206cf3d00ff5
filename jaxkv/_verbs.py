"""The pure verbs (CONTRACT §5, §6, §10.3): `(config, state, ...) -> (state, status, ...)`.

Every verb is jittable with `config` static, works under `scan`/`while_loop`, and
returns every state leaf. A refused verb returns a state equal in value to its
input (the scratch column excepted). Control values (page tables and reference
counts included) are selected with `jnp.where`; K/V storage is never selected
wholesale (that would copy the cache): a refused clone copies into the scratch
column instead, and a refused paged verb copies no page.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _pages, _plan
from jaxkv._config import CacheConfig
from jaxkv._grow import grow, grown_array  # pylint: disable=unused-import  (re-exported)
from jaxkv._state import CacheState, Phase, Status, empty_step, flat_rows
from jaxkv._validate import static_validate_int_arg, static_validate_state
from pallas_kernels import indexing
from pallas_kernels.common import per_column

WHOLE = 2**31 - 1
"""`upto` for `seq_clone` meaning the source's whole committed length."""

_CONTROL_FIELDS = ("live", "pos", "hw", "held", "phase", "decl_ids", "decl_block",
                   "decl_n", "attended", "step", "page_table", "page_refs")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _check(config: CacheConfig, state: CacheState, **int_args) -> None:
  """Trace-time checks of a verb's config, state and integer arguments.

  Each keyword is `name=(value, shape)`; scalars have shape `()`.
  """
  if not isinstance(config, CacheConfig):
    raise TypeError(f"config={config!r} must be a CacheConfig")
  static_validate_state(config, state)
  for name, (value, shape) in int_args.items():
    static_validate_int_arg(name, value, shape)


def _i32(x):
  """`x` as int32, saturating: a wider or unsigned id or position never wraps.

  Under `jax_enable_x64` an int64 argument arrives traced; casting it would wrap
  `2**32` onto id 0. Clamped to the int32 range instead, it stays out of range
  for every id and position, so the verb refuses it with a status. (With x64
  off, JAX itself casts int64 NumPy arguments of a jitted function to int32 at
  the jit boundary, before any verb sees them; concrete NumPy values reaching a
  verb are refused at trace time by `static_validate_int_arg`.)
  """
  x = jnp.asarray(x)
  if x.dtype == jnp.int32 or not jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(jnp.int32)
  info = jnp.iinfo(x.dtype)
  lo, hi = max(int(info.min), _INT32_MIN), min(int(info.max), _INT32_MAX)
  return jnp.clip(x, np.asarray(lo, x.dtype), np.asarray(hi, x.dtype)).astype(jnp.int32)


def _first_failure(checks):
  """The status of the first failing `(failed, status)` check, else OK."""
  status = _i32(Status.OK)
  for failed, code in reversed(checks):
    status = jnp.where(failed, _i32(code), status)
  return status


def _select_control(ok, new: CacheState, old: CacheState) -> CacheState:
  """`new` where `ok`, else `old`, for the control values only (K/V from `new`)."""
  # A field the verb left as it was (the same array) needs no select: on the page
  # table that would be a whole-table op in every verb that keeps it.
  chosen = {name: jax.tree.map(lambda a, b: b if a is b else jnp.where(ok, a, b),
                               getattr(new, name), getattr(old, name))
            for name in _CONTROL_FIELDS}
  return dataclasses.replace(new, **chosen)


def _column(config: CacheConfig, seq_id):
  """`(in_range, col)`: whether `seq_id` names a column, and a safe index."""
  seq_id = _i32(seq_id)
  in_range = (seq_id >= 0) & (seq_id < config.max_seqs)
  return in_range, jnp.clip(seq_id, 0, config.max_seqs - 1)


def _is_live(config: CacheConfig, state: CacheState, seq_id):
  in_range, col = _column(config, seq_id)
  return in_range & (state.live[col] == 1), col


def _no_layer_attended(config: CacheConfig):
  return jnp.zeros((config.num_layers,), jnp.int32)


def _invalidated(config: CacheConfig, state: CacheState, **changes) -> CacheState:
  """The state with `changes` and no step: phase IDLE, no declaration."""
  return dataclasses.replace(
      state, phase=_i32(Phase.IDLE),
      decl_ids=jnp.full((config.step_width,), config.max_seqs, jnp.int32),
      decl_block=jnp.zeros((config.step_width,), jnp.int32), decl_n=_i32(0),
      attended=_no_layer_attended(config), **changes)


def _held(live, pos):
  return jnp.where(live == 1, pos, 0).sum(dtype=jnp.int32)


def _lowest_free(state: CacheState):
  free = state.live == 0
  return jnp.any(free), jnp.argmax(free).astype(jnp.int32)


def floor(config: CacheConfig, state: CacheState, seq_id):
  """Lowest length `rewind`/`seq_clone` may target for `seq_id` (CONTRACT §4.2); int32.

  0 for an id outside `[0, max_seqs)`, as for a sequence that is not live (its
  `hw` is 0): nothing can be rewound or cloned there.
  """
  _check(config, state, seq_id=(seq_id, ()))
  in_range, col = _column(config, seq_id)
  return jnp.where(in_range, indexing.floor(state.hw[col], config.rings()), _i32(0))


def seq_new(config: CacheConfig, state: CacheState):
  """Makes the lowest non-live id live at position 0.

  Returns:
    `(state, status, id)`; `id = -1` and status NO_FREE_ID when every id is live.
  """
  _check(config, state)
  any_free, new_id = _lowest_free(state)
  live = state.live.at[new_id].set(jnp.where(any_free, 1, state.live[new_id]))
  status = jnp.where(any_free, _i32(Status.OK), _i32(Status.NO_FREE_ID))
  return dataclasses.replace(state, live=live), status, jnp.where(any_free, new_id, -1)


def seq_clone(config: CacheConfig, state: CacheState, src, upto=WHOLE):
  """Forks `src`'s first `min(upto, pos(src))` positions into the lowest free id.

  Flat layers copy the source's whole column (rows past the kept prefix are
  never read); ring layers copy the whole ring column. The fork inherits
  `hw(src)`, hence its floor. Paged flat layers (CONTRACT §3.1) share the
  source's full pages below `keep` and copy only the partial last page.

  Returns:
    `(state, status, id)`; `id = -1` on refusal (NOT_LIVE, EMPTY, BELOW_FLOOR,
    NO_ROOM, NO_FREE_ID, checked in that order).
  """
  _check(config, state, src=(src, ()), upto=(upto, ()))
  is_live, src_col = _is_live(config, state, src)
  keep = jnp.minimum(_i32(upto), jnp.where(is_live, state.pos[src_col], 0))
  any_free, dst = _lowest_free(state)
  pages, enough = {}, True
  if config.is_paged:
    pages, enough, partial = _pages.clone_pages(config, state, src_col, dst, keep)
  status = _first_failure([
      (~is_live, Status.NOT_LIVE),
      (keep <= 0, Status.EMPTY),
      (keep < floor(config, state, src_col), Status.BELOW_FLOOR),
      (state.held > config.capacity - keep, Status.NO_ROOM),
      (~any_free, Status.NO_FREE_ID),
      (~jnp.asarray(enough), Status.NO_ROOM),
  ])
  ok = status == Status.OK
  # A refused clone writes only the scratch column, which nothing reads.
  target = jnp.where(ok, dst, config.scratch_col)
  k, v = state.k, state.v
  if config.is_paged:
    # Full pages are shared; only the partial last page is copied (none on refusal).
    k, v = _pages.copy_page(config, state, partial[0], partial[1], ok & partial[2])
  copy = lambda arrays: tuple(a if config.is_paged_layer(l) else a.at[:, target].set(a[:, src_col])
                              for l, a in enumerate(arrays))
  new = _invalidated(
      config, state, k=copy(k), v=copy(v),
      live=state.live.at[dst].set(1), pos=state.pos.at[dst].set(keep),
      hw=state.hw.at[dst].set(state.hw[src_col]), held=state.held + keep, **pages)
  return _select_control(ok, new, state), status, jnp.where(ok, dst, -1)


def seq_rm(config: CacheConfig, state: CacheState, seq_id):
  """Removes a live sequence, releasing its budget (and its pages); `(state, status)`."""
  _check(config, state, seq_id=(seq_id, ()))
  is_live, col = _is_live(config, state, seq_id)
  new = _invalidated(
      config, state, live=state.live.at[col].set(0), pos=state.pos.at[col].set(0),
      hw=state.hw.at[col].set(0), held=state.held - state.pos[col],
      **_pages.fitted_pages(config, state, _pages.committed_extents(state).at[col].set(0)))
  status = jnp.where(is_live, _i32(Status.OK), _i32(Status.NOT_LIVE))
  return _select_control(is_live, new, state), status


def rewind(config: CacheConfig, state: CacheState, seq_id, position):
  """Keeps positions `[0, position)` of a live sequence; `hw` is unchanged.

  Paged storage (CONTRACT §3.1) releases the pages past `position`; ending
  inside a shared page, it copies that page into a free one (copy on write).

  Returns:
    `(state, status)`: NOT_LIVE, BAD_TARGET (`position < 0` or `> pos`),
    BELOW_FLOOR or NO_ROOM (paged: no free page for the copy, which no state
    the verbs produce allows) refuse, in that order.
  """
  _check(config, state, seq_id=(seq_id, ()), position=(position, ()))
  is_live, col = _is_live(config, state, seq_id)
  position = _i32(position)
  kept = jnp.clip(position, 0, state.pos[col])
  pages, enough = {}, True
  if config.is_paged:
    pages, enough, cow = _pages.rewind_pages(config, state, col, kept)
  status = _first_failure([
      (~is_live, Status.NOT_LIVE),
      ((position < 0) | (position > state.pos[col]), Status.BAD_TARGET),
      (position < floor(config, state, col), Status.BELOW_FLOOR),
      (~jnp.asarray(enough), Status.NO_ROOM),
  ])
  ok = status == Status.OK
  k, v = state.k, state.v
  if config.is_paged:
    k, v = _pages.copy_page(config, state, cow[0], cow[1], ok & cow[2])   # none on refusal
  new = _invalidated(config, state, k=k, v=v, pos=state.pos.at[col].set(position),
                     held=state.held - state.pos[col] + position, **pages)
  return _select_control(ok, new, state), status


def rewind_many(config: CacheConfig, state: CacheState, positions):
  """`rewind` of every sequence at once: each keeps positions `[0, positions[s])`.

  A serving step that verified several sequences' drafts rolls all their rejected
  tails back in one verb (a loop of `rewind`s would be a loop per step). `hw` is
  unchanged. It takes no page: over paged storage a target that would need a copy
  on write (it ends inside a page another sequence holds) is refused with NO_ROOM.
  A target inside the sequence's most recent step never does: every page a column
  holds at or past its step's start is its own (CONTRACT §3.1).

  Args:
    positions: `int32[max_seqs]`; `positions[s] == pos[s]` leaves `s` as it is (a
      sequence that is not live must be given its `pos`, 0).

  Returns:
    `(state, status)`: the first of BAD_TARGET (a position `< 0` or `> pos`, or a
    change on a sequence that is not live), BELOW_FLOOR, NO_ROOM (paged, above)
    over the sequences refuses the whole call, changing nothing.
  """
  _check(config, state, positions=(positions, (config.max_seqs,)))
  positions = _i32(positions)
  changed = positions != state.pos
  bad = changed & ((state.live != 1) | (positions < 0) | (positions > state.pos))
  below = changed & (positions < indexing.floor(state.hw, config.rings()))
  kept = jnp.clip(positions, 0, state.pos)
  pages, shared = {}, jnp.zeros_like(changed)
  if config.is_paged:
    table, refs = _pages.release_past(config, state.page_table, state.page_refs,
                                      jnp.where(state.live == 1, kept, 0))
    slot = jnp.minimum(kept // config.page_size, config.max_pages_per_seq - 1)
    page = jnp.take_along_axis(state.page_table[:config.max_seqs], slot[:, None], axis=1)[:, 0]
    # `refs[scratch] == 0`, so an unheld slot never counts as shared.
    shared = changed & (kept % config.page_size != 0) & (refs[page] > 1)
    pages = dict(page_table=table, page_refs=refs)
  status = _first_failure([(jnp.any(bad), Status.BAD_TARGET),
                           (jnp.any(below), Status.BELOW_FLOOR),
                           (jnp.any(shared), Status.NO_ROOM)])
  ok = status == Status.OK
  new = _invalidated(config, state, pos=kept, held=_held(state.live, kept), **pages)
  return _select_control(ok, new, state), status


def clear(config: CacheConfig, state: CacheState):
  """Drops every sequence and the step; storage keeps its shape and bytes."""
  _check(config, state)
  zeros = jnp.zeros((config.max_seqs,), jnp.int32)
  pages = {}
  if config.is_paged:
    pages = dict(page_table=jnp.full_like(state.page_table, config.scratch_page),
                 page_refs=jnp.zeros_like(state.page_refs))
  new = _invalidated(config, state, live=zeros, pos=zeros, hw=zeros, held=_i32(0),
                     step=empty_step(config), **pages)
  return new, _i32(Status.OK)


def _bad_blocks(config: CacheConfig, ids, n, blocks):
  """Whether the owner blocks break a rule of CONTRACT §9; also each token's block flag."""
  width = config.step_width
  tokens = jnp.arange(width, dtype=jnp.int32)
  starts, lengths = blocks[:, 0], blocks[:, 1]
  is_active = lengths != 0
  # Written so that no sum can overflow int32: n <= W here.
  in_range = (starts >= 0) & (lengths >= 1) & (starts <= n) & (lengths <= n - starts)
  ends = jnp.where(in_range, starts + lengths, 0)
  owner = ids[jnp.clip(starts, 0, width - 1)]
  in_block = (tokens[None, :] >= starts[:, None]) & (tokens[None, :] < ends[:, None])
  is_split = jnp.any(in_block & (ids[None, :] != owner[:, None]), axis=1)
  owner_after = jnp.any((tokens[None, :] >= ends[:, None]) & (tokens[None, :] < n)
                        & (ids[None, :] == owner[:, None]), axis=1)
  rows = jnp.arange(blocks.shape[0], dtype=jnp.int32)
  same_owner_twice = jnp.any(is_active[:, None] & is_active[None, :]
                             & (owner[:, None] == owner[None, :])
                             & (rows[:, None] < rows[None, :]))
  is_bad = jnp.any(is_active & (~in_range | is_split | owner_after)) | same_owner_twice
  block_flags = jnp.any(is_active[:, None] & in_block, axis=0).astype(jnp.int32)
  return is_bad, block_flags


def _too_long(config: CacheConfig, state: CacheState, is_real, cols):
  """Whether the step's tokens would take a live sequence past `max_seq_len`.

  Statically False without `max_seq_len` (or with it at `capacity`): the room
  check (`held + n <= capacity`) already bounds every sequence by `capacity`.
  """
  if config.seq_len_limit >= config.capacity:
    return False
  tokens = per_column(cols, is_real, config.max_seqs, op="sum")
  return jnp.any((state.live == 1) & (tokens > config.seq_len_limit - state.pos))


def declare_step(config: CacheConfig, state: CacheState, seq_ids, n, blocks):
  """Declares the next step's tokens; a refusal leaves any earlier declaration standing.

  Args:
    seq_ids: `int32[W]`; entry `i < n` is the sequence of step token `i`.
    n: `int32[]` real tokens.
    blocks: `int32[W, 2]` owner blocks `(start, length)`; length 0 = unused row.

  Returns:
    `(state, status)`: EMPTY, TOO_WIDE, NOT_LIVE, BAD_BLOCKS, NO_ROOM and
    TOO_LONG (a sequence would pass `config.max_seq_len`) refuse, checked in
    that order.
  """
  _check(config, state, seq_ids=(seq_ids, (config.step_width,)), n=(n, ()),
         blocks=(blocks, (config.step_width, 2)))
  ids, n, blocks = _i32(seq_ids), _i32(n), _i32(blocks)
  is_real = _plan.token_mask(config, n)
  in_range, cols = _column(config, ids)
  token_live = in_range & (state.live[cols] == 1)
  blocks_bad, block_flags = _bad_blocks(config, ids, n, blocks)
  status = _first_failure([
      (n <= 0, Status.EMPTY),
      (n > config.step_width, Status.TOO_WIDE),
      (jnp.any(is_real & ~token_live), Status.NOT_LIVE),
      (blocks_bad, Status.BAD_BLOCKS),
      (state.held > config.capacity - n, Status.NO_ROOM),
      (_too_long(config, state, is_real, cols), Status.TOO_LONG),
  ])
  new = dataclasses.replace(
      state, phase=_i32(Phase.DECLARED), decl_n=n,
      decl_ids=jnp.where(is_real, ids, config.max_seqs),
      decl_block=jnp.where(is_real, block_flags, 0))
  return _select_control(status == Status.OK, new, state), status


def _declared_positions(config: CacheConfig, state: CacheState):
  return _plan.derive_positions(config, state.decl_ids, state.decl_n, state.pos)


def rows_needed(config: CacheConfig, state: CacheState):
  """Flat rows the standing declaration needs (0 if none stands); int32."""
  _check(config, state)
  stands = (state.phase == Phase.DECLARED) | (state.phase == Phase.PREPARED)
  needed = _plan.rows_needed(config, state.decl_n, _declared_positions(config, state))
  return jnp.where(stands, needed, 0)


def prepare_step(config: CacheConfig, state: CacheState, positions=None):
  """Fixes positions and the Step, raises `hw`, and enters PREPARED.

  Args:
    positions: optional `int32[W]`; entries `< n` must equal the derived ones.

  Returns:
    `(state, status)`: NO_DECLARATION (IDLE or COMMITTED), BAD_POSITIONS, or
    NEEDS_ROWS (flat rows too few; grow first) refuse. In PREPARED it is a no-op.
    Paged storage (CONTRACT §3.1) takes the step's pages here (never copying
    one: a step's write pages are never shared); NO_ROOM if the pool ran out,
    which no state the verbs produce allows.
  """
  _check(config, state, **({} if positions is None else
                           {"positions": (positions, (config.step_width,))}))
  is_declared = state.phase == Phase.DECLARED
  is_prepared = state.phase == Phase.PREPARED
  derived = _declared_positions(config, state)
  is_real = _plan.token_mask(config, state.decl_n)
  positions_ok = True if positions is None else jnp.all(
      jnp.where(is_real, _i32(positions) == derived, True))
  needed = _plan.rows_needed(config, state.decl_n, derived)
  too_few_rows = config.has_flat & (needed > flat_rows(config, state))
  step = _plan.build_step(config, state.decl_ids, state.decl_block, state.decl_n, derived)
  ends = jnp.where(is_real, derived + 1, 0)
  # Each column's step end, for `hw` and for the pages (padding's scratch column counts nowhere).
  step_ends = per_column(step.seq_cols, ends, config.max_seqs, op="max")
  plan, enough = None, True
  if config.is_paged:
    plan = _pages.plan_step_pages(config, state, step_ends)
    enough = plan["enough"]
  status = _first_failure([
      (~(is_declared | is_prepared), Status.NO_DECLARATION),
      (~jnp.asarray(positions_ok), Status.BAD_POSITIONS),
      (is_declared & too_few_rows, Status.NEEDS_ROWS),
      (is_declared & ~jnp.asarray(enough), Status.NO_ROOM),
  ])
  ok = (status == Status.OK) & is_declared
  pages = {}
  if config.is_paged:
    # The page fields get the verdict here (nothing applied on refusal), so the
    # selection below need not touch the whole table.
    pages = _pages.apply_step_pages(config, state, plan, ok)
  new = dataclasses.replace(
      state, step=step, phase=_i32(Phase.PREPARED),
      attended=_no_layer_attended(config),
      hw=jnp.maximum(state.hw, step_ends))
  return dataclasses.replace(_select_control(ok, new, state), **pages), status


def run_narrow(config: CacheConfig, state: CacheState, width: int, fn):
  """Runs a prepared step's layers on its first `width` token slots.

  A step is `W` tokens wide; one that carries at most `width` real tokens (a
  decode step of a few sequences) can run its projections, attention and MLPs
  on `width` rows. `fn(view)` gets the state with a `width`-wide view of the
  step (`_plan.narrow`), must return `(out, view')` with `view'` from `attend`
  calls on `view`, and the full step and phase are put back afterwards, so
  `commit_step` and everything after it see the step as declared.

  Args:
    width: static int, `1 <= width <= W`.
    fn: `view -> (out, view')`, traced once.

  Returns:
    `(out, state, status)`: TOO_WIDE when the step carries more than `width`
    tokens; `fn` then sees a view that is not PREPARED, so every `attend` in
    it refuses and writes nothing (its outputs are zeros), and the returned
    state equals the given one but for nothing (K/V unchanged).
  """
  _check(config, state)
  if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= config.step_width:
    raise ValueError(f"width={width!r} must be a Python int in [1, W={config.step_width}]")
  fits = state.step.n_tokens <= width
  view = dataclasses.replace(state, step=_plan.narrow(state.step, width),
                             phase=jnp.where(fits, state.phase, _i32(Phase.IDLE)))
  out, view = fn(view)
  static_validate_state(config, view)
  status = jnp.where(fits, _i32(Status.OK), _i32(Status.TOO_WIDE))
  return out, dataclasses.replace(view, step=state.step, phase=state.phase), status


def commit_step(config: CacheConfig, state: CacheState):
  """Advances `pos` to the end of every causal segment; `(state, status)`.

  Owner-block segments advance nothing. Committing twice is a no-op (the max).
  Refusals, in this order, leave the state unchanged: NOT_PREPARED (IDLE or
  DECLARED), NOT_ATTENDED (PREPARED, but some layer was not served since
  `prepare_step`: committing would advance `pos` over positions whose K/V that
  layer never stored, so later steps would read stale or zero keys there).
  """
  _check(config, state)
  is_prepared = state.phase == Phase.PREPARED
  status = _first_failure([
      (~(is_prepared | (state.phase == Phase.COMMITTED)), Status.NOT_PREPARED),
      (is_prepared & jnp.any(state.attended == 0), Status.NOT_ATTENDED),
  ])
  ok = status == Status.OK
  cols, ends = _plan.committed_ends(config, state.step)
  pos = jnp.maximum(state.pos, per_column(cols, ends, config.max_seqs, op="max"))
  new = dataclasses.replace(state, pos=pos, held=_held(state.live, pos),
                            phase=_i32(Phase.COMMITTED))
  return _select_control(ok, new, state), status
