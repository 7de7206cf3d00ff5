"""What ordinary OpenAI clients assume of a server, and the limits a public one needs.

Unknown request fields are accepted, fields that would change the output if
ignored are refused by name, `max_completion_tokens` bounds completions too,
`/v1/models/{id}`, `/tokenize`, `/detokenize` and `/version` answer, an API key
guards `/v1` (constant-time compare, 401 otherwise), CORS follows
`allowed_origins`, and oversized or malformed input gets a 4xx naming the
problem, never a 500 or another client's internal id. Expectations come from
the `tokenizers` library and the request itself, not from the engine.
"""

from __future__ import annotations

import gc
import json
import os

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the server tests need the test extra's openai")
pytest.importorskip("fastapi", reason="the server tests need the serve extra's fastapi")
import tokenizers  # pylint: disable=wrong-import-position

import hf_reference  # pylint: disable=wrong-import-order
from http_server import running  # pylint: disable=wrong-import-order
from jaxkv.cli import build_server
from jaxkv.http.app import create_app

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
MODEL = "tiny-llama"
KEY = "sk-test-0123456789"
ORIGIN = "https://app.example"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def built():
  engine, tokenizer, _ = build_server(CHECKPOINT, max_seqs=4, max_len=64, max_write=16)
  return engine, tokenizer


@pytest.fixture(scope="module")
def url(built):
  engine, tokenizer = built
  app = create_app(engine, tokenizer, model_name=MODEL, interval=4, api_key=KEY,
                   allowed_origins=[ORIGIN], max_body_bytes=4096, max_prompts=3, max_queued=2,
                   max_queued_tokens=40)
  with running(app) as base:
    yield base


@pytest.fixture(scope="module")
def client(url):
  with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=180) as c:
    yield c


def _post(url, path, body, key=KEY, **kw):
  headers = {} if key is None else {"Authorization": f"Bearer {key}"}
  return httpx.post(url + path, json=body, headers=headers, timeout=180, **kw)


def _error(r, status, param, fragment):
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert set(error) == {"message", "type", "param", "code"}
  assert error["param"] == param and fragment in error["message"], error
  return error


def test_fields_that_change_nothing_are_accepted_and_unknown_ones_refused_by_name(client, url):
  got = client.chat.completions.create(
      model=MODEL, messages=HI, max_tokens=3, temperature=0,
      extra_body={"store": False, "metadata": {"k": "v"}, "parallel_tool_calls": False,
                  "service_tier": "auto"})
  plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
  assert got.choices[0].message.content == plain.choices[0].message.content
  assert got.usage.completion_tokens == 3
  for name, value, fragment in (("made_up_field", [1, 2], "made_up_field is not a field"),
                                ("reasoning_effort", "low", "reasoning_effort is not supported"),
                                ("store", True, "does not store completions"),
                                ("bad_words", ["x"], "bad_words is not a field")):
    for path, body in (("/v1/chat/completions", {"messages": HI}),
                       ("/v1/completions", {"prompt": "Hi"})):
      _error(_post(url, path, {"model": MODEL, "max_tokens": 2, name: value} | body), 400, name,
             fragment)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, "suffix"),
])
def test_fields_that_would_change_the_output_are_refused_by_name(url, path, body, param):
  _error(_post(url, path, {"model": MODEL} | body), 400, param, "not supported")


