"""`Engine.run`'s client of the engine core: a known queue, served in long loop entries.

`serve_queue` packs the whole queue onto the device (`EngineCore.start`), grows
flat rows once for its longest request, then enters the loop until every
sample has finished, reading back after each entry only what it needs: the
counters, and the output rows of samples that finished since.
"""

from __future__ import annotations

import time

import numpy as np

from jaxkv import Status
from jaxkv.serve.admission import plain_greedy
from jaxkv.serve.errors import EngineError
from jaxkv.serve.results import (PAGED_COUNTERS, Completion, RequestTiming, Speculation,
                                 logprob_buffers, read_paged_counters, token_logprobs)
from jaxkv.serve.state import pack_queue
from jaxkv.serve.timing import compile_seconds


def _progress(ls) -> dict:
  """What the host reads after every entry: counters, and per output row its progress."""
  o = ls.out
  return {k: getattr(ls, k) for k in (
      "steps", "step_tokens", "occupancy", "status", "peak_rows", "width_steps",
      "draft_tokens", "accepted_tokens", *PAGED_COUNTERS)} | {
          "out_done": o.done, "out_len": o.length, "out_stop": o.stop, "out_admitted": o.admitted,
          "out_first": o.first, "out_finished": o.finished, "out_drafted": o.draft_tokens,
          "out_accepted": o.accepted_tokens, "out_rounds": o.draft_rounds,
          "active": ls.cols.active,
          "used": ls.cols.used, "next": ls.queue.next}


def serve_queue(engine, requests, on_progress, grammars) -> list[Completion]:
  """Serves checked `requests` (in admission order) on `engine.core`; the completions.

  `grammars` is `(pool, {automaton.identity: initial state})` of the requests' automata
  (`Engine.pack_grammars`). Updates `engine.stats` and `engine.completions` as entries
  finish (`Engine.run` documents the contract: failures raise `EngineError` with what
  finished).
  """
  core, stats = engine.core, engine.stats
  started, compiled = time.perf_counter(), compile_seconds()
  pool, initial = grammars
  host_queue = pack_queue([r.prompt for r in requests], [r.params for r in requests],
                          max_len=engine.max_len, max_stop=engine.max_stop,
                          num_logprobs=engine.max_logprobs, grammar=pool,
                          grammar_starts=[-1 if r.params.grammar is None
                                          else initial[r.params.grammar.identity] for r in requests])
  # Queue and output rows are padded to powers of two (the output's token axis is
  # `max_len`), so the loop compiles once per size class, not once per queue.
  core.start(host_queue)
  core.grow_for(requests)
  owner, lp_rows = {}, {}
  for r in requests:
    base = len(owner)
    for j in range(r.params.n):
      owner[base + j] = (r, j)
      if r.params.logprobs is not None:   # pack_queue's order: logprob rows in queue order
        lp_rows[base + j] = len(lp_rows)
  greedy = all(plain_greedy(r.params) for r in requests)
  collected = np.zeros((host_queue.rows,), bool)
  collected[len(owner):] = True   # padding rows
  step_counts = []   # (completion, admitted, first token, finished) for its timing
  stats.setup_seconds = time.perf_counter() - started
  steps_before = 0   # a fresh loop state counts from 0
  try:
    while True:
      entered = time.perf_counter()
      core.enter(engine.max_steps, greedy=greedy)
      stats.loop_entries += 1
      host = core.read(_progress)
      stats.loop_seconds += time.perf_counter() - entered
      new_rows = np.flatnonzero(host["out_done"].astype(bool) & ~collected)
      new_results = []
      if new_rows.size:
        out = np.asarray(core.read(lambda ls: ls.out.tokens))
        lps = None
        for row in new_rows:
          request, index = owner[int(row)]
          n_tok = int(host["out_len"][row])
          logprobs = None
          if request.params.logprobs is not None:
            if lps is None:
              lps = core.read(logprob_buffers)
            logprobs = token_logprobs(lps, lp_rows[int(row)], out[row, :n_tok], range(n_tok),
                                      request.params.logprobs)
          new_results.append(Completion(request.request_id, index, request.prompt,
                                        out[row, :n_tok].tolist(),
                                        "stop" if host["out_stop"][row] else "length",
                                        request.params.seed, logprobs=logprobs))
          if engine.speculative is not None:
            new_results[-1].speculation = Speculation(
                int(host["out_drafted"][row]), int(host["out_accepted"][row]),
                int(host["out_rounds"][row]))
          step_counts.append((new_results[-1], int(host["out_admitted"][row]),
                              int(host["out_first"][row]), int(host["out_finished"][row])))
        collected[new_rows] = True
        engine.completions.extend(new_results)
      stats.steps, stats.step_tokens = int(host["steps"]), int(host["step_tokens"])
      stats.occupancy, stats.peak_rows = int(host["occupancy"]), int(host["peak_rows"])
      stats.width_steps = {w: int(c) for w, c in zip(engine.widths, host["width_steps"])}
      read_paged_counters(stats, host)
      stats.draft_tokens, stats.accepted_tokens = (int(host["draft_tokens"]),
                                                   int(host["accepted_tokens"]))
      stats.generated = sum(len(c.tokens) for c in engine.completions)
      stats.seconds = time.perf_counter() - started
      stats.compile_seconds = compile_seconds() - compiled
      if int(host["status"]) != Status.OK:
        raise EngineError(f"the cache refused a step: {Status(int(host['status'])).name}",
                          engine.completions)
      if on_progress is not None:
        on_progress(stats, new_results)
      if collected.all():
        break
      # An entry that ended on its budget may have retired every column before admitting.
      spent = int(host["steps"]) - steps_before >= engine.max_steps
      steps_before = int(host["steps"])
      if not spent and not host["active"].any() and not host["used"].any():
        raise EngineError(f"request {requests[int(host['next'])].request_id!r} cannot be "
                          "admitted into an empty engine", engine.completions)
  except EngineError:
    raise
  except Exception as e:   # pylint: disable=broad-except  (model, device or callback failure)
    raise EngineError(f"Engine.run failed after {len(engine.completions)} finished samples: "
                      f"{type(e).__name__}: {e}", engine.completions) from e
  finally:
    stats.seconds = time.perf_counter() - started
    stats.compile_seconds = compile_seconds() - compiled
    for c, admitted, first, finished in step_counts:   # now that the mean step time is known
      c.timing = RequestTiming.from_steps(admitted, first, finished, len(c.tokens),
                                          stats.step_seconds)
  return engine.completions
