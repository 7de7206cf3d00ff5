"""Issue 9: bad input to the serving layer is refused at the boundary, naming the field.

Each test here failed before its fix (the docstrings say how). Refusals of the
cache leave the state bitwise unchanged (`assert_same_state`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from scenario_utils import assert_same_state, snapshot

pure = jaxkv.pure
MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def model():
  return Decoder(MODEL, MODEL.cache_config(capacity=64, max_seqs=3, max_write=4,
                                           initial_capacity=8), rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------- requests

Params, Request = serve.SamplingParams, serve.Request
# Before: floats and bools were truncated (2.5 -> 2, True -> 1), "12" became (1, 2),
# 3.9 became 3, negative ids passed, NaN temperatures and top_p passed.
CONSTRUCTION_CASES = [
    ("prompt-str", lambda: Request("12"), TypeError, "prompt"),
    ("prompt-bytes", lambda: Request(b"12"), TypeError, "prompt"),
    ("prompt-float", lambda: Request((3.9,), request_id="r"), TypeError, r"request 'r'.*prompt\[0\]"),
    ("prompt-np-float", lambda: Request(np.array([1.0])), TypeError, r"prompt\[0\]"),
    ("prompt-bool", lambda: Request((True,)), TypeError, r"prompt\[0\]"),
    ("prompt-negative", lambda: Request((1, -2)), ValueError, r"prompt\[1\]=-2"),
    ("prompt-int", lambda: Request(5), TypeError, "prompt"),
    ("prompt-np-bool", lambda: Request(np.array([1, 0], bool)), TypeError, r"prompt\[0\]"),
    ("prompt-bool-late", lambda: Request((1, 2, False)), TypeError, r"prompt\[2\]"),
    ("prompt-np-negative", lambda: Request(np.array([1, -3], np.int64)), ValueError,
     r"prompt\[1\]=-3"),
    ("prompt-2d", lambda: Request(np.zeros((2, 2), np.int32)), TypeError, "prompt"),
    ("params-dict", lambda: Request((1,), {"max_tokens": 2}), TypeError, "params"),
    ("request_id-list", lambda: Request((1,), request_id=[1]), TypeError, "request_id"),
    ("max_tokens-float", lambda: Params(max_tokens=2.5), TypeError, "max_tokens"),
    ("max_tokens-bool", lambda: Params(max_tokens=True), TypeError, "max_tokens"),
    ("max_tokens-huge", lambda: Params(max_tokens=2**31), ValueError, "max_tokens"),
    ("seed-float", lambda: Params(seed=1.5), TypeError, "seed"),
    ("seed-negative", lambda: Params(seed=-1), ValueError, "seed"),
    ("n-float", lambda: Params(n=2.5), TypeError, "n="),
    ("top_k-float", lambda: Params(top_k=1.5), TypeError, "top_k"),
    ("top_k-bool", lambda: Params(top_k=False), TypeError, "top_k"),
    ("temperature-str", lambda: Params(temperature="1"), TypeError, "temperature"),
    ("temperature-nan", lambda: Params(temperature=float("nan")), ValueError, "temperature"),
    ("temperature-inf", lambda: Params(temperature=float("inf")), ValueError, "temperature"),
    ("top_p-nan", lambda: Params(top_p=float("nan")), ValueError, "top_p"),
    ("top_p-bool", lambda: Params(top_p=True), TypeError, "top_p"),
    ("stop-float", lambda: Params(stop_tokens=(1.5,)), TypeError, r"stop_tokens\[0\]"),
    ("stop-negative", lambda: Params(stop_tokens=(3, -1)), ValueError, r"stop_tokens\[1\]"),
    ("stop-str", lambda: Params(stop_tokens="12"), TypeError, "stop_tokens"),
]


@pytest.mark.parametrize("make, error, match", [c[1:] for c in CONSTRUCTION_CASES],
                         ids=[c[0] for c in CONSTRUCTION_CASES])
def test_requests_refuse_bad_fields_at_construction(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_requests_accept_numpy_integers_as_python_values():
  r = Request(np.array([3, 4], np.int64), Params(max_tokens=np.int32(2), seed=np.int64(5),
                                                 temperature=np.float32(0.5),
                                                 stop_tokens=np.array([1], np.int16)))
  assert r.prompt == (3, 4) and all(type(t) is int for t in r.prompt)
  assert type(r.params.max_tokens) is int and type(r.params.temperature) is float
  assert r.params == Params(max_tokens=2, seed=5, temperature=0.5, stop_tokens=(1,))


def test_request_replace_keeps_the_checked_prompt_and_checks_what_changes():
  """`Request.replace` (the engine labels and seeds every queued request with it)
  equals `dataclasses.replace` without re-checking the prompt, and refuses what the
  constructor refuses."""
  r = Request(tuple(range(5)), Params(max_tokens=3))
  for changes in ({"request_id": 7}, {"params": Params(seed=2)},
                  {"request_id": "x", "params": Params(n=2)}):
    new = r.replace(**changes)
    assert new == dataclasses.replace(r, **changes) and new.prompt is r.prompt
    assert hash(new) == hash(dataclasses.replace(r, **changes))
  assert r.request_id is None and r.params == Params(max_tokens=3)   # unchanged
  with pytest.raises(TypeError, match="request_id"):
    r.replace(request_id=[1])
  with pytest.raises(TypeError, match="params"):
    r.replace(params={"max_tokens": 2})
  with pytest.raises(TypeError, match="prompt"):
    r.replace(prompt=(1,))


LIMITS = dict(vocab_size=64, max_len=16, max_seqs=3, capacity=40, max_stop_tokens=2)
# Before: Engine._check passed these; they failed with raw errors after other requests
# were served (2**40: OverflowError in the jitted admission), or gave NaN logits (>= vocab).
SUBMISSION_CASES = [
    ("prompt-vocab", Request((1, 64), request_id="a"), r"request 'a': prompt\[1\]=64.*vocab"),
    ("prompt-2**40", Request((2**40,)), r"prompt\[0\]=1099511627776.*vocab_size=64"),
    ("stop-2**40", Request((1,), Params(stop_tokens=(2**40,))), r"stop_tokens\[0\]"),
    ("max_len", Request(tuple(range(10)), Params(max_tokens=7)), "max_len=16"),
    ("n-columns", Request((1,), Params(max_tokens=2, n=4)), "max_seqs=3"),
    ("capacity", Request((1,) * 8, Params(max_tokens=8, n=3)), "capacity=40"),
    ("stops", Request((1,), Params(max_tokens=2, stop_tokens=(1, 2, 3))), "max_stop_tokens=2"),
]


@pytest.mark.parametrize("request_, match", [c[1:] for c in SUBMISSION_CASES],
                         ids=[c[0] for c in SUBMISSION_CASES])
def test_check_request_refuses_what_the_engine_cannot_serve(request_, match):
  with pytest.raises(ValueError, match=match):
    serve.check_request(request_, **LIMITS)


def test_check_request_accepts_requests_at_the_limits():
  serve.check_request(Request((63,) * 4, Params(max_tokens=12, n=3, stop_tokens=(0, 63))),
                      **{**LIMITS, "capacity": 45})
  with pytest.raises(TypeError, match="Request"):
    serve.check_request((1, 2), **LIMITS)


# --------------------------------------------------------------------------- runner


def test_runner_refuses_bad_ids_and_tokens_changing_nothing(model):
  """Before: `seq_rm(1.9)` removed column 1, `pos(-1)`/`pos(100)` read other columns,
  and a token >= vocab wrote NaN K/V into the sequence's history."""
  runner = serve.ModelRunner(model)
  a, b = runner.seq_new(), runner.seq_new()
  runner.step([a, a, b], [1, 2, 3])
  before = snapshot(runner.cache)
  for call, error, match in [
      (lambda: runner.seq_rm(1.9), TypeError, "seq_id"),
      (lambda: runner.rewind(0, 1.0), TypeError, "position"),
      (lambda: runner.pos(-1), ValueError, "seq_id=-1"),
      (lambda: runner.pos(100), ValueError, "seq_id=100"),
      (lambda: runner.pos(np.float32(0)), TypeError, "seq_id"),
      (lambda: runner.step([a], [64]), ValueError, r"tokens\[0\]=64"),
      (lambda: runner.step([a], [-1]), ValueError, r"tokens\[0\]=-1"),
      (lambda: runner.step([a], [1.5]), TypeError, r"tokens\[0\]"),
      (lambda: runner.step([a, 2], [1, 1]), ValueError, "refused: NOT_LIVE"),
  ]:
    with pytest.raises(error, match=match):
      call()
    assert_same_state(before, snapshot(runner.cache))
  assert (runner.pos(a), runner.pos(b), runner.pos(2)) == (2, 1, 0)


