"""The drain past its timeout: every client still in flight gets a well-formed answer.

A server with one sequence and more work than the timeout allows: at the drain's
deadline each plain request is answered 503 with a message, each stream ends with
an error event in OpenAI's shape and then `[DONE]`; nothing is logged per request
(one summary line), and the finished requests are unharmed.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import signal
import time

import pytest

pytest.importorskip("fastapi", reason="the server tests need the serve extra")
pytest.importorskip("uvicorn", reason="the server tests need the serve extra")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from http_server import running  # noqa: E402
from jaxkv.cli import build_server  # noqa: E402
from jaxkv.http.app import create_app  # noqa: E402
from jaxkv.http.tasks import DrainingServer  # noqa: E402

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")


def _plain(url):
  with httpx.Client(base_url=url, timeout=120) as c:
    return c.post("/v1/completions", json={"model": "m", "prompt": "hello world",
                                           "max_tokens": 100, "ignore_eos": True})


def _stream(url):
  with httpx.Client(base_url=url, timeout=120) as c:
    with c.stream("POST", "/v1/completions", json={"model": "m", "prompt": "hello there",
                                                   "max_tokens": 100, "ignore_eos": True,
                                                   "stream": True}) as r:
      assert r.status_code == 200
      return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_past_the_drain_timeout_every_client_gets_a_well_formed_answer(caplog):
  engine, tokenizer, _ = build_server(CHECKPOINT, max_seqs=1, max_len=128, max_write=16)
  app = create_app(engine, tokenizer, model_name="m", interval=1)
  caplog.set_level(logging.WARNING)
  with running(app, lifespan="on") as url, concurrent.futures.ThreadPoolExecutor(12) as pool:
    plain = [pool.submit(_plain, url) for _ in range(6)]
    streams = [pool.submit(_stream, url) for _ in range(6)]
    deadline = time.monotonic() + 120
    while engine.stats.generated == 0:   # serving (and compiled) before the shutdown starts
      assert time.monotonic() < deadline, "nothing was served"
      time.sleep(0.05)
    app.state.drain.start(1.0)   # what DrainingServer.handle_exit does on SIGTERM
    answers = [f.result(timeout=120) for f in plain]
    events = [f.result(timeout=120) for f in streams]
  refused = [a for a in answers if a.status_code == 503]
  assert refused, "every request finished before the deadline: give them more tokens"
  for a in answers:
    assert a.status_code in (200, 503), a.text
    if a.status_code == 503:
      error = a.json()["error"]
      assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
      assert set(error) == {"message", "type", "param", "code"}
    else:
      assert a.json()["usage"]["completion_tokens"] == 100
  cut = 0
  for lines in events:
    assert lines[-1] == "[DONE]", lines[-3:]
    bodies = [json.loads(line) for line in lines[:-1]]
    if "error" in bodies[-1]:
      cut += 1
      assert bodies[-1]["error"]["type"] == "service_unavailable"
      assert set(bodies[-1]["error"]) == {"message", "type", "param", "code"}
      assert all("error" not in b for b in bodies[:-1])
    else:
      assert bodies[-1]["choices"][0]["finish_reason"] == "length"
  assert cut + len(refused) == app.state.drain.answered
  noisy = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
  assert not noisy, [r.getMessage() for r in noisy]


def test_the_shutdown_signal_starts_the_drain():
  started = []

  class FakeDrain:
    def start(self, timeout):
      started.append(timeout)

  server = DrainingServer(uvicorn.Config(lambda *a: None, timeout_graceful_shutdown=7),
                          FakeDrain())
  server.handle_exit(signal.SIGTERM, None)
  assert server.should_exit and started == [7]