def test_an_image_part_is_refused_at_the_message(url):
  body = {"model": MODEL, "messages": [{"role": "user", "content": [
      {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
  r = _post(url, "/v1/chat/completions", body)
  assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_max_completion_tokens_bounds_completions_too(client):
  got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0,
                                  extra_body={"max_completion_tokens": 2, "ignore_eos": True})
  assert got.usage.completion_tokens == 2 and got.choices[0].finish_reason == "length"


def test_model_by_id_and_version(url, client):
  assert client.models.retrieve(MODEL).id == MODEL
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("other")
  from jaxkv import __version__   # pylint: disable=g-import-not-at-top
  assert httpx.get(url + "/version").json() == {"version": __version__}


def test_tokenize_and_detokenize_agree_with_the_tokenizer(url):
  tok = tokenizers.Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
  r = _post(url, "/tokenize", {"prompt": "Hello there"})
  want = tok.encode("Hello there").ids
  assert r.status_code == 200 and r.json() == {"tokens": want, "count": len(want),
                                              "max_model_len": 64}
  r = _post(url, "/detokenize", {"tokens": want})
  assert r.json() == {"prompt": tok.decode(want)}
  _error(_post(url, "/detokenize", {"tokens": [10**6]}), 400, "tokens", "vocab_size")
  assert _post(url, "/tokenize", {}).status_code == 400   # neither prompt nor messages


def test_the_api_key_guards_v1_only(url):
  body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
  for key in (None, "wrong", KEY + "x"):
    r = _post(url, "/v1/completions", body, key=key)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
  assert httpx.get(url + "/v1/models").status_code == 401
  assert _post(url, "/v1/completions", body).status_code == 200
  assert httpx.get(url + "/health").status_code == 200
  assert httpx.get(url + "/metrics").status_code == 200
  with openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as bad:
    with pytest.raises(openai.AuthenticationError):
      bad.models.list()


def test_cors_answers_the_allowed_origin_only(url):
  ask = lambda origin: httpx.options(url + "/v1/completions", headers={
      "Origin": origin, "Access-Control-Request-Method": "POST"})
  assert ask(ORIGIN).headers.get("access-control-allow-origin") == ORIGIN
  assert "access-control-allow-origin" not in ask("https://evil.example").headers


def test_oversized_bodies_and_too_many_prompts_get_413(url):
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x" * 5000})
  assert r.status_code == 413 and "body" in r.json()["error"]["message"]
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c", "d"]})
  _error(r, 413, "prompt", "at most 3")


def test_a_lone_surrogate_is_a_400_naming_the_field(url):
  raw = '{"model": "%s", "prompt": "bad \\ud800 text", "max_tokens": 2}' % MODEL
  r = httpx.post(url + "/v1/completions", content=raw, timeout=180,
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
  _error(r, 400, "prompt", "not valid Unicode")
  raw = ('{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL)
  r = httpx.post(url + "/v1/chat/completions", content=raw, timeout=180,
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
  _error(r, 400, "messages", "not valid Unicode")


def test_refusals_name_no_internal_request_ids(url):
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": [1, 2], "n": 9})
  error = _error(r, 400, "n", "max_seqs=4")
  assert "request " not in error["message"], error


def test_a_request_no_queue_could_take_gets_413_and_a_full_queue_503(url, built, monkeypatch):
  """Past `max_queued` or `max_queued_tokens` by itself: 413 naming the limit (a retry cannot
  succeed); past them only beside what waits: 503 with Retry-After. Nothing is served or kept."""
  engine, _ = built
  before = engine.stats.generated
  # Three prompts: 3 > max_queued=2 even on an idle server.
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2})
  _error(r, 413, "prompt", "at most max_queued=2")
  assert "retry-after" not in r.headers
  assert engine.stats.generated == before and not engine.has_unfinished()
  # Two prompts of 21 tokens: 42 > max_queued_tokens=40 even on an idle server.
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": [[5] * 21, [6] * 21],
                                     "max_tokens": 2})
  _error(r, 413, "prompt", "hold 42 tokens; at most max_queued_tokens=40")
  assert engine.waiting_tokens == 0 and not engine.has_unfinished()
  # What would fit an emptier queue: 503 while others wait (their count faked, nothing runs).
  monkeypatch.setattr(engine, "counts", lambda: (4, 1))
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
  assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
  assert r.json()["error"]["type"] == "server_busy"
  monkeypatch.setattr(engine, "counts", lambda: (4, 0))
  monkeypatch.setattr(type(engine), "waiting_tokens", property(lambda self: 30))
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": [[5] * 6, [6] * 5],
                                     "max_tokens": 2})
  assert r.status_code == 503 and "would hold 41 tokens (at most 40)" in r.text, r.text
  monkeypatch.undo()
  assert engine.stats.generated == before and not engine.has_unfinished()
  r = _post(url, "/v1/completions", {"model": MODEL, "prompt": [[5] * 20, [6] * 20],
                                     "max_tokens": 2, "ignore_eos": True})
  assert r.status_code == 200 and [c["finish_reason"] for c in r.json()["choices"]] == [
      "length", "length"]
  assert engine.waiting_tokens == 0, r.text


def test_every_error_body_is_json_in_openais_shape(url):
  r = httpx.post(url + "/v1/completions", content=b"{not json", timeout=180,
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
  assert r.status_code == 400 and set(json.loads(r.text)["error"]) == {
      "message", "type", "param", "code"}


def test_a_body_of_exactly_max_body_bytes_is_accepted_and_one_byte_more_is_not(url):
  """max_body_bytes=4096 is the largest body served: the guard refuses only bodies over it."""
  def body(size):
    head = '{"model": "%s", "prompt": "' % MODEL
    raw = (head + "x" * (size - len(head) - 2) + '"}').encode()
    assert len(raw) == size
    return httpx.post(url + "/tokenize", content=raw, timeout=180,
                      headers={"Content-Type": "application/json"})
  r = body(4096)
  assert r.status_code == 200 and r.json()["count"] > 0, r.text
  r = body(4097)
  assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]["message"], r.text


def _rss() -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))


