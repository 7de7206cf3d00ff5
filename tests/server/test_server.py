"""`jaxkv serve` on a tiny fixture checkpoint, on CPU, driven by the official `openai` client.

One server for the module: uvicorn in a thread on a socket this test bound to
a free localhost port, always stopped. Expected outputs come from a second
engine's `Engine.run` on the same checkpoint, and expected text from the
`tokenizers` library directly, so the oracle shares no code with the server's
HTTP, text or streaming layers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the server tests need the test extra's openai")
uvicorn = pytest.importorskip("uvicorn", reason="the server tests need the test extra's uvicorn")
import httpx  # noqa: E402
import tokenizers  # noqa: E402

from jaxkv import serve  # noqa: E402
from jaxkv.cli import build_server  # noqa: E402
from jaxkv.models import hf  # noqa: E402
from jaxkv.http.app import create_app  # noqa: E402

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
MODEL = "tiny-llama"
MAX_LEN = 128
STOP_IDS = (2, 7)   # generation_config.json's eos_token_id


@pytest.fixture(scope="module")
def server():
  engine, tokenizer, _ = build_server(CHECKPOINT, max_seqs=4, max_len=MAX_LEN, max_write=16)
  # interval=1: a token per loop entry, so a 120-token stream outlives a client that leaves early.
  app = create_app(engine, tokenizer, model_name=MODEL, interval=1)
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
  srv = uvicorn.Server(config)
  thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  url = f"http://127.0.0.1:{sock.getsockname()[1]}"
  deadline = time.monotonic() + 30
  while not srv.started:
    assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
    time.sleep(0.05)
  try:
    yield url, engine
  finally:
    srv.should_exit = True
    thread.join(timeout=20)
    sock.close()
  assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def client(server):
  with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0,
                     timeout=180) as c:
    yield c


@pytest.fixture(scope="module")
def oracle():
  """`expect(prompt_ids, **params) -> (text, finish_reason)` from a separate engine."""
  model, _, _ = hf.load_model(CHECKPOINT, capacity=4 * MAX_LEN, max_seqs=4, max_write=16)
  engine = serve.Engine(model, max_len=MAX_LEN)
  tok = tokenizers.Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))

  def expect(prompt_ids, max_tokens, **params):
    params.setdefault("stop_tokens", STOP_IDS)
    done = engine.run([serve.Request(prompt_ids, serve.SamplingParams(max_tokens=max_tokens,
                                                                      **params))])
    return [(tok.decode(c.tokens, skip_special_tokens=True), c.finish_reason) for c in done]

  expect.engine = engine   # for the logprob tests, which need the completions themselves
  return tok, expect


def _chat_ids(tok, messages):
  text = "<s>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
  return tuple(tok.encode(text + "<|assistant|>", add_special_tokens=False).ids)


def test_models_health_and_metrics(server, client):
  url, _ = server
  assert [m.id for m in client.models.list().data] == [MODEL]
  assert httpx.get(url + "/health").status_code == 200
  text = httpx.get(url + "/metrics").text
  for name in ("jaxkv_time_to_first_token_seconds", "jaxkv_inter_token_latency_seconds",
               "jaxkv_queue_time_seconds", "jaxkv_kv_cache_usage_ratio",
               "jaxkv_generation_tokens_per_second", "jaxkv_compile_seconds"):
    assert name in text


def test_metrics_report_compile_time_apart_from_serving(server, client):
  client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
  text = httpx.get(server[0] + "/metrics").text
  value = lambda name: float(next(line.split()[-1] for line in text.splitlines()
                                  if line.startswith(f'{name}{{model_name="{MODEL}"}} ')))
  # The app's engine compiled its loop for the first request it served.
  assert value("jaxkv_compile_seconds") == pytest.approx(server[1].stats.compile_seconds)
  assert value("jaxkv_compile_seconds") > 0
  # Served and idle: the K/V usage gauge is back at zero (finished columns retire at the end
  # of the entry that finished them, not at the next one).
  assert not server[1].has_unfinished()
  assert value("jaxkv_kv_cache_usage_ratio") == 0.0


def test_completion_and_its_stream_match_the_engine(client, oracle):
  tok, expect = oracle
  prompt = "The quick brown fox"
  [(want, reason)] = expect(tuple(tok.encode(prompt).ids), 20)
  got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
  assert (got.choices[0].text, got.choices[0].finish_reason) == (want, reason)
  assert got.usage.prompt_tokens == len(tok.encode(prompt).ids)
  chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == want
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
  assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens


def test_chat_and_its_stream_match_the_engine(client, oracle):
  tok, expect = oracle
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
  [(want, reason)] = expect(_chat_ids(tok, messages), 24)
  got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                       temperature=0)
  assert got.choices[0].message.role == "assistant"
  assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want, reason)
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                               temperature=0, stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
  assert chunks[-1].choices[0].finish_reason == reason


def test_concurrent_requests_sampling_and_stop_strings(client, oracle):
  tok, expect = oracle
  prompts = ["Hello, world!", "Once upon a time", "What is the capital", "Paris is", "a", "Say"]
  wants = [expect(tuple(tok.encode(p).ids), 12)[0] for p in prompts]
  aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0)

  async def one(p):
    r = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
    return r.choices[0].text, r.choices[0].finish_reason

  async def sampled():
    return await aclient.completions.create(model=MODEL, prompt="Hello", max_tokens=10,
                                            temperature=1.0, top_p=0.9, n=2, seed=7,
                                            extra_body={"ignore_eos": True})

  async def main():
    async with aclient:
      return await asyncio.gather(*(one(p) for p in prompts), sampled(), sampled())

  *got, s1, s2 = asyncio.run(main())
  assert got == wants
  wanted = expect(tuple(tok.encode("Hello").ids), 10, temperature=1.0, top_p=0.9, n=2, seed=7,
                  stop_tokens=())
  assert [(c.text, c.finish_reason) for c in s1.choices] == wanted
  assert [c.text for c in s2.choices] == [c.text for c in s1.choices]
  # A stop string taken from the middle of a greedy output ends the text just before it.
  long_want = expect(tuple(tok.encode("The").ids), 40, stop_tokens=())[0][0]
  stop = long_want[len(long_want) // 2:len(long_want) // 2 + 3]
  r = client.completions.create(model=MODEL, prompt="The", max_tokens=40, temperature=0,
                                stop=[stop], extra_body={"ignore_eos": True})
  assert (r.choices[0].text, r.choices[0].finish_reason) == (long_want[:long_want.index(stop)],
                                                            "stop")


def test_client_disconnect_aborts_the_request(server, client):
  url, engine = server
  before = engine.stats.aborted
  stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=120, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
  first = next(iter(stream))
  assert first.choices[0].finish_reason is None
  stream.close()
  deadline = time.monotonic() + 20
  while engine.has_unfinished() or engine.stats.aborted == before:
    assert time.monotonic() < deadline, "the engine did not abort the request"
    time.sleep(0.05)
  assert (f'jaxkv_requests_finished_total{{model_name="{MODEL}",reason="abort"}}'
          in httpx.get(url + "/metrics").text)
  # Nothing runs after the abort: the K/V usage gauge is back at zero without another request.
  gauge = f'jaxkv_kv_cache_usage_ratio{{model_name="{MODEL}"}} '
  while True:
    text = httpx.get(url + "/metrics").text
    usage = float(next(l.split()[-1] for l in text.splitlines() if l.startswith(gauge)))
    if usage == 0.0:
      break
    assert time.monotonic() < deadline, f"the K/V gauge stayed at {usage} with nothing running"
    time.sleep(0.05)


def test_an_engine_failure_tells_each_client_of_its_own_request_only(server, monkeypatch):
  """Two clients in flight when the engine fails: each gets a 500 that names no request ids and
  no internals, the samples count as finished by `error` (not `abort`), and the server serves on."""
  url, engine = server
  counter = lambda reason: sum(float(l.split()[-1]) for l in httpx.get(url + "/metrics").text
                               .splitlines() if l.startswith("jaxkv_requests_finished_total")
                               and f'reason="{reason}"' in l)
  errors, aborts = counter("error"), counter("abort")
  good = engine.core._loop, engine.core._greedy_loop   # pylint: disable=protected-access

  def broken(*args):
    raise FloatingPointError("device lost in a secret place")

  monkeypatch.setattr(engine.core, "_loop", broken)
  monkeypatch.setattr(engine.core, "_greedy_loop", broken)

  async def main():
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as c:
      calls = [c.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
               for p in ("Hello", "World")]
      return await asyncio.gather(*calls, return_exceptions=True)

  got = asyncio.run(main())
  for e in got:
    assert isinstance(e, openai.InternalServerError), e
    message = e.response.json()["error"]["message"]
    assert "dropped" in message and "secret" not in message and "[" not in message, message
  assert counter("error") - errors == 2 and counter("abort") == aborts
  monkeypatch.setattr(engine.core, "_loop", good[0])
  monkeypatch.setattr(engine.core, "_greedy_loop", good[1])
  r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                 timeout=120)
  assert r.status_code == 200, r.text


@pytest.mark.parametrize("call, status, match", [
    (lambda c: c.completions.create(model="nope", prompt="x"), 404, "does not exist"),
    (lambda c: c.completions.create(model=MODEL, prompt="x", temperature=5), 400, "temperature"),
    (lambda c: c.completions.create(model=MODEL, prompt="x" * 200, max_tokens=4), 400, "max_len"),
    (lambda c: c.completions.create(model=MODEL, prompt="x", logprobs=21), 400,
     "logprobs=21 must be <= max_logprobs=20"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                         top_logprobs=2), 400, "top_logprobs needs logprobs"),
    (lambda c: c.completions.create(model=MODEL, prompt="x", presence_penalty=2.5), 400,
     "presence_penalty=2.5 must be in [-2.0, 2.0]"),
    (lambda c: c.completions.create(model=MODEL, prompt="x", extra_body={"min_p": 1.5}), 400,
     "min_p=1.5"),
    (lambda c: c.completions.create(model=MODEL, prompt="x", extra_body={"suffix": "!"}),
     400, "suffix is not supported"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "tool",
                                                                  "content": "x"}]), 400,
     "unknown role"),
    (lambda c: c.completions.create(model=MODEL, prompt=[[5, 300]]), 400, "vocab_size"),
], ids=["model", "temperature", "too-long", "logprobs", "top-logprobs", "penalty", "min-p",
        "refused-field", "template", "token-id"])
def test_bad_requests_get_clear_errors_and_the_server_stays_up(server, client, call, status,
                                                               match):
  with pytest.raises(openai.APIStatusError, match=re.escape(match)) as info:
    call(client)
  assert info.value.status_code == status
  body = info.value.response.json()
  assert body["error"]["type"] and match in body["error"]["message"]
  ok = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
  assert ok.choices[0].finish_reason in ("stop", "length")
  assert json.loads(httpx.get(server[0] + "/health").text) == {"status": "ok"}


def test_plain_request_of_a_client_that_left_is_aborted(server):
  """A non-streaming client that gives up (a read timeout closes its connection) is aborted too."""
  url, engine = server
  before = engine.stats.aborted
  body = {"model": MODEL, "prompt": "Hello", "max_tokens": 120, "n": 4, "temperature": 0,
          "ignore_eos": True}
  # The full request takes about 10x the client's patience on CPU (one token per loop entry).
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(url + "/v1/completions", json=body, timeout=0.05)
  deadline = time.monotonic() + 20
  while engine.has_unfinished() or engine.stats.aborted == before:
    assert time.monotonic() < deadline, "the engine did not abort the request"
    time.sleep(0.05)
  assert engine.stats.aborted - before == 4   # every sample of it
  r = httpx.post(url + "/v1/completions", json=body, timeout=60)
  assert r.status_code == 200 and len(r.json()["choices"]) == 4


def _token_text(tok, token_id):
  return tok.decode([token_id], skip_special_tokens=False)


def test_completion_logprobs_and_penalties_match_the_engine(client, oracle):
  """`logprobs: n` on /v1/completions, plain and streamed, equals the engine's `TokenLogprob`s."""
  tok, expect = oracle
  prompt = "The quick brown fox"
  params = dict(max_tokens=10, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5,
                repetition_penalty=1.3, min_p=0.1, logprobs=3, stop_tokens=())
  [want] = expect.engine.run([serve.Request(tuple(tok.encode(prompt).ids),
                                            serve.SamplingParams(**params))])
  plain = [_token_text(tok, t) for t in want.tokens]
  kwargs = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, presence_penalty=1.5,
                frequency_penalty=0.5, logprobs=3,
                extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.1})
  got = client.completions.create(**kwargs).choices[0]
  assert got.text == tok.decode(want.tokens, skip_special_tokens=True)
  lp = got.logprobs
  assert lp.tokens == plain
  assert lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
  assert lp.text_offset == [sum(len(x) for x in plain[:i]) for i in range(len(plain))]
  for top, t in zip(lp.top_logprobs, want.logprobs):
    expected = {_token_text(tok, i): v for i, v in t.top}
    expected.setdefault(_token_text(tok, t.token), t.logprob)
    assert top == pytest.approx(expected, abs=1e-5)
  chunks = list(client.completions.create(stream=True, **kwargs))
  streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
  assert [x for c in streamed for x in c.tokens] == plain
  assert [x for c in streamed for x in c.text_offset] == lp.text_offset
  assert [x for c in streamed for x in c.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                           abs=1e-6)
  # Without logprobs and penalties the same request decodes differently: the penalties acted.
  base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0]
  assert base.logprobs is None and base.text != got.text


def test_chat_logprobs_match_the_engine(client, oracle):
  tok, expect = oracle
  messages = [{"role": "user", "content": "Hello!"}]
  [want] = expect.engine.run([serve.Request(_chat_ids(tok, messages), serve.SamplingParams(
      max_tokens=8, logprobs=2, stop_tokens=STOP_IDS))])
  kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                top_logprobs=2)
  got = client.chat.completions.create(**kwargs).choices[0]
  content = got.logprobs.content
  assert [c.token for c in content] == [_token_text(tok, t) for t in want.tokens]
  for c, t in zip(content, want.logprobs):
    assert c.logprob == pytest.approx(t.logprob, abs=1e-5)
    assert c.bytes == list(c.token.encode("utf-8"))
    assert [(x.token, x.logprob) for x in c.top_logprobs] == [
        (_token_text(tok, i), pytest.approx(v, abs=1e-5)) for i, v in t.top]
  chunks = list(client.chat.completions.create(stream=True, **kwargs))
  streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
              for x in ch.choices[0].logprobs.content]
  assert [(x.token, x.logprob) for x in streamed] == [(c.token, c.logprob) for c in content]
  plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                         temperature=0).choices[0]
  assert plain.logprobs is None and plain.message.content == got.message.content
