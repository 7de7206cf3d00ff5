"""Loop predicates per outer iteration of the serving loop, paged vs columns (issue 13).

On a GPU every `while` predicate is a device-to-host read and a host decision. An
outer iteration of the serving loop evaluates the predicate of every loop its body
reaches without entering another loop at least once, and the loops nested in those
only when their parent makes a trip. The paged block (`paged_admission.outer_body`)
must cost no more on the common path (nothing evicted, parked or forked) than the
column block: as many loops reached directly (counted in the compiled HLO, what
runs), and no nested loop under the loops that make trips on that path (retire,
admit), so `r` retirements and `k` admissions cost `r + k` more predicates in both.
And the merged loops take the same actions as the loops in a row they replace (an
oracle kept here), under evictions, preemptions and forks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hlo_walk
from jaxkv import Status, serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve import columns
from jaxkv.serve import paged_admission as pa
from jaxkv.serve import paged_claims as pl
from jaxkv.serve.loop import serve_loop
from jaxkv.serve.state import init_loop_state, pack_queue

_LOOP = hlo_walk.LOOP

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)


def _loops_from(comps: dict, name: str) -> list[str]:
  """The `while` lines reached from computation `name` through calls, fusions and
  branches, not through another while."""
  return hlo_walk.whiles(hlo_walk.reached(comps, name, branches=True))


@functools.cache
def _outer_loop(page_size, prefix_cache: bool):
  """`(comps, loops the outer body reaches directly)` of the compiled serving loop."""
  cache = MODEL.cache_config(capacity=128, max_seqs=4, max_write=16)
  model = Decoder(MODEL, dataclasses.replace(cache, page_size=page_size), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  queue = pack_queue([(1, 2, 3)], [serve.SamplingParams(max_tokens=4)], max_len=16,
                     max_stop=2)
  ls = init_loop_state(model.cache_config, queue, num_widths=1,
                       prefix_cache=prefix_cache)
  hlo = jax.jit(serve_loop, static_argnums=(0, 1, 2), donate_argnums=4).lower(
      graphdef, model.cache_config, (16,), params, ls, jnp.int32(4)).compile().as_text()
  comps, entry = hlo_walk.computations(hlo)
  # The outer loop, and after it the retirement of columns that finished on the last step.
  outer, retire = _loops_from(comps, entry)
  assert _runs_the_model(comps, outer) and not _runs_the_model(comps, retire)
  cond, body = _LOOP.search(outer).groups()
  return comps, _loops_from(comps, body) + _loops_from(comps, cond)


def _runs_the_model(comps: dict, loop: str) -> bool:
  """Whether a loop's body reaches a `dot` (a step loop: it trips once per step)."""
  body = _LOOP.search(loop).group(2)
  return any(" dot(" in line for line in hlo_walk.reached(comps, body, into_loops=True))


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_paged_outer_iteration_checks_no_more_loops_than_the_column_one(prefix_cache):
  """Loops reached directly from the outer body: the same count for both storages. Of
  the ones that do not run the model, those without nested loops (retire, admit: they
  trip on the common path) are as many in both, and the paged one has exactly one with
  nested loops (evictions, parked columns, forks and room: no trip on the common path),
  the column block none but its fork loop's own check."""
  col_comps, columns = _outer_loop(None, False)
  comps, paged = _outer_loop(4, prefix_cache)
  assert len(paged) == len(columns), (len(paged), len(columns))

  def blocks(comps, loops):
    admin = [l for l in loops if not _runs_the_model(comps, l)]
    nested = [l for l in admin if _loops_from(comps, _LOOP.search(l).group(2))]
    return len(admin), len(nested)

  col_admin, col_nested = blocks(col_comps, columns)
  paged_admin, paged_nested = blocks(comps, paged)
  assert col_nested == 0
  assert paged_nested == 1
  assert paged_admin == col_admin


# ----------------------------------------------------------------------------- same actions


