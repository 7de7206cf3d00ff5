"""How `LiveQueue` (`live.py`) reads a loop entry back: its snapshot, then the deltas.

`EntryReader.read_oldest` takes the oldest uncollected entry, reads its
snapshot (stats, status, the queue's counters, each output row's length and
last tokens) and turns it into each sample's `Delta` (new tokens, finish
reasons, host-side stop tokens, logprobs), updating the `Ledger` the queue
shares with it. It may run on its own thread while the driver dispatches the
next entry: it reads only the entry's snapshot, never the loop state, unless
no other entry is in flight (logprobs).
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import numpy as np

from jaxkv import Status
from jaxkv.serve.live_ops import SNAPSHOT_COLUMNS, unpack_snapshot
from jaxkv.serve.live_records import Seen
from jaxkv.serve.results import (Delta, Speculation, logprob_buffers, read_paged_counters,
                                 token_logprobs)


class Entry(NamedTuple):
  """One dispatched loop entry, until `collect` reads it."""
  vec: object         # its `live_ops.snapshot` (a device array)
  window: int         # tokens per output row in the snapshot
  steps: int          # its step budget
  index: int          # entries dispatched before it on this state
  enqueued: int       # requests appended to the device queue before it was dispatched
  admit: bool = True  # it ran the admission block (a loop entry always does)
  width_total: int = 0      # `Ledger.width_total` and `steps_total` after its steps were dispatched
  steps_total: int = 0
  enqueued_tokens: int = 0  # `Ledger.enqueued_tokens` when it was dispatched


class EntryReader:
  """Reads `LiveQueue`'s entries back in order, updating its `Ledger` (module docstring).

  Args:
    ledger: the incremental API's `Ledger` (`live_records.py`).
    engine: the `Engine`: its stats, geometry and core (`EngineCore`, for reads of the
      state itself).
    out_rows: the output rows `R` of the loop state.
  """

  def __init__(self, ledger, engine, out_rows: int):
    self.ledger, self.engine, self.out_rows = ledger, engine, out_rows

  def read_oldest(self) -> list:
    """The deltas of the oldest uncollected entry ([] if none), waiting for the device.

    Raises:
      RuntimeError: the cache refused a step in that entry (its status), or a request
        cannot be admitted into an empty engine.
    """
    ledger = self.ledger
    with ledger.lock:
      if not ledger.pending:
        return []
      entry = ledger.pending[0]
    engine = self.engine
    host = unpack_snapshot(np.asarray(entry.vec), num_widths=len(engine.widths),
                           columns=engine.config.max_seqs, rows=self.out_rows,
                           window=entry.window, speculative=engine.speculative is not None)
    with ledger.changed:
      ledger.pending.popleft()
      ledger.changed.notify_all()
    self._read_counters(host, entry)
    return self._deltas(host, entry)

  def _read_counters(self, host: dict, entry) -> None:
    """Stats, status and the device queue's length from `host` (entry `entry`'s snapshot)."""
    engine = self.engine
    stats = engine.stats
    stats.steps, stats.step_tokens = int(host["steps"]), int(host["step_tokens"])
    stats.occupancy, stats.peak_rows = int(host["occupancy"]), int(host["peak_rows"])
    stats.draft_tokens, stats.accepted_tokens = (int(host["draft_tokens"]),
                                                 int(host["accepted_tokens"]))
    stats.width_steps = {w: int(c) for w, c in zip(engine.widths, host["width_steps"])}
    read_paged_counters(stats, host)
    if int(host["status"]) != Status.OK:
      raise RuntimeError(f"the cache refused a step: {Status(int(host['status'])).name}")
    used = host["used"] == 1
    queued = int(np.int32(host["count"] - host["next"]))   # int32 counters: a wrap is harmless
    advanced = int(np.int32(host["steps"] - self.ledger.steps_seen))
    spent = advanced >= entry.steps   # it ended on its budget
    if entry.admit and queued and not spent and not used.any() and not host["copies"]:
      raise RuntimeError("a request cannot be admitted into an empty engine")
    with self.ledger.lock:
      self.ledger.seen = Seen(entry.index, *(int(host[k]) for k in SNAPSHOT_COLUMNS),
                              stalled=not spent, width_total=entry.width_total,
                              steps_total=entry.steps_total,
                              enqueued_tokens=entry.enqueued_tokens)
      self.ledger.held = int(np.where(used, host["fed"], 0).sum())
      self.ledger.settle_held()
      self.ledger.queued_seen, self.ledger.enqueued_seen = queued, entry.enqueued
      self.ledger.steps_seen = int(host["steps"])

  def _deltas(self, host: dict, entry) -> list:
    """The deltas of `entry`, read from `host`: admissions, new tokens, finishes, host-side stops.

    Only requests appended before the entry was dispatched are read (a later one
    may hold rows an earlier request left).
    """
    engine = self.engine
    window = entry.window
    now = time.perf_counter()
    stats = engine.stats
    out = lps = None
    out_len, out_done = host["out_len"], host["out_done"]
    # A request is admitted once a column writes one of its rows, or a row has output.
    started = (out_len > 0) | (out_done != 0)
    started[host["out_row"][(host["used"] == 1) & (host["out_row"] >= 0)
                            & (host["out_row"] < self.out_rows)]] = True
    # Python lists: read per sample below, where indexing NumPy arrays costs a scalar object each.
    lengths, done, stops = out_len.tolist(), out_done.tolist(), host["out_stop"].tolist()
    last, generated = host["last"].tolist(), 0
    deltas = []
    with self.ledger.lock:
      for rid, t in list(self.ledger.tracked.items()):
        if t.base < 0 or t.entry > entry.index:
          continue
        if t.admitted is None:
          if not started[t.base:t.base + t.n].any():
            continue
          t.admitted = now
          self.ledger.waiting_tokens -= len(t.request.prompt)
          self.ledger.unadmitted -= 1
        emitted, finished, params = t.emitted, t.finished, t.request.params
        for j in range(t.n):
          row = t.base + j
          length, is_done = lengths[row], done[row]
          if finished[j] or length <= emitted[j] and not is_done:
            continue
          count = length - emitted[j]
          if count <= window:
            new = last[row][window - count:] if count > 0 else []
          else:   # more tokens than one entry adds (only when no entry is in flight behind it)
            assert not self.ledger.pending, "an entry added more tokens than its snapshot holds"
            if out is None:
              out = np.asarray(engine.core.read(lambda ls: ls.out.tokens))
            new = out[row, emitted[j]:length].tolist()
          reason = None
          if is_done:
            reason = "stop" if stops[row] else "length"
          if t.host_stops:
            hit = next((i for i, tok in enumerate(new) if tok in t.host_stops), None)
            if hit is not None:
              new, reason = new[:hit + 1], "stop"
              if not is_done:
                self.ledger.cut_rows.append(row)   # its column goes at the next dispatch
          logprobs = None
          if params.logprobs is not None:
            if lps is None:   # read from the state: no entry is in flight behind this one
              lps = engine.core.read(logprob_buffers)
            logprobs = tuple(token_logprobs(lps, row, new, range(emitted[j],
                                                                 emitted[j] + len(new)),
                                            params.logprobs))
          emitted[j] += len(new)
          generated += len(new)
          if new and t.first_token is None:
            t.first_token = now
          finished[j] = reason is not None
          speculation = None
          if finished[j] and "out_draft" in host:
            speculation = Speculation(int(host["out_draft"][row]), int(host["out_accepted"][row]),
                                      int(host["out_rounds"][row]))
          deltas.append(Delta(rid, j, tuple(new), reason, params.seed, logprobs=logprobs,
                              speculation=speculation))
        if all(finished):
          timing = self.ledger.release(rid)
          if deltas and deltas[-1].request_id == rid:
            deltas[-1] = dataclasses.replace(deltas[-1], timing=timing)
    stats.generated += generated
    return deltas