def test_runner_refuses_wide_ids_and_unordered_id_lists(model):
  """The runner's jitted forward never sees a wrapped id; a dict or set of ids is refused.

  Before: `step({a: 0}, [1])` declared the dict's keys and ran the step.
  """
  runner = serve.ModelRunner(model)
  a, b = runner.seq_new(), runner.seq_new()
  runner.step([a, a, b], [1, 2, 3])
  before = snapshot(runner.cache)
  for call, error, match in [
      (lambda: runner.step([np.int64(2**32)], [1]), ValueError, "NOT_LIVE"),
      (lambda: runner.step([np.uint64(2**32 + 1)], [1]), ValueError, "NOT_LIVE"),
      (lambda: runner.step({a: 0}, [1]), TypeError, "seq_ids"),
      (lambda: runner.step({a}, [1]), TypeError, "seq_ids"),
      (lambda: runner.step([a], {1: 0}), TypeError, "tokens"),
      (lambda: runner.step([a], b"\x01"), TypeError, "tokens"),
  ]:
    with pytest.raises(error, match=match):
      call()
    assert_same_state(before, snapshot(runner.cache))
  assert runner.seq_rm(np.int64(2**32)) is False
  assert runner.rewind(np.int64(2**32), 0) is False
  assert runner.seq_clone(np.int64(2**32 + 1)) is None
  assert_same_state(before, snapshot(runner.cache))
  assert (runner.pos(a), runner.pos(b)) == (2, 1)