def test_the_body_limit_holds_for_chunked_bodies(url):
  """A body sent chunked (no Content-Length) is refused once it passes max_body_bytes=4096, and
  the server reads no more of it: 40 MB sent that way leaves its memory within 64 MB."""
  headers = {"Content-Type": "application/json"}
  def chunked(size, piece=1024):   # made as sent: the client holds one piece at a time
    head = b'{"model": "%s", "prompt": "' % MODEL.encode()
    yield head
    left = size - len(head) - 2
    while left > 0:
      yield b"x" * min(piece, left)
      left -= piece
    yield b'"}'
  r = httpx.post(url + "/tokenize", content=chunked(4000), headers=headers, timeout=60)
  assert r.status_code == 200 and r.json()["count"] > 0, r.text   # within the limit: served
  r = httpx.post(url + "/tokenize", content=chunked(64 * 1024), headers=headers, timeout=60)
  assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]["message"], r.text
  before = _rss()
  try:
    r = httpx.post(url + "/tokenize", content=chunked(40 << 20, 1 << 16), headers=headers,
                   timeout=60)
    assert r.status_code == 413, r.text
  except httpx.TransportError:
    pass   # the server answered and closed while the client was still sending
  assert _rss() - before < 64 << 20
  assert httpx.get(url + "/health", timeout=60).status_code == 200


def test_a_text_prompt_no_sequence_could_hold_is_refused_before_tokenising():
  """A 10 MB text prompt (under the body limit) gets 400 naming the prompt without being
  tokenised: well under a second of CPU (tokenising it takes ~10 s), memory back after, and
  nothing reaches the engine."""
  # Its own engine: the module's server already drives `built`'s (one AsyncEngine an engine).
  engine, tokenizer, _ = build_server(CHECKPOINT, max_seqs=1, max_len=64, max_write=16)
  app = create_app(engine, tokenizer, model_name=MODEL, max_body_bytes=16 << 20)
  text = "the quick brown fox jumps over the lazy dog " * (10_000_000 // 44)
  with running(app) as base, openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                           timeout=60) as c:
    def refused():
      with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=MODEL, prompt=text, max_tokens=4)
      assert info.value.body["param"] == "prompt" and "tokens long" in info.value.body["message"]
      with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
      assert info.value.body["param"] == "messages"

    before_cpu = os.times()
    refused()
    after = os.times()   # this process holds the server, the client and their JSON of 10 MB
    assert (after.user + after.system) - (before_cpu.user + before_cpu.system) < 2.0
    # This process is the client too: its allocator may keep what the first 10 MB bodies used
    # (glibc raises its mmap threshold), so memory is compared across the next two refusals.
    gc.collect()
    before_rss = _rss()
    refused()
    refused()
    gc.collect()
    assert _rss() - before_rss < 64 << 20
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    assert engine.counts() == (0, 0) and engine.stats.steps == 0


