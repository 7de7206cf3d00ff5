"""`Engine.run` failures lose nothing: finished completions survive, the engine stays usable, one cache at a time."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv import serve
from jaxkv.models import Decoder, ModelConfig
from jaxkv.serve.decoding import greedy_generate
import jaxkv.serve.core  # noqa: F401  (monkeypatched below)

MODEL = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=2, num_kv_heads=1, head_dim=16)
CACHE = MODEL.cache_config(capacity=160, max_seqs=2, max_write=8)


@pytest.fixture(scope="module")
def model():
  return Decoder(MODEL, CACHE, rngs=nnx.Rngs(0))


class _Boom(Exception):
  pass


# Host-side switch the failing model's callback reads (a Python global, so it survives tracing).
_FAIL_AT = {"step": None, "seen": 0}


def _maybe_fail(n_tokens):
  _FAIL_AT["seen"] += 1
  if _FAIL_AT["step"] is not None and _FAIL_AT["seen"] >= _FAIL_AT["step"]:
    _FAIL_AT["step"] = None   # fail once
    raise _Boom(f"model failed at step {_FAIL_AT['seen']}")


class FailingModel(nnx.Module):
  """The test model, plus a host callback that raises at a chosen step (a device-side failure)."""

  def __init__(self, inner):
    self.inner, self.cache_config = inner, inner.cache_config

  @property
  def vocab_size(self):
    return self.inner.vocab_size

  def __call__(self, tokens, state, *, rows=None):
    jax.debug.callback(_maybe_fail, state.step.n_tokens, ordered=True)
    return self.inner(tokens, state, rows=rows)


def _requests():
  prompts = [(1, 2, 3), (4, 5), (6,), (7, 8, 9, 10), (11, 12)]
  return [serve.Request(p, serve.SamplingParams(max_tokens=2 + i)) for i, p in enumerate(prompts)]


def test_a_model_failure_keeps_finished_completions_and_the_engine(model):
  engine = serve.Engine(FailingModel(model), max_len=32, max_steps=3)
  requests = _requests()
  # Fail at the run's last-but-one step, whatever the schedule: count its steps first.
  _FAIL_AT.update(step=None, seen=0)
  engine.run(requests)
  assert _FAIL_AT["seen"] > 2
  _FAIL_AT.update(step=_FAIL_AT["seen"] - 1, seen=0)
  with pytest.raises(serve.EngineError) as raised:
    engine.run(requests)
  finished = raised.value.completions
  assert finished, "steps before the failure finished some requests"
  assert isinstance(raised.value.__cause__, Exception)
  for c in finished:   # what was kept is right
    assert c.tokens == greedy_generate(serve.ModelRunner(model), [list(c.prompt)], len(c.tokens))[0]
  assert engine.completions == finished
  # The engine stays usable: the same queue again, now without a failure.
  again = engine.run(requests)
  assert [c.request_id for c in again] == list(range(len(requests)))
  by_id = {c.request_id: c.tokens for c in again}
  for c in finished:
    assert by_id[c.request_id] == c.tokens


def test_a_callback_failure_keeps_finished_completions(model):
  engine = serve.Engine(model, max_len=32, max_steps=2)
  calls = []

  def on_progress(stats, new):
    calls.append(list(new))
    if sum(len(x) for x in calls) >= 2:
      raise RuntimeError("progress bar broke")

  with pytest.raises(serve.EngineError, match="progress bar broke") as raised:
    engine.run(_requests(), on_progress=on_progress)
  assert len(raised.value.completions) >= 2
  assert raised.value.completions == [c for batch in calls for c in batch]
  assert engine.run(_requests()[:2])[0].tokens   # still usable


def test_a_new_run_drops_the_previous_cache_before_allocating(model, monkeypatch):
  engine = serve.Engine(model, max_len=32)
  engine.run(_requests()[:1])
  assert engine.state is not None
  seen = []
  original = serve.core.init_loop_state

  def checked(*args, **kwargs):
    seen.append(engine.state)   # must already be released
    return original(*args, **kwargs)

  monkeypatch.setattr(serve.core, "init_loop_state", checked)
  engine.run(_requests()[:1])
  assert seen == [None]


def test_bad_requests_are_refused_before_anything_is_served(model):
  engine = serve.Engine(model, max_len=32)
  good = serve.Request((1, 2), serve.SamplingParams(max_tokens=3))
  bad = serve.Request((1, 64), serve.SamplingParams(max_tokens=3), request_id="x")
  with pytest.raises(ValueError, match="'x'.*vocab_size=64"):
    engine.run([good, bad])
  assert engine.stats.steps == 0 and not engine.completions
  assert engine.run([good])[0].tokens


def test_peak_rows_counts_what_the_requests_held(model):
  engine = serve.Engine(model, max_len=64)
  engine.run([serve.Request(tuple(range(1, 41)), serve.SamplingParams(max_tokens=5))])
  # 40 prompt tokens + 4 fed generated tokens (the last sampled token is never fed).
  assert engine.stats.peak_rows == 44


def test_an_interrupt_inside_a_step_leaves_the_engine_usable(model, monkeypatch):
  """A KeyboardInterrupt (any BaseException) mid-entry drops what the device held, names it, and
  the next requests are served exactly as on a fresh engine."""
  from jaxkv import serve   # pylint: disable=g-import-not-at-top
  engine = serve.Engine(model, max_len=32)
  fresh = serve.Engine(model, max_len=32)
  first = serve.Request((1, 2, 3), serve.SamplingParams(max_tokens=6, temperature=0.0),
                        request_id="a")
  engine.add_request(first)
  engine.step(1)
  real = engine.core.enter

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(engine.core, "enter", interrupted)
  with pytest.raises(KeyboardInterrupt) as info:
    engine.step(1)
  assert info.value.failed == ["a"] and not engine.has_unfinished()
  monkeypatch.setattr(engine.core, "enter", real)
  again = serve.Request((4, 5), serve.SamplingParams(max_tokens=5, temperature=0.0),
                        request_id="a")   # the id is free again
  engine.add_request(again)
  got = [t for d in engine.stream(2) for t in d.tokens]
  [want] = fresh.run([again])
  assert got == list(want.tokens)


def test_max_len_past_what_the_cache_holds_is_refused(model):
  from jaxkv import serve   # pylint: disable=g-import-not-at-top
  limit = model.cache_config.seq_len_limit
  with pytest.raises(ValueError, match=f"max_len={limit + 2} must be <= the cache's longest"):
    serve.Engine(model, max_len=limit + 2)
  assert serve.Engine(model, max_len=limit + 1).max_len == limit + 1


def test_a_failed_step_counts_only_the_requests_still_waiting(model, monkeypatch):
  """`waiting_tokens` (the server's queued-token bound) after failed steps: the requests the
  device queue held are dropped and no longer counted; those still on the host are."""
  engine = serve.Engine(model, max_len=32)

  def failing(*args, **kwargs):
    raise _Boom("the loop failed")

  monkeypatch.setattr(engine.core, "enter", failing)
  requests = [serve.Request(tuple(range(1, 2 + i % 4)), serve.SamplingParams(max_tokens=2),
                            request_id=i) for i in range(10)]
  for r in requests:
    engine.add_request(r)
  assert engine.waiting_tokens == 1 + 2 + 3 + 4 + 1 + 2 + 3 + 4 + 1 + 2
  # The device queue holds 8 requests (its least size): the first step moves 8 there, 2 wait.
  assert engine.live.queue_size == 8
  with pytest.raises(serve.EngineError) as raised:
    engine.step(1)
  assert raised.value.failed == list(range(8))
  assert engine.counts() == (0, 2) and engine.waiting_tokens == 1 + 2
  with pytest.raises(serve.EngineError) as raised:
    engine.step(1)
  assert raised.value.failed == [8, 9]
  assert engine.counts() == (0, 0) and engine.waiting_tokens == 0
  assert not engine.has_unfinished()