def test_runner_is_the_facade_plus_a_model_step(model):
  """One host facade: the runner's verbs, growth and refusals are `BatchedSequenceCache`'s."""
  runner = serve.ModelRunner(model)
  assert isinstance(runner.facade, jaxkv.BatchedSequenceCache)
  s = runner.seq_new()
  runner.step([s] * 4, [1, 2, 3, 4])
  runner.step([s] * 4, [5, 6, 7, 8])
  runner.step([s], [9])   # 9 rows > the initial 8: grown, rounded up to 128, capped at 64
  assert runner.cache.k[0].shape[0] == 64 and runner.pos(s) == 9
  assert runner.facade.floor(s) == 0 and runner.facade.hw(s) == 9


# --------------------------------------------------------------------------- core


def _two_sequences(config):
  state = jaxkv.init_state(config)
  for _ in range(2):
    state, _, _ = pure.seq_new(config, state)
  return state


CORE = MODEL.cache_config(capacity=32, max_seqs=3, max_write=4, initial_capacity=8)


def test_concrete_int64_ids_beyond_int32_are_refused_at_trace_time():
  """Before: `pure.seq_rm(config, state, np.int64(2**32))` inside `jax.jit` removed sequence 0
  (the id was cast to int32, wrapping to 0)."""
  state = _two_sequences(CORE)
  before = snapshot(state)
  for verb, args, name in [(pure.seq_rm, (np.int64(2**32),), "seq_id"),
                           (pure.rewind, (0, np.int64(2**32)), "position"),
                           (pure.seq_clone, (np.uint64(2**32), 1), "src")]:
    with pytest.raises(ValueError, match=f"{name}.*int32"):
      jax.jit(lambda s, v=verb, a=args: v(CORE, s, *a), donate_argnums=0)(state)
    assert_same_state(before, snapshot(state))


def test_traced_wide_ids_saturate_instead_of_wrapping():
  """With x64 on, an int64 id reaches the verb traced; `2**32` must be refused, not id 0."""
  with jax.enable_x64(True):
    state = _two_sequences(CORE)
    before = snapshot(state)
    rm = jax.jit(pure.seq_rm, static_argnums=0)
    state, status = rm(CORE, jax.tree.map(jnp.copy, state), jnp.asarray(2**32, jnp.int64))
    assert int(status) == jaxkv.Status.NOT_LIVE
    assert_same_state(before, snapshot(state))
    state, status = rm(CORE, state, jnp.asarray(2**32 + 1, jnp.uint64))
    assert int(status) == jaxkv.Status.NOT_LIVE
    assert_same_state(before, snapshot(state))


def _prepared(config):
  state = _two_sequences(config)
  ids = jnp.asarray([0, 0, 1, config.max_seqs], jnp.int32)
  state, _ = pure.declare_step(config, state, ids, jnp.int32(3), jnp.zeros((4, 2), jnp.int32))
  state, status = pure.prepare_step(config, state)
  assert int(status) == 0
  return state


