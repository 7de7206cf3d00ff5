"""The incremental API's device-side helpers (jitted), outside the serving loop.

`abort_columns` (the `LoopState` donated) removes aborted requests' columns
between loop entries: `jaxkv.pure.seq_rm` on each, and the loop's
`used/active/done/reserve/forks/hold/parked` cleared (a parked column has no
sequence to remove), so the next admission finds
their columns and reserved room free. `clear_rows` resets output rows before
the host hands them to a new request.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve.state import LoopState


def _abort_columns(config: CacheConfig, ls: LoopState, mask):
  """Removes every used column in `mask` (`bool[S]`) and clears its bookkeeping."""

  def body(carry):
    ls, mask = carry
    col = jnp.argmax(mask & (ls.used == 1)).astype(jnp.int32)
    # A parked column (paged storage, preempted) has no sequence to remove.
    is_parked = ls.parked[col] == 1
    cache, status = pure.seq_rm(config, ls.cache, jnp.where(is_parked, -1, col))
    status = jnp.where(is_parked, Status.OK, status)
    off = lambda a, v=0: a.at[col].set(v)
    ls = dataclasses.replace(
        ls, cache=cache, used=off(ls.used), active=off(ls.active), done=off(ls.done),
        reserve=off(ls.reserve), forks=off(ls.forks), hold=off(ls.hold, ls.tokens.shape[1]),
        parked=off(ls.parked),
        status=jnp.where((status == Status.OK) | (ls.status != Status.OK), ls.status, status))
    return ls, mask.at[col].set(False)

  cond = lambda carry: jnp.any(carry[1] & (carry[0].used == 1)) & (carry[0].status == Status.OK)
  return jax.lax.while_loop(cond, body, (ls, mask))[0]


abort_columns = jax.jit(_abort_columns, static_argnums=0, donate_argnums=1)


@jax.jit
def clear_rows(out_len, out_stop, out_done, clear):
  """Zeroes `out_len/out_stop/out_done` at the rows in `clear` (`bool[R]`) before their reuse."""
  zero = lambda a: jnp.where(clear, 0, a)
  return zero(out_len), zero(out_stop), zero(out_done)