def _loops_in_a_row(config, ls):
  """The paged block as it was written before its loops were merged (the oracle): retire;
  a loop around evict / bring back / admit; a loop around free / evict / swap / fork;
  then free room for the step."""
  loop, ok = jax.lax.while_loop, lambda ls: ls.status == Status.OK
  ls = loop(lambda ls: jnp.any(ls.cols.done == 1) & ok(ls), lambda ls: pa.retire_one(config, ls),
            ls)
  now = lambda ls: pa._admission(config, ls)[0]
  evict = lambda ls: pa._admission(config, ls)[1]
  parked = lambda ls: jnp.any(ls.cols.parked == 1)

  def admit_body(ls):
    ls = loop(evict, lambda ls: pl.evict_one(config, ls), ls)
    ls = loop(lambda ls: now(ls) & parked(ls), lambda ls: pa._readmit_one(config, ls), ls)
    return loop(lambda ls: now(ls) & ~parked(ls),
                lambda ls: pa._admit_queued(config, ls), ls)

  ls = loop(lambda ls: now(ls) | evict(ls), admit_body, ls)
  ls = dataclasses.replace(ls, adopt_wait=pa._admission(config, ls)[2])
  ready = lambda ls: jnp.any(columns.fork_ready(ls.cols)) & ok(ls)
  src = lambda ls: jnp.argmax(columns.fork_ready(ls.cols)).astype(jnp.int32)
  fits = lambda ls: ls.cache.held + ls.cache.pos[src(ls)] <= config.capacity
  lowest = lambda ls: pl.lowest_free_id(ls)[1]
  parked_lowest = lambda ls: pl.lowest_free_id(ls)[0] & (ls.cols.parked[lowest(ls)] == 1)

  def fork(ls):
    dst, s = lowest(ls), src(ls)
    before = ls.cache.live[dst]
    ls = columns.fork_one(config, ls)
    did = (ls.cache.live[dst] == 1) & (before == 0)
    ls = pl.stamped(ls, dst, did)
    return dataclasses.replace(ls, cols=columns.update(ls.cols, dst, did,
                                                       page_hash=ls.cols.page_hash[s]))

  def fork_body(ls):
    ls = loop(lambda ls: ready(ls) & ~fits(ls) & pl.can_free(ls),
              lambda ls: pl.free_one(config, ls), ls)
    ls = loop(lambda ls: ready(ls) & ~pl.spare(ls)[0] & jnp.any(ls.cols.cached == 1),
              lambda ls: pl.evict_one(config, ls), ls)
    ls = loop(lambda ls: ready(ls) & parked_lowest(ls) & pl.spare(ls)[0],
              lambda ls: pl.swap(ls, lowest(ls), pl.spare(ls)[1]), ls)
    return loop(lambda ls: ready(ls) & fits(ls) & ~parked_lowest(ls) & pl.spare(ls)[0],
                fork, ls)

  ls = loop(ready, fork_body, ls)
  room = lambda ls: ok(ls) & ~pl.step_fits(config, ls) & pl.can_free(ls)
  return loop(room, lambda ls: pl.free_one(config, ls), ls)


def test_the_merged_loops_take_the_same_actions(monkeypatch):
  """Prefix caching, forks (n = 2) and a pool too small for the queue: evictions,
  preemptions, parked columns coming back. The merged loops give the same tokens and
  the same counters (steps, tokens per step, occupancy, preemptions, evictions, adopted
  tokens) as the loops in a row."""
  rng = np.random.default_rng(4)
  system = tuple(int(t) for t in rng.integers(0, 64, 9))
  requests = []
  for i in range(12):
    prompt = system + tuple(int(t) for t in rng.integers(0, 64, int(rng.integers(3, 14))))
    params = serve.SamplingParams(max_tokens=int(rng.integers(4, 14)),
                                  temperature=0.0 if i % 2 else 0.9, seed=int(rng.integers(99)),
                                  n=2 if i % 2 == 0 else 1)
    requests.append(serve.Request(prompt, params, request_id=i))
  cache = MODEL.cache_config(capacity=56, max_seqs=4, max_write=8)
  model = Decoder(MODEL, dataclasses.replace(cache, page_size=4), rngs=nnx.Rngs(0))
  counters = ("steps", "step_tokens", "generated", "occupancy", "peak_rows", "preemptions",
              "evictions", "cached_tokens")

  def run():
    engine = serve.Engine(model, max_len=40, widths=(8,), prefix_cache=True)
    done = engine.run(requests)
    tokens = {(c.request_id, c.index): (c.tokens, c.finish_reason) for c in done}
    return tokens, {k: getattr(engine.stats, k) for k in counters}, engine.stats.width_steps

  merged = run()
  monkeypatch.setattr(pa, "outer_body", _loops_in_a_row)
  in_a_row = run()
  assert merged == in_a_row
  assert in_a_row[1]["preemptions"] > 0 and in_a_row[1]["evictions"] > 0
  assert in_a_row[1]["cached_tokens"] > 0
