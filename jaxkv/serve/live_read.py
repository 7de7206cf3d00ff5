"""How `LiveQueue` (`live.py`) reads a loop entry back: its snapshot, then the deltas.

`SnapshotReader` holds the two methods `LiveQueue` inherits for this: `_read`
blocks on the entry in flight and reads its snapshot (stats, status,
admissions), `_deltas` turns it into each sample's `Delta` (new tokens, finish
reasons, host-side stop tokens, logprobs). The queue bookkeeping they update
(`_tracked`, `_queued`, `_lock`, ...) is `LiveQueue`'s.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxkv import Status
from jaxkv.serve.live_ops import unpack_snapshot
from jaxkv.serve.results import Delta, read_paged_counters, token_logprobs


class SnapshotReader:
  """`LiveQueue`'s reading of a loop entry (mixed into `LiveQueue`)."""

  def _read(self) -> tuple[dict, int, int]:
    """Blocks on the entry in flight and reads its snapshot: admissions, stats and status.

    Returns the host dict, the snapshot's token window and the number of queue
    slots the entry admitted, for `_deltas`.
    """
    (vec, window, k), self._pending = self._pending, None
    engine = self.engine
    host = unpack_snapshot(np.asarray(vec), num_widths=len(engine.widths),
                           columns=engine.config.max_seqs, rows=self.out_rows, window=window)
    self._host = host
    stats = engine.stats
    stats.steps, stats.step_tokens = int(host["steps"]), int(host["step_tokens"])
    stats.occupancy, stats.peak_rows = int(host["occupancy"]), int(host["peak_rows"])
    stats.width_steps = {w: int(c) for w, c in zip(engine.widths, host["width_steps"])}
    read_paged_counters(stats, host)
    self.held = int(np.where(host["used"] == 1, host["fed"], 0).sum())
    if int(host["status"]) != Status.OK:
      raise RuntimeError(f"the cache refused a step: {Status(int(host['status'])).name}")
    newly = int(host["next"]) - self._dev_next
    spent = int(host["steps"]) - self._steps_seen >= k   # the entry ended on its budget
    if self._queued and not newly and not spent and not (host["used"] == 1).any():
      raise RuntimeError(f"request {self._queued[0]!r} cannot be admitted into an empty engine")
    now = time.perf_counter()
    with self._lock:
      admitted, self._queued = self._queued[:newly], self._queued[newly:]
      self._dev_next = int(host["next"])
      self._head_copies = int(host["copies"])
      for rid in admitted + self._queued[:1 if self._head_copies else 0]:
        t = self._tracked.get(rid)
        if t is not None and t.admitted is None:
          t.admitted = now
          self.waiting_tokens -= len(t.request.prompt)
    return host, window, newly

  def _deltas(self, host: dict, window: int, newly: int, *, defer_cuts: bool) -> list[Delta]:
    """The deltas of the entry `host` was read from: new tokens, finishes, host-side stops.

    With `defer_cuts` (an entry is in flight), the columns of samples cut at a
    host-side stop token are removed at the next dispatch instead of now.
    """
    engine = self.engine
    ls = engine.state
    now = time.perf_counter()
    stats = engine.stats
    out = lps = None
    deltas, cut_rows = [], []
    with self._lock:
      for rid, t in list(self._tracked.items()):
        if t.admitted is None:
          continue
        for j in range(t.n):
          row = t.base + j
          if t.finished[j] or host["out_len"][row] <= t.emitted[j] and not host["out_done"][row]:
            continue
          count = int(host["out_len"][row]) - t.emitted[j]
          if count <= window:
            new = host["last"][row, window - count:].tolist() if count > 0 else []
          else:   # more tokens than one entry adds (not expected): read the row itself
            if out is None:
              out = np.asarray(jax.device_get(ls.out.tokens))
            new = out[row, t.emitted[j]:int(host["out_len"][row])].tolist()
          reason = None
          if host["out_done"][row]:
            reason = "stop" if host["out_stop"][row] else "length"
          hit = next((i for i, tok in enumerate(new) if tok in t.host_stops), None)
          if hit is not None:
            new, reason = new[:hit + 1], "stop"
            if not host["out_done"][row]:
              cut_rows.append(row)
          logprobs = None
          if t.request.params.logprobs is not None:
            if lps is None:
              lps = jax.device_get((ls.out.logprob, ls.out.top_ids, ls.out.top_logprobs))
            logprobs = tuple(token_logprobs(lps, row, new, range(t.emitted[j],
                                                                 t.emitted[j] + len(new)),
                                            t.request.params.logprobs))
          t.emitted[j] += len(new)
          stats.generated += len(new)
          if new and t.first_token is None:
            t.first_token = now
          t.finished[j] = reason is not None
          deltas.append(Delta(rid, j, tuple(new), reason, t.request.params.seed,
                              logprobs=logprobs))
        if all(t.finished):
          deltas[-1] = dataclasses.replace(deltas[-1], timing=self._release(rid))
    if defer_cuts:
      self._cut_rows.extend(cut_rows)
    else:
      self._remove_columns(self._columns_of(cut_rows))
    if not deltas and not newly and int(host["steps"]) == self._steps_seen and not self._waiting:
      raise RuntimeError("the loop made no progress (nothing admitted, stepped or finished)")
    self._steps_seen = int(host["steps"])
    return deltas
