"""Blocks of steps in the serving loop (issue 11: no host read of a loop predicate per step).

On a GPU every trip of a `lax.while_loop` reads its predicate on the host and waits
for the device, so the narrowest width's phase over column storage runs trips of
`loop.BLOCK_STEPS` steps (a loop of known trip count, which runs without that read)
while no column can end or fork inside a trip (`jaxkv/serve/loop.py`). These tests
hold it to the single-step loop: the same tokens for every request (greedy, seeded
sampling, forks, stop tokens inside a block, streaming budgets), the same steps where
no stop token ends a column early, a step with `go=False` that changes nothing, and
the block's loop present in the compiled module with its trip count (and absent over
pages and with `BLOCK_STEPS = 1`).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Status, serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve import loop as loop_module

MODEL = ModelConfig.gemma3(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                           layer_types=("sliding", "full"), num_heads=2, num_kv_heads=1,
                           head_dim=16, sliding_window=4, query_pre_attn_scalar=16.0)


def _model(max_seqs=4, width=16, page_size=None):
  cache = MODEL.cache_config(capacity=256, max_seqs=max_seqs, max_write=width)
  if page_size:
    cache = dataclasses.replace(cache, page_size=page_size)
  return Decoder(MODEL, cache, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model():
  return _model()


def _requests(seed, count, *, sample=False, forks=False):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(count):
    prompt = tuple(int(t) for t in rng.integers(0, MODEL.vocab_size, int(rng.integers(1, 24))))
    params = dict(max_tokens=int(rng.integers(1, 30)))
    if sample and i % 2:
      params.update(temperature=1.5, top_k=20, seed=int(rng.integers(1 << 20)))
    if forks and i % 3 == 0:
      params.update(n=3, temperature=1.0, seed=int(rng.integers(1 << 20)))
    out.append(serve.Request(prompt, serve.SamplingParams(**params)))
  return out


def _serve(model, requests, block, monkeypatch, **engine_kwargs):
  monkeypatch.setattr(loop_module, "BLOCK_STEPS", block)
  engine = serve.Engine(model, max_len=64, **engine_kwargs)
  done = engine.run(requests)
  return engine, [(c.request_id, c.index, tuple(c.tokens), c.finish_reason) for c in done]


@pytest.mark.parametrize("kind", ["greedy", "sampled", "forks", "stop"])
def test_blocks_give_the_single_step_loops_tokens(model, monkeypatch, kind):
  requests = _requests(7, 11, sample=kind == "sampled", forks=kind == "forks")
  if kind == "stop":   # each greedy request stops at a token from the middle of its output
    _, full = _serve(model, requests, 1, monkeypatch)
    requests = [dataclasses.replace(r, params=dataclasses.replace(
        r.params, stop_tokens=(tokens[len(tokens) // 2],) if len(tokens) > 2 else ()))
                for r, (_, _, tokens, _) in zip(requests, full)]
  single, want = _serve(model, requests, 1, monkeypatch)
  for block in (3, 4):
    blocked, got = _serve(model, requests, block, monkeypatch)
    assert got == want, block
    if kind != "stop":   # no column ends inside a block: the very same schedule
      assert blocked.stats.steps == single.stats.steps
      assert blocked.stats.width_steps == single.stats.width_steps
  if kind == "stop":
    assert sum(r == "stop" for *_, r in want) >= 3   # stop tokens did end columns


def test_streaming_budgets_are_kept_with_blocks(model, monkeypatch):
  """`Engine.step(k)`: a block never runs past the entry's budget; the deltas add up
  to the single-step loop's tokens for every budget."""
  requests = _requests(11, 6)
  _, want = _serve(model, requests, 1, monkeypatch)
  monkeypatch.setattr(loop_module, "BLOCK_STEPS", 4)
  for k in (1, 3, 4, 9):
    engine = serve.Engine(model, max_len=64)
    ids = [engine.add_request(r) for r in requests]
    tokens = {i: {} for i in ids}
    steps_before = 0
    while engine.has_unfinished():
      for d in engine.step(k):
        tokens[d.request_id].setdefault(d.index, []).extend(d.tokens)
      assert engine.stats.steps - steps_before <= k
      steps_before = engine.stats.steps
    got = sorted((i, j, tuple(t)) for i in ids for j, t in tokens[i].items())
    assert got == sorted((i, j, t) for i, j, t, _ in want), k


def test_a_step_that_may_not_go_changes_nothing(model):
  """`_step(go=False)`: nothing scheduled, so every verb refuses and the state comes back
  as it was (bitwise, K/V included), with status OK and nothing counted."""
  graphdef, params = nnx.split(model)
  config = model.cache_config
  requests = _requests(3, 4)
  queue = serve.pack_queue([r.prompt for r in requests], [r.params for r in requests],
                           max_len=64, max_stop=4)
  widths = (16,)
  ls = serve.init_loop_state(config, queue, num_widths=1)
  run = jax.jit(serve.serve_loop, static_argnums=(0, 1, 2))
  ls = run(graphdef, config, widths, params, ls, jnp.int32(3))   # mid-run: columns active
  assert int(ls.status) == Status.OK and int(ls.active.sum()) > 0
  before = jax.tree.map(np.asarray, ls)

  @jax.jit
  def no_op(params, ls):
    from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
    return loop_module._step(config, merge_model(graphdef, params), widths, 0, ls,   # pylint: disable=protected-access
                             go=jnp.bool_(False))

  after = jax.tree.map(np.asarray, no_op(params, ls))
  flat_before, _ = jax.tree_util.tree_flatten_with_path(before)
  flat_after = jax.tree.leaves(after)
  for (path, a), b in zip(flat_before, flat_after):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _trip_counts(model, widths=(16,)):
  graphdef, params = nnx.split(model)
  queue = serve.pack_queue([(1, 2, 3)], [serve.SamplingParams(max_tokens=4)], max_len=16,
                           max_stop=2)
  ls = serve.init_loop_state(model.cache_config, queue, num_widths=len(widths))
  # A fresh callable: `BLOCK_STEPS` is read at trace time, past jit's cache of earlier traces.
  fresh = functools.partial(serve.serve_loop)
  hlo = jax.jit(fresh, static_argnums=(0, 1, 2), donate_argnums=4).lower(
      graphdef, model.cache_config, widths, params, ls, jnp.int32(4)).compile().as_text()
  # A while whose body runs the model: it carries the cache's K/V ([rows, S + 1, H, D]).
  kv = re.compile(r"f32\[\d+,5,1,16\]")
  return [int(m) for line in hlo.splitlines() if " while(" in line and kv.search(line)
          for m in re.findall(r'known_trip_count":\{"n":"(\d+)"', line)]


def test_the_block_is_a_loop_of_known_trip_count(model, monkeypatch):
  monkeypatch.setattr(loop_module, "BLOCK_STEPS", 4)
  assert _trip_counts(model) == [4]
  monkeypatch.setattr(loop_module, "BLOCK_STEPS", 1)
  assert _trip_counts(model) == []
  monkeypatch.setattr(loop_module, "BLOCK_STEPS", 4)
  assert _trip_counts(_model(page_size=8)) == []   # pages: every step checks its room
