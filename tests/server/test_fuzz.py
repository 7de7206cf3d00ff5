"""A bounded fuzz of the HTTP server: hypothesis draws request bodies, well-formed and not.

Each example sends a batch of 1-4 bodies at once (threads) to `/v1/completions` or
`/v1/chat/completions` while `/health` is polled. It asserts: no 5xx ever; every refusal
is a 4xx in OpenAI's error shape; `/health` keeps answering; and every well-formed greedy
request's text equals the same request sent alone afterwards (batching changes nothing).
The engine ends each example with nothing in flight. The budget is `FUZZ_EXAMPLES`
examples (JAXKV_SERVER_FUZZ_EXAMPLES overrides it).
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from http_server import running  # noqa: E402
from jaxkv.cli import build_server  # noqa: E402
from jaxkv.http.app import create_app  # noqa: E402

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
MODEL = "tiny-llama"
MAX_LEN = 64
FUZZ_EXAMPLES = int(os.environ.get("JAXKV_SERVER_FUZZ_EXAMPLES", "25"))

_SERVER = {}
SEEN = {"ok": 0, "refused": 0, "compared": 0}   # the fuzz is not vacuous: each must occur


def _server():
  if not _SERVER:
    engine, tokenizer, _ = build_server(CHECKPOINT, max_seqs=4, max_len=MAX_LEN, max_write=16)
    app = create_app(engine, tokenizer, model_name=MODEL, interval=4, max_prompts=4,
                     max_body_bytes=1 << 16)
    ctx = running(app)
    _SERVER.update(url=ctx.__enter__(), engine=engine, ctx=ctx)
  return _SERVER


@pytest.fixture(scope="module")
def server():
  yield _server()
  print(f"server fuzz: {SEEN}")
  assert SEEN["ok"] and SEEN["refused"] and SEEN["compared"], SEEN
  ctx = _SERVER.pop("ctx", None)
  if ctx is not None:
    ctx.__exit__(None, None, None)
  _SERVER.clear()


ODD = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                st.text(max_size=8), st.lists(st.integers(-5, 300), max_size=4),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
IDS = st.lists(st.integers(0, 127), min_size=1, max_size=12)


@st.composite
def body(draw):
  """`(path, body, well_formed_greedy)`: a valid body, then maybe one field broken."""
  chat = draw(st.booleans())
  out = {"model": MODEL, "max_tokens": draw(st.integers(1, 12)), "temperature": 0.0}
  if chat:
    out["messages"] = [{"role": "user", "content": draw(TEXT)}]
  else:
    out["prompt"] = draw(st.one_of(TEXT, IDS, st.lists(IDS, min_size=1, max_size=3)))
  for name, value in draw(st.lists(st.sampled_from([
      ("stop", ["a", "b"]), ("ignore_eos", True), ("n", 2), ("seed", 3), ("top_p", 0.9),
      ("stream", True), ("presence_penalty", 0.5), ("user", "x"), ("logprobs", 2),
      ("unknown_field", 1)]), max_size=3)):
    if chat and name == "logprobs":
      name, value = "top_logprobs", 2
      out["logprobs"] = True
    out[name] = value
  greedy = out.get("n", 1) == 1 and "seed" not in out
  if draw(st.integers(0, 2)) == 0:   # one field broken or an odd one added
    field = draw(st.sampled_from(["max_tokens", "temperature", "n", "prompt", "messages",
                                  "stop", "logprobs", "top_p", "model", "stream", "seed"]))
    out[field] = draw(ODD)
    greedy = False
  return ("/v1/chat/completions" if chat else "/v1/completions"), out, greedy


def _send(url, path, payload):
  with httpx.Client(base_url=url, timeout=300) as c:
    r = c.post(path, json=payload)
    return r.status_code, r.text


def _text(path, status, text):
  """The generated texts of a 200 (streamed or not), in choice order."""
  import json   # pylint: disable=g-import-not-at-top
  if text.startswith("data:"):
    out = {}
    for line in text.splitlines():
      if line.startswith("data: {"):
        for c in json.loads(line[6:]).get("choices", []):
          piece = c.get("text") if "text" in c else c.get("delta", {}).get("content")
          out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return [out[k] for k in sorted(out)]
  body = json.loads(text)
  return [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]]


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(batch=st.lists(body(), min_size=1, max_size=4))
def test_no_5xx_health_answers_and_batched_equals_alone(server, batch):
  url, engine = server["url"], server["engine"]
  with concurrent.futures.ThreadPoolExecutor(len(batch) + 1) as pool:
    futures = [pool.submit(_send, url, path, payload) for path, payload, _ in batch]
    health = []
    while not all(f.done() for f in futures):
      start = time.perf_counter()
      assert httpx.get(url + "/health", timeout=60).status_code == 200
      health.append(time.perf_counter() - start)
    results = [f.result() for f in futures]
  import json   # pylint: disable=g-import-not-at-top
  for (path, payload, greedy), (status, text) in zip(batch, results):
    assert status < 500, (payload, text)
    SEEN["ok" if status == 200 else "refused"] += 1
    if status != 200:
      error = json.loads(text)["error"]
      assert set(error) == {"message", "type", "param", "code"}, text
      assert "request " not in error["message"] or "request body" in error["message"], text
      continue
    if greedy:
      alone = _send(url, path, payload)
      assert alone[0] == 200 and _text(path, *alone) == _text(path, status, text), payload
      SEEN["compared"] += 1
  deadline = time.monotonic() + 30
  while engine.has_unfinished() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not engine.has_unfinished() and engine.waiting_tokens == 0