def test_echo_prepends_the_prompt_and_max_tokens_0_returns_it_alone(client):
  """`echo`: each choice's text starts with its prompt (as sent, or the ids' text), plain and
  streamed; usage counts only generated tokens. With `max_tokens: 0` nothing is generated."""
  tok = tokenizers.Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
  plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
  echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                     echo=True, extra_body={"ignore_eos": True})
  assert echoed.choices[0].text == "Hello" + plain.choices[0].text
  assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 3
  ids = tok.encode("Hello there", add_special_tokens=False).ids
  stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                     echo=True, stream=True, n=2,
                                     extra_body={"ignore_eos": True})
  texts = {0: "", 1: ""}
  for chunk in stream:
    for c in chunk.choices:
      texts[c.index] += c.text
  alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
  assert texts == {0: tok.decode(ids) + alone, 1: tok.decode(ids) + alone}
  only = client.completions.create(model=MODEL, prompt=["Hi", "Hello"], max_tokens=0, echo=True)
  assert [c.text for c in only.choices] == ["Hi", "Hello"]
  assert {c.finish_reason for c in only.choices} == {"length"}
  assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == sum(
      len(tok.encode(t).ids) for t in ("Hi", "Hello"))
  streamed = client.completions.create(model=MODEL, prompt="Hi", max_tokens=0, echo=True,
                                       stream=True, stream_options={"include_usage": True})
  chunks = list(streamed)
  assert "".join(c.text for ch in chunks for c in ch.choices) == "Hi"
  assert chunks[-1].usage.completion_tokens == 0


def test_tokenizer_info_describes_the_tokenizer_in_use(url):
  """vLLM's `/tokenizer_info`: tokenizer_config.json's fields, the chat template the server
  renders, the stop ids and max_len, read from the checkpoint's files (not the server's)."""
  with open(os.path.join(CHECKPOINT, "tokenizer_config.json"), encoding="utf-8") as f:
    config = json.load(f)
  info = httpx.get(url + "/tokenizer_info", timeout=60).json()
  tok = tokenizers.Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
  assert info["model_max_length"] == 64 and info["vocab_size"] == tok.get_vocab_size()
  assert info["eos_token"] == config["eos_token"] and info["chat_template"] == config[
      "chat_template"]
  assert info["tokenizer_class"] == config.get("tokenizer_class", "PreTrainedTokenizerFast")
  assert info["eos_token_ids"] and all(0 <= t < info["vocab_size"] for t in info["eos_token_ids"])


