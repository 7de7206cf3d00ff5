"""`jaxkv serve --api-server-count 2` as a process: the engine in one process, two HTTP fronts
spawned beside it on one port, driven by the official `openai` client.

Expected text comes from a separate engine's `Engine.run` on the same checkpoint, decoded by
the `tokenizers` library directly (no code shared with the server's HTTP, text, streaming or
pipe layers). A SIGTERM drains both fronts, stops the engine's process and its children.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

pytest.importorskip("openai", reason="the server tests need the test extra's openai")
pytest.importorskip("uvicorn", reason="the server tests need the test extra's uvicorn")
import openai  # noqa: E402
import tokenizers  # noqa: E402

from http_server import serving_process  # noqa: E402
from jaxkv import serve  # noqa: E402
from jaxkv.models import hf  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
STOP_IDS = (2, 7)   # generation_config.json's eos_token_id


def _children(pid: int) -> list[int]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="utf-8") as f:
      return [int(p) for p in f.read().split()]
  except OSError:
    return []


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
      return "zombie" not in f.read().lower()
  except OSError:
    return False


def test_two_front_processes_serve_what_one_engine_computes_and_stop_on_sigterm():
  prompts = [[1, 5, 9, 13], [3, 4], [20, 21, 22, 23, 24, 25], [8], [11, 12, 13], [30, 2, 6]]
  with serving_process("--checkpoint", FIXTURE, "--max-len", "128", "--max-seqs", "4",
                       "--max-write", "16", "--compilation-cache", "none", "--api-server-count",
                       "2", "--shutdown-timeout", "60", "--stats-interval", "0", "--log-level",
                       "warning") as (proc, _, client):
    fronts = _children(proc.pid)
    assert len(fronts) >= 2, fronts

    def ask(i):
      p = prompts[i]
      if i % 2:   # plain
        r = client.completions.create(model="hf_llama", prompt=p, max_tokens=12, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
      text, reason = "", None
      for c in client.completions.create(model="hf_llama", prompt=p, max_tokens=12,
                                         temperature=0, stream=True):
        text += c.choices[0].text
        reason = c.choices[0].finish_reason or reason
      return text, reason, None

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
      got = list(pool.map(ask, range(len(prompts))))
    # Constrained requests: each front compiles the spec, and its automaton's copies share one
    # place in the engine's pool.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      constrained = list(pool.map(lambda i: client.completions.create(
          model="hf_llama", prompt=[5 + i], max_tokens=12, temperature=0,
          extra_body={"guided_choice": ["alpha", "beta"]}), range(4)))
    assert all(r.choices[0].text in ("alpha", "beta") for r in constrained)
    # The prompt's own logprobs run the model in the engine's process: a front refuses them.
    for extra in ({"echo": True, "logprobs": 1}, {"extra_body": {"prompt_logprobs": 1}}):
      with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="hf_llama", prompt=[1, 2], max_tokens=1, **extra)
      assert info.value.body["param"] in ("logprobs", "prompt_logprobs")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert "jaxkv serve: 2 front processes on 127.0.0.1" in out, out[-3000:]
  assert "jaxkv serve: generated" in out, out[-3000:]
  # An exception in a front's callbacks is only logged (the request may still be served): the
  # fronts' output is this one's, and it must have none.
  assert "Traceback" not in out, out[out.index("Traceback"):][:3000]
  deadline = time.monotonic() + 30   # the fronts (and multiprocessing's helper) end with it
  while any(_alive(pid) for pid in fronts) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not [pid for pid in fronts if _alive(pid)]

  model, _, _ = hf.load_model(FIXTURE, capacity=4 * 128, max_seqs=4, max_write=16)
  engine = serve.Engine(model, max_len=128)
  tok = tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
  done = engine.run([serve.Request(tuple(p), serve.SamplingParams(
      max_tokens=12, stop_tokens=STOP_IDS)) for p in prompts])
  for (text, reason, usage), c in zip(got, done):
    assert text == tok.decode(c.tokens, skip_special_tokens=True)
    assert reason == c.finish_reason
    assert usage in (None, len(c.tokens))
  generated = int(out.split("jaxkv serve: generated ")[1].split()[0])
  assert generated == sum(len(c.tokens) for c in done) + sum(r.usage.completion_tokens
                                                             for r in constrained)
