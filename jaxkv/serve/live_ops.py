"""The incremental API's device-side helpers (jitted, the `LoopState` donated), outside the loop.

They run in the device's order between loop entries, so the host can queue them
behind an entry still in flight without knowing what that entry did:

- `enqueue` appends requests to the device queue (a ring: `columns.head_slot`)
  and clears their output rows: only the new requests travel, not the queue
  (`enqueue_batches` packs them on the host, in few shapes).
- `abort_rows` removes what aborted requests hold, found on the device by their
  output rows: the columns writing to them (`jaxkv.pure.seq_rm` on each, and the
  columns' `used/active/done/reserve/forks/hold/parked` cleared; a parked column
  has no sequence to remove), and the queue slots of requests not yet admitted
  (the ring closes over them, keeping its order).
- `snapshot` packs what the host reads after an entry into one vector.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig, Status, pure
from jaxkv.serve.columns import fork_ready, update
from jaxkv.serve.loop import _wanted
from jaxkv.serve.results import PAGED_COUNTERS
from jaxkv.serve.requests import Request
from jaxkv.serve.state import NO_ROW, LoopState, Queue, _bucket, merge_status, pack_queue


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


def _queue_fields(q: Queue) -> list[str]:
  """The queue's per-slot fields (every leaf but the `next/copies/count` counters)."""
  return [f.name for f in dataclasses.fields(q) if f.name not in ("next", "copies", "count")]


def _abort_rows(config: CacheConfig, ls: LoopState, column_rows, queue_rows):
  """Removes the used columns writing to `column_rows` and the queued requests whose
  first output row is in `queue_rows` (both `bool[R]`)."""
  rows = column_rows.shape[0]
  c = ls.cols
  ls = _abort_columns(config, ls, (c.used == 1) & column_rows[jnp.clip(c.out_row, 0, rows - 1)])
  q = ls.queue
  size = q.prompt_len.shape[0]
  j = jnp.arange(size, dtype=jnp.int32)
  src = (q.next + j) % size                      # ring order from the head
  queued = j < q.count - q.next
  cancel = queued & queue_rows[jnp.clip(q.out_base[src], 0, rows - 1)]
  keep = queued & ~cancel
  # Kept requests close up in order; the rest of the ring is left as it was (unread).
  dest = jnp.where(keep, (q.next + jnp.cumsum(keep, dtype=jnp.int32) - 1) % size, size)
  moved = {name: getattr(q, name).at[dest].set(getattr(q, name)[src], mode="drop")
           for name in _queue_fields(q)}
  # A partly admitted head that is aborted takes its admitted copies' count with it.
  queue = dataclasses.replace(q, **moved, count=q.next + keep.sum(dtype=jnp.int32),
                              copies=jnp.where(cancel[0], 0, q.copies))
  return dataclasses.replace(ls, queue=queue)


abort_rows = jax.jit(_abort_rows, static_argnums=0, donate_argnums=1)


@functools.partial(jax.jit, donate_argnums=0)
def enqueue(ls: LoopState, tokens, arrays: dict, num):
  """Appends the first `num` of `B` requests to the device queue and clears their rows.

  Args:
    ls: the `LoopState` (donated).
    tokens: `int32[T]` the requests' prompts back to back.
    arrays: the queue's per-slot fields but `prompt` for `B >= num` requests
      (`pack_queue`'s, with `out_base`/`lp_base`), and `prompt_start`: `int32[B]`
      where each prompt starts in `tokens`. The requests go to slots
      `count, count + 1, ...` (mod `Q`), their prompts zero padded to `L`; each
      request's output rows `[out_base, out_base + n)` get
      `Outputs.length/stop/done = 0` before their reuse.
    num: `int32[]` the requests to append.

  Only the new tokens travel, in few shapes (`B` fixed, `T` a power of two).
  """
  q, o = ls.queue, ls.out
  size, max_len = q.prompt.shape
  batch = arrays["prompt_len"].shape[0]
  k = jnp.arange(batch, dtype=jnp.int32)
  real = k < num
  slots = jnp.where(real, (q.count + k) % size, size)
  at = jnp.arange(max_len, dtype=jnp.int32)[None, :]
  flat = jnp.clip(arrays["prompt_start"][:, None] + at, 0, tokens.shape[0] - 1)
  prompt = jnp.where(at < arrays["prompt_len"][:, None], tokens[flat], 0)
  values = dict(arrays, prompt=prompt)
  written = {name: getattr(q, name).at[slots].set(values[name].astype(getattr(q, name).dtype),
                                                  mode="drop") for name in _queue_fields(q)}
  queue = dataclasses.replace(q, **written, count=q.count + num)
  r = jnp.arange(o.length.shape[0], dtype=jnp.int32)[:, None]
  base, n = arrays["out_base"][None, :], arrays["n"][None, :]
  clear = jnp.any(real[None, :] & (r >= base) & (r < base + n), axis=1)
  zero = lambda a: jnp.where(clear, 0, a)
  out = dataclasses.replace(o, length=zero(o.length), stop=zero(o.stop), done=zero(o.done))
  return dataclasses.replace(ls, queue=queue, out=out)


# Requests per `enqueue` call, and the fewest prompt tokens it carries: fixed, so one compiled
# enqueue serves every burst (a longer prompt gets a power-of-two buffer).
ENQUEUE_BATCH = 32
ENQUEUE_TOKENS = 8192


