"""The incremental API's device-side helpers (jitted), outside the serving loop.

`abort_columns` (the `LoopState` donated) removes aborted requests' columns
between loop entries: `jaxkv.pure.seq_rm` on each, and the columns'
`used/active/done/reserve/forks/hold/parked` cleared (a parked column has no
sequence to remove), so the next admission finds
their columns and reserved room free. `clear_rows` resets output rows before
the host hands them to a new request.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve.columns import update
from jaxkv.serve.results import PAGED_COUNTERS
from jaxkv.serve.state import LoopState, merge_status


def _abort_columns(config: CacheConfig, ls: LoopState, mask):
  """Removes every used column in `mask` (`bool[S]`) and clears its bookkeeping."""

  def body(carry):
    ls, mask = carry
    c = ls.cols
    col = jnp.argmax(mask & (c.used == 1)).astype(jnp.int32)
    # A parked column (paged storage, preempted) has no sequence to remove.
    is_parked = c.parked[col] == 1
    cache, status = pure.seq_rm(config, ls.cache, jnp.where(is_parked, -1, col))
    cols = update(c, col, used=0, active=0, done=0, reserve=0, forks=0, hold=c.tokens.shape[1],
                  parked=0)
    ls = dataclasses.replace(ls, cache=cache, cols=cols,
                             status=merge_status(ls.status, status, ~is_parked))
    return ls, mask.at[col].set(False)

  cond = lambda carry: (jnp.any(carry[1] & (carry[0].cols.used == 1))
                        & (carry[0].status == Status.OK))
  return jax.lax.while_loop(cond, body, (ls, mask))[0]


abort_columns = jax.jit(_abort_columns, static_argnums=0, donate_argnums=1)


@jax.jit
def clear_rows(out_len, out_stop, out_done, clear):
  """Zeroes `out_len/out_stop/out_done` at the rows in `clear` (`bool[R]`) before their reuse."""
  zero = lambda a: jnp.where(clear, 0, a)
  return zero(out_len), zero(out_stop), zero(out_done)


# The scalars `snapshot` packs first, in this order (the paged counters follow).
SNAPSHOT_SCALARS = ("status", "steps", "step_tokens", "occupancy", "peak_rows")


@functools.partial(jax.jit, static_argnums=1)
def snapshot(ls: LoopState, window: int):
  """Everything the host reads after a loop entry, as one `int32` vector (one transfer).

  Layout: `SNAPSHOT_SCALARS`, the paged counters, the queue's `next` and
  `copies`, `width_steps`, then per column `used`, `out_row`, `fed`, per
  output row `out_done`, `out_len`, `out_stop` (`Outputs.done/length/stop`),
  and each output row's last `window` tokens
  (`Outputs.tokens[r, out_len - window : out_len]`, clipped at 0):
  a loop entry of at most `window` steps adds at most that many tokens to a row,
  so the host finds every new token there without reading `out_tokens` whole.
  """
  scalars = [getattr(ls, f) for f in SNAPSHOT_SCALARS + PAGED_COUNTERS]
  scalars += [ls.queue.next, ls.queue.copies]
  c, o = ls.cols, ls.out
  max_new = o.tokens.shape[1]
  at = jnp.clip(o.length[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None, :],
                0, max_new - 1)
  last = jnp.take_along_axis(o.tokens, at, axis=1)
  i32 = lambda a: jnp.ravel(a).astype(jnp.int32)
  return jnp.concatenate([i32(jnp.stack(scalars)), i32(ls.width_steps), i32(c.used),
                          i32(c.out_row), i32(c.fed), i32(o.done), i32(o.length),
                          i32(o.stop), i32(last)])


def unpack_snapshot(vec, *, num_widths: int, columns: int, rows: int, window: int) -> dict:
  """The host dict of a `snapshot` vector (NumPy views; `last` is `[rows, window]`)."""
  names = SNAPSHOT_SCALARS + PAGED_COUNTERS + ("next", "copies")
  host = {name: int(v) for name, v in zip(names, vec[:len(names)])}
  at = len(names)
  for name, size in (("width_steps", num_widths), ("used", columns), ("out_row", columns),
                     ("fed", columns), ("out_done", rows), ("out_len", rows), ("out_stop", rows)):
    host[name] = vec[at:at + size]
    at += size
  host["last"] = vec[at:at + rows * window].reshape(rows, window)
  return host