def test_echo_with_logprobs_and_prompt_logprobs_score_the_prompt_as_a_float64_pass(client):
  """`echo` + `logprobs` (OpenAI's prompt scoring, lm-eval's loglikelihood call) and vLLM's
  `prompt_logprobs`: each prompt token's logprob given the ones before it, its rank and the
  top n, equal to a float64 NumPy forward pass of the checkpoint; plain, streamed, and with
  `max_tokens: 0`. The first token has none (null)."""
  config, weights = hf_reference.load(CHECKPOINT)
  ids = [5, 9, 17, 30, 41, 77]
  lp = hf_reference.log_probs(config, weights, ids)
  want = [lp[i - 1, ids[i]] for i in range(1, len(ids))]
  ranks = [1 + int(np.sum(lp[i - 1] > lp[i - 1, ids[i]])) for i in range(1, len(ids))]
  kw = dict(model=MODEL, prompt=ids, echo=True, logprobs=2, temperature=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                        "prompt_logprobs": 3})
  for max_tokens in (0, 2):
    got = client.completions.create(max_tokens=max_tokens, **kw)
    choice = got.choices[0]
    lps = choice.logprobs
    assert lps.tokens[:len(ids)] == [f"token_id:{t}" for t in ids]
    assert len(lps.tokens) == len(lps.token_logprobs) == len(ids) + max_tokens
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-4)
    for i in range(1, len(ids)):   # the top 2, plus the prompt's token where it is not in them
      best = np.argsort(lp[i - 1])[::-1][:2]
      top = lps.top_logprobs[i]
      assert {f"token_id:{t}" for t in best} <= set(top) and len(top) <= 3
      assert [top[f"token_id:{t}"] for t in best] == pytest.approx(lp[i - 1, best], abs=1e-4)
    assert lps.text_offset == sorted(lps.text_offset) and lps.text_offset[0] == 0
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == max_tokens
    prompt_lps = choice.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for i, entry in enumerate(prompt_lps[1:], 1):
      assert entry[str(ids[i])]["logprob"] == pytest.approx(want[i - 1], abs=1e-4)
      assert entry[str(ids[i])]["rank"] == ranks[i - 1]
      best = np.argsort(lp[i - 1])[::-1][:3]
      assert {str(t) for t in best} <= set(entry) and len(entry) <= 4
      assert [entry[str(t)]["rank"] for t in best] == [1, 2, 3] or ranks[i - 1] <= 3
  plain = got
  chunks = list(client.completions.create(max_tokens=2, stream=True, **kw))
  streamed = [t for c in chunks for ch in c.choices if ch.logprobs
              for t in ch.logprobs.token_logprobs]
  plain_lps = plain.choices[0].logprobs.token_logprobs
  assert streamed[0] is None and len(streamed) == len(plain_lps)
  assert streamed[1:] == pytest.approx(plain_lps[1:], abs=1e-6)
  assert chunks[0].choices[0].model_extra["prompt_logprobs"] == plain.choices[0].model_extra[
      "prompt_logprobs"]
  chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                        extra_body={"prompt_logprobs": 0})
  chat_lps = chat.choices[0].model_extra["prompt_logprobs"]
  assert chat_lps[0] is None and all(len(e) == 1 for e in chat_lps[1:])
  assert len(chat_lps) == chat.usage.prompt_tokens


def test_min_tokens_holds_stop_tokens_back_through_the_server(client):
  """vLLM's `min_tokens`: the stop token the greedy sample would end on first is not drawn
  before it; usage counts the tokens that came back."""
  kw = dict(model=MODEL, prompt=[5, 9, 17], max_tokens=6, temperature=0, logprobs=0)
  ids = lambda r: [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
  free = ids(client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True,
                                                         "ignore_eos": True}))
  for min_tokens in (0, 3):
    got = client.completions.create(**kw, extra_body={
        "return_tokens_as_token_ids": True, "ignore_eos": True, "stop_token_ids": [free[0]],
        "min_tokens": min_tokens})
    tokens = ids(got)
    assert got.usage.completion_tokens == len(tokens)
    if min_tokens == 0:
      assert tokens == free[:1] and got.choices[0].finish_reason == "stop"
    else:
      assert len(tokens) >= 3 and free[0] not in tokens[:3]


def test_logit_bias_forces_and_forbids_tokens_through_the_server(client):
  """OpenAI's `logit_bias` (token ids as strings): +100 makes a token the only one drawn,
  -100 keeps the greedy choice out; logprobs stay the raw distribution's."""
  kw = dict(model=MODEL, prompt=[5, 9, 17], max_tokens=4, logprobs=2,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
  ids = lambda r: [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
  free = client.completions.create(temperature=0, **kw)
  forced = client.completions.create(temperature=1.0, seed=3, logit_bias={"17": 100}, **kw)
  assert ids(forced) == [17] * 4
  banned = client.completions.create(temperature=0, logit_bias={str(ids(free)[0]): -100}, **kw)
  # Its first pick is the free request's runner-up, reported with its raw logprob.
  top = free.choices[0].logprobs.top_logprobs[0]
  runner_up = sorted(top, key=top.get)[-2]
  assert banned.choices[0].logprobs.tokens[0] == runner_up
  assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(top[runner_up], abs=1e-5)
  only = client.completions.create(temperature=1.0, seed=4, **(kw | {"extra_body": kw[
      "extra_body"] | {"allowed_token_ids": [20, 30]}}))
  assert set(ids(only)) <= {20, 30}