def enqueue_batches(requests, bases, *, max_stop: int, num_logprobs: int, grammar_starts=None):
  """`enqueue`'s host arguments `(tokens, arrays, num)` for checked `requests` whose output rows
  start at `bases` (and whose automata start at `grammar_starts`, -1: none): calls of at most
  `ENQUEUE_BATCH` requests and, unless a prompt alone is longer, `ENQUEUE_TOKENS` prompt
  tokens."""
  chunk, total = [], 0
  starts = [-1] * len(requests) if grammar_starts is None else grammar_starts
  for request, base, start in zip(requests, bases, starts):
    if chunk and (len(chunk) == ENQUEUE_BATCH or total + len(request.prompt) > ENQUEUE_TOKENS):
      yield _enqueue_arrays(chunk, max_stop, num_logprobs)
      chunk, total = [], 0
    chunk.append((request, base, start))
    total += len(request.prompt)
  if chunk:
    yield _enqueue_arrays(chunk, max_stop, num_logprobs)


def _enqueue_arrays(chunk, max_stop: int, num_logprobs: int):
  starts = [start for _, _, start in chunk]
  chunk = [(r, base) for r, base, _ in chunk]
  num = len(chunk)
  lengths = [len(r.prompt) for r, _ in chunk]
  tokens = np.zeros((max(ENQUEUE_TOKENS, _bucket(sum(lengths))),), np.int32)
  tokens[:sum(lengths)] = [tok for r, _ in chunk for tok in r.prompt]
  # The per-request fields as `pack_queue` makes them; the prompts travel in `tokens`.
  params = [r.params for r, _ in chunk] + [Request((0,)).params] * (ENQUEUE_BATCH - num)
  arrays = pack_queue([()] * ENQUEUE_BATCH, params, max_len=1, max_stop=max_stop,
                      num_logprobs=num_logprobs, grammar_starts=starts + [-1] * (
                          ENQUEUE_BATCH - num)).arrays
  del arrays["prompt"]
  arrays["prompt_len"][:num] = lengths
  arrays["prompt_start"] = np.zeros((ENQUEUE_BATCH,), np.int32)
  arrays["prompt_start"][:num] = np.cumsum([0] + lengths[:-1])
  arrays["out_base"][:num] = [base for _, base in chunk]
  # Logprob rows are the output rows (the incremental API's window has `out_rows` rows).
  arrays["lp_base"] = np.full((ENQUEUE_BATCH,), NO_ROW, np.int32)
  arrays["lp_base"][:num] = [base if r.params.logprobs is not None else NO_ROW for r, base in chunk]
  return tokens, arrays, num


# The scalars `snapshot` packs first, in this order (the paged counters follow).
SNAPSHOT_SCALARS = ("status", "steps", "step_tokens", "occupancy", "peak_rows", "draft_tokens",
                    "accepted_tokens")
# Column counts the host decides stepping from (`LiveQueue`: when the admission block is due,
# which width the next step takes), packed after the queue's counters.
SNAPSHOT_COLUMNS = ("cols_active", "cols_done", "cols_forking", "cols_parked", "wanted")


@functools.partial(jax.jit, static_argnums=(1, 2))
def snapshot(ls: LoopState, window: int, speculative: bool = False):
  """Everything the host reads after a loop entry, as one `int32` vector (one transfer).

  Layout: `SNAPSHOT_SCALARS`, the paged counters, the queue's `next`,
  `copies` and `count`, `SNAPSHOT_COLUMNS` (columns running, finished, ready to
  fork, parked; tokens wanted), `width_steps`, then per column `used`, `out_row`, `fed`, per
  output row `out_done`, `out_len`, `out_stop` (`Outputs.done/length/stop`),
  and each output row's last `window` tokens
  (`Outputs.tokens[r, out_len - window : out_len]`, clipped at 0):
  a loop entry of at most `window` steps adds at most that many tokens to a row,
  so the host finds every new token there without reading `out_tokens` whole.
  `speculative` (an engine that drafts): then each output row's `draft_tokens`,
  `accepted_tokens` and `draft_rounds` follow, the finished sample's `Speculation`.
  """
  scalars = [getattr(ls, f) for f in SNAPSHOT_SCALARS + PAGED_COUNTERS]
  scalars += [ls.queue.next, ls.queue.copies, ls.queue.count]
  c, o = ls.cols, ls.out
  scalars += [(c.active == 1).sum(), (c.done == 1).sum(), fork_ready(c).sum(),
              (c.parked == 1).sum(), _wanted(c).sum()]
  max_new = o.tokens.shape[1]
  at = jnp.clip(o.length[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None, :],
                0, max_new - 1)
  last = jnp.take_along_axis(o.tokens, at, axis=1)
  i32 = lambda a: jnp.ravel(a).astype(jnp.int32)
  drafts = [i32(o.draft_tokens), i32(o.accepted_tokens), i32(o.draft_rounds)] if speculative else []
  return jnp.concatenate([i32(jnp.stack(scalars)), i32(ls.width_steps), i32(c.used),
                          i32(c.out_row), i32(c.fed), i32(o.done), i32(o.length),
                          i32(o.stop), i32(last), *drafts])


def unpack_snapshot(vec, *, num_widths: int, columns: int, rows: int, window: int,
                    speculative: bool = False) -> dict:
  """The host dict of a `snapshot` vector (NumPy views; `last` is `[rows, window]`)."""
  names = SNAPSHOT_SCALARS + PAGED_COUNTERS + ("next", "copies", "count") + SNAPSHOT_COLUMNS
  host = {name: int(v) for name, v in zip(names, vec[:len(names)])}
  at = len(names)
  for name, size in (("width_steps", num_widths), ("used", columns), ("out_row", columns),
                     ("fed", columns), ("out_done", rows), ("out_len", rows), ("out_stop", rows)):
    host[name] = vec[at:at + size]
    at += size
  host["last"] = vec[at:at + rows * window].reshape(rows, window)
  at += rows * window
  if speculative:
    for name in ("out_draft", "out_accepted", "out_rounds"):
      host[name] = vec[at:at + rows]
      at += rows
  return host