def test_commit_after_some_layers_is_refused_and_changes_nothing():
  """Before: committing after attending only layer 0 advanced `pos` over positions whose
  K/V layer 1 never stored (CONTRACT §6.4 did not check it)."""
  q, kv = jnp.ones((4, 2, 16)), jnp.ones((4, 1, 16))
  state = _prepared(CORE)
  state, _, status = pure.attend(CORE, state, 0, q, kv, kv, implementation="reference")
  before = snapshot(state)
  state, status = jax.jit(pure.commit_step, static_argnums=0, donate_argnums=1)(CORE, state)
  assert int(status) == jaxkv.Status.NOT_ATTENDED
  assert_same_state(before, snapshot(state))
  state, _, _ = pure.attend(CORE, state, 1, q, kv, kv, implementation="reference")
  state, status = pure.commit_step(CORE, state)
  assert int(status) == 0 and np.asarray(state.pos).tolist() == [2, 1, 0]
  # The facade raises StepError for it and keeps the step prepared.
  cache = jaxkv.BatchedSequenceCache(CORE, implementation="reference")
  cache.seq_new()
  cache.declare_step([0])
  cache.prepare_step()
  cache.attend(1, q[:1], kv[:1], kv[:1])
  before = snapshot(cache.state)
  with pytest.raises(jaxkv.StepError, match="NOT_ATTENDED"):
    cache.commit_step()
  assert_same_state(before, snapshot(cache.state))


def test_cached_attention_on_an_unprepared_state_does_not_pass_silently(model):
  """Before: `CachedAttention` on an IDLE state returned zeros and the step went on."""
  layer = model.layers[0].attn
  state = _two_sequences(model.cache_config)
  x = jnp.ones((model.cache_config.step_width, MODEL.hidden_size))
  with pytest.raises(jaxkv.StepError, match="prepared step"):
    layer(x, state)
  # Traced, it cannot raise: the step's commit refuses instead, changing nothing.
  graphdef, params = nnx.split(model)

  def step(params, state, tokens):
    logits, state = nnx.merge(graphdef, params)(tokens, state)
    return pure.commit_step(model.cache_config, state)

  before = snapshot(state)
  state, status = jax.jit(step)(params, state, jnp.zeros((4,), jnp.int32))
  assert int(status) == jaxkv.Status.NOT_PREPARED
  assert_same_state(before, snapshot(state))


def test_readme_example_runs_and_attends_every_layer():
  """Before: the README's example attended layer 0 of 2 and committed (and used undefined q)."""
  text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
  code = re.search(r"## Quick start: the cache API\n.*?```python\n(.*?)```", text, re.S).group(1)
  scope: dict = {}
  exec(compile(code, "README.md", "exec"), scope)   # pylint: disable=exec-used
  cache = scope["cache"]
  assert (cache.pos(scope["a"]), cache.pos(scope["b"])) == (3, 1) and scope["fork"] is not None


def test_readme_flax_quick_start_runs_one_step():
  """The README's `CachedAttention` quick start runs as printed: one jitted step of two sequences."""
  text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
  code = re.search(r"## Quick start: `CachedAttention` in a Flax model\n.*?```python\n(.*?)```",
                   text, re.S).group(1)
  scope: dict = {}
  exec(compile(code, "README.md", "exec"), scope)   # pylint: disable=exec-used
  state, y, config = scope["state"], scope["y"], scope["config"]
  assert int(scope["status"]) == jaxkv.Status.OK
  assert np.asarray(state.pos).tolist()[:3] == [3, 1, 0]
  assert np.asarray(state.live).tolist()[:3] == [1, 1, 0]
  assert y.shape == (config.max_write, 64) and bool(jnp.all(jnp.isfinite(y[:4])))


def test_readme_llm_quick_start_generates_text():
  """The README's `LLM` quick start runs as printed on the repository's fixture checkpoint."""
  text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
  code = re.search(r"## Quick start: text generation in Python\n.*?```python\n(.*?)```", text,
                   re.S).group(1)
  root = pathlib.Path(__file__).parents[2]
  code = code.replace('"tests/fixtures/hf_llama"', repr(str(root / "tests/fixtures/hf_llama")))
  scope: dict = {}
  exec(compile(code, "README.md", "exec"), scope)   # pylint: disable=exec-used
  out, reply = scope["out"], scope["reply"]
  assert len(out) == 2 and all(o.finish_reason in ("stop", "length") for o in out)
  assert all(0 < len(o.token_ids) <= 16 and isinstance(o.text, str) for o in out)
  assert len(reply) == 1 and 0 < len(reply[0].token_ids) <= 8
