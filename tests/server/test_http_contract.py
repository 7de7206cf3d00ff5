"""The HTTP contract of the OpenAI-compatible server, checked against expectations of its own.

No engine runs beside the server here: every expected status, error body,
text, token count and finish reason is written into the test. Greedy outputs
of the tiny `tests/fixtures/hf_llama` checkpoint were produced once with
`serve.Engine.run` (temperature 0, `stop_tokens=()`, 40 tokens) on CPU and
decoded with the `tokenizers` library; logprobs are checked against the
`transformers` logits committed beside the checkpoint (`logits.npz`).

One server for the module: uvicorn in a thread on a socket this test bound to
a free localhost port, driven by the official `openai` client, always stopped.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the server tests need the test extra's openai")
pytest.importorskip("fastapi", reason="the server tests need the serve extra's fastapi")
import tokenizers  # pylint: disable=wrong-import-position

from jaxkv.cli import build_server
from jaxkv.http.app import create_app
from http_server import running  # pylint: disable=wrong-import-order

CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
MODEL = "tiny-llama"
MAX_LEN = 128
MAX_SEQS = 4
HI = [{"role": "user", "content": "Hi"}]

# Greedy continuation of the completion prompt "Hello" (the tokenizer adds <s>: 7 prompt tokens).
# Token ids [104, 107, 89, 96, 113, 88, 19, 18, 19, 96, 19, 18, 38, 20, 45, 104, 39, 89, 20, 5,
# 87, ...]: pieces 'he','es','r','y','ca','q',',','+',',','y',',','+','?','-','F','he','@',...
HELLO_TEXT = "heesrycaq,+,y,+?-Fhe@r-"   # the first 19 tokens; token 19 is <|user|> (special)
# Greedy continuation of the chat [user: "Hi"] (6 prompt tokens): ids [92, 54, 126, 26, 108, ...],
# pieces 'u','O','ld','3',' a'.
CHAT_HI = ["u", "O", "ld", "3", " a"]
# logits.npz's `tokens_3`, a prompt given as token ids; its greedy continuation is ids
# [73, 19, 56, 77, 95, 2, ...] = 'b', ',', 'Q', 'f', 'x', '</s>' (eos_token_id 2).
IDS_PROMPT = [87, 121, 83, 107, 88, 90, 49]


@pytest.fixture(scope="module")
def server():
  engine, tokenizer, _ = build_server(CHECKPOINT, max_seqs=MAX_SEQS, max_len=MAX_LEN,
                                      max_write=16)
  with running(create_app(engine, tokenizer, model_name=MODEL, interval=4)) as url:
    yield url


@pytest.fixture(scope="module")
def client(server):
  with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=180) as c:
    yield c


def _create(client, endpoint, body):
  """POSTs `body` (any JSON, wrong types included) to `endpoint` with the openai client."""
  if endpoint == "chat":
    return client.chat.completions.create(model=MODEL, messages=HI, extra_body=body)
  return client.completions.create(model=MODEL, prompt="Hi", extra_body=body)


def _refusal(client, endpoint, body):
  """The status code and error body of a request the server must refuse."""
  with pytest.raises(openai.APIStatusError) as info:
    _create(client, endpoint, body)
  return info.value.status_code, info.value.response.json()


def _check_error(status, body, *, param, fragment, code=400, kind="invalid_request_error"):
  assert status == code
  assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
  error = body["error"]
  assert (error["type"], error["param"], error["code"]) == (kind, param, None), error
  assert fragment in error["message"], error["message"]


# (endpoint, body fields, the param the error must name, a fragment of its message).
BAD_FIELDS = [
    ("chat", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("completions", {"max_tokens": "5"}, "max_tokens", "valid integer"),
    ("completions", {"max_tokens": 1.5}, "max_tokens", "valid integer"),
    ("completions", {"max_tokens": True}, "max_tokens", "valid integer"),
    ("chat", {"max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ("chat", {"max_completion_tokens": -3}, "max_completion_tokens", "greater than or equal to 1"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ("chat", {"max_completion_tokens": "x"}, "max_completion_tokens", "valid integer"),
    ("chat", {"messages": []}, "messages", "at least 1 item"),
    ("chat", {"messages": "Hi"}, "messages", "valid list"),
    ("completions", {"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ("completions", {"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ("completions", {"temperature": "hot"}, "temperature", "valid number"),
    ("completions", {"top_p": 0}, "top_p", "greater than 0"),
    ("completions", {"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ("completions", {"top_k": -2}, "top_k", "greater than or equal to -1"),
    ("completions", {"top_k": 2.0}, "top_k", "valid integer"),
    ("completions", {"n": 0}, "n", "greater than or equal to 1"),
    ("completions", {"n": -1}, "n", "greater than or equal to 1"),
    ("completions", {"n": "two"}, "n", "valid integer"),
    ("completions", {"seed": -1}, "seed", "greater than or equal to 0"),
    ("completions", {"seed": 2**31}, "seed", "less than 2147483648"),
    ("completions", {"seed": "s"}, "seed", "valid integer"),
    ("completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("completions", {"logprobs": True}, "logprobs", "valid integer"),
    ("completions", {"logprobs": "3"}, "logprobs", "valid integer"),
    ("chat", {"logprobs": 1}, "logprobs", "valid boolean"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
    ("completions", {"presence_penalty": -2.5}, "presence_penalty", "must be in [-2.0, 2.0]"),
    ("completions", {"presence_penalty": "x"}, "presence_penalty", "valid number"),
    ("completions", {"frequency_penalty": 2.5}, "frequency_penalty", "must be in [-2.0, 2.0]"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "must be > 0"),
    ("completions", {"repetition_penalty": -1}, "repetition_penalty", "must be > 0"),
    ("completions", {"min_p": -0.1}, "min_p", "must be in [0.0, 1.0]"),
    ("completions", {"min_p": 1.5}, "min_p", "must be in [0.0, 1.0]"),
    ("completions", {"stop": 5}, "stop", "a string or a list of strings"),
    ("completions", {"stop": ["a", 5]}, "stop", "a string or a list of strings"),
    ("completions", {"stop": [""]}, "stop", "must not hold an empty string"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids", "must be >= 0"),
    ("completions", {"stop_token_ids": 3}, "stop_token_ids", "valid list"),
    ("completions", {"stop_token_ids": ["a"]}, "stop_token_ids.0", "valid integer"),
    ("completions", {"prompt": 5}, "prompt", "prompt must be a string"),
    ("completions", {"prompt": [1, "a"]}, "prompt", "prompt must be a string"),
    ("completions", {"prompt": [-1]}, "prompt", "prompt token ids must be >= 0"),
    ("completions", {"prompt": []}, "prompt", "no tokens"),
    ("completions", {"prompt": [[]]}, "prompt", "no tokens"),
    ("completions", {"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ("completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens",
     "min_tokens=5 must be <= max_tokens=2"),
    ("completions", {"best_of": 2}, "best_of", "only best_of == n"),
    ("completions", {"echo": True, "max_tokens": 0, "logprobs": 10**6}, "logprobs",
     "max_logprobs"),
    ("completions", {"prompt_logprobs": 10**6}, "prompt_logprobs", "max_logprobs"),
    ("chat", {"prompt_logprobs": -1}, "prompt_logprobs", "greater than or equal to 0"),
    ("completions", {"max_tokens": 0}, "max_tokens", "needs echo=true"),
    ("completions", {"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ("completions", {"suffix": "x"}, "suffix", "suffix is not supported"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias", "must be in [-100, 100]"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias", "token ids (as strings)"),
    ("completions", {"logit_bias": {"999": 1}}, "logit_bias", "must be < vocab_size"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids", "allows no token"),
    ("chat", {"allowed_token_ids": [999]}, "allowed_token_ids", "must be < vocab_size"),
    ("chat", {"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "'xml' is not supported"),
    ("chat", {"response_format": {}}, "response_format", "needs a type"),
    ("completions", {"stream": "yes"}, "stream", "valid boolean"),
    ("completions", {"ignore_eos": "x"}, "ignore_eos", "valid boolean"),
    ("completions", {"stream_options": {"include_usage": "x"}}, "stream_options.include_usage",
     "valid boolean"),
    ("completions", {"model": 5}, "model", "valid string"),
]


@pytest.mark.parametrize("endpoint, body, param, fragment", BAD_FIELDS,
                         ids=[f"{e}-{'-'.join(f'{k}={v!r}' for k, v in b.items())}"[:60]
                              for e, b, _, _ in BAD_FIELDS])
def test_a_bad_field_gets_a_400_naming_it(client, endpoint, body, param, fragment):
  status, error = _refusal(client, endpoint, body)
  _check_error(status, error, param=param, fragment=fragment)


def test_an_unknown_model_is_a_404_naming_the_model(client):
  status, error = _refusal(client, "completions", {"model": "nope"})
  _check_error(status, error, param="model", fragment="'nope' does not exist", code=404,
               kind="not_found_error")


# Refusals decided by the engine's sizes (max_len, max_seqs, max_logprobs, vocab_size) are made
# in the app, whose 400s name no field today (`param: null`) or the wrong one.
ENGINE_LIMITS = [
    ("completions", {"max_tokens": 1000}, "max_tokens", "max_len=128"),
    ("chat", {"max_completion_tokens": 1000}, "max_completion_tokens", "max_len=128"),
    ("completions", {"n": MAX_SEQS + 1}, "n", "max_seqs=4"),
    ("completions", {"logprobs": 21}, "logprobs", "max_logprobs=20"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "max_logprobs=20"),
    ("completions", {"stop_token_ids": [128]}, "stop_token_ids", "vocab_size=128"),
    ("completions", {"prompt": [128]}, "prompt", "vocab_size=128"),
    ("completions", {"prompt": "x " * 150, "max_tokens": None}, "prompt", "max_len=128"),
    # Too long on its own: the prompt is named even when the client set an output limit.
    ("completions", {"prompt": "x " * 150, "max_tokens": 4}, "prompt", "max_len=128"),
]


@pytest.mark.parametrize("endpoint, body, param, fragment", ENGINE_LIMITS,
                         ids=[f"{e}-{next(iter(b))}" for e, b, _, _ in ENGINE_LIMITS])
def test_a_request_past_the_engines_limits_gets_a_400_naming_the_field(client, endpoint, body,
                                                                       param, fragment):
  status, error = _refusal(client, endpoint, body)
  _check_error(status, error, param=param, fragment=fragment)


@pytest.mark.parametrize("endpoint, body, fragment", [
    (e, b, f) for e, b, _, f in ENGINE_LIMITS])
def test_a_request_past_the_engines_limits_gets_a_400_saying_which(client, endpoint, body,
                                                                  fragment):
  """The part of the engine-limit refusals that holds today: a 400 in OpenAI's shape."""
  status, error = _refusal(client, endpoint, body)
  assert status == 400 and set(error["error"]) == {"message", "type", "param", "code"}
  assert error["error"]["type"] == "invalid_request_error" and fragment in error["error"]["message"]


def _one(response):
  [choice] = response.choices
  return choice


def test_max_tokens_and_max_completion_tokens_bound_the_output_exactly(client):
  chat = lambda **kw: client.chat.completions.create(model=MODEL, messages=HI, temperature=0,
                                                     **kw)
  for kwargs, count in [(dict(max_tokens=5), 5), (dict(max_completion_tokens=3), 3),
                        (dict(max_completion_tokens=2, max_tokens=5), 2),
                        (dict(max_completion_tokens=4, max_tokens=1), 4)]:
    got = chat(**kwargs)
    assert (_one(got).message.content, _one(got).finish_reason) == ("".join(CHAT_HI[:count]),
                                                                     "length"), kwargs
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (6, count), kwargs
  got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=7, temperature=0)
  assert (_one(got).text, _one(got).finish_reason) == ("heesrycaq,", "length")
  assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (7, 7)


@pytest.mark.parametrize("stop_ids, text, tokens", [
    # 18 ('+') first comes at output token 8, 38 ('?') at 13: the earlier one ends the request
    # whichever of the two is listed first; the stop token is kept.
    ([18, 38], "heesrycaq,+", 8),
    ([38, 18], "heesrycaq,+", 8),
    ([120, 38], "heesrycaq,+,y,+?", 13),   # 120 never comes
    ([120, 121, 122, 88], "heesrycaq", 6),  # the last of several listed ids ('q', token 6)
])
def test_stop_token_ids_end_the_output_at_the_first_listed_id_to_come(client, stop_ids, text,
                                                                      tokens):
  got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": stop_ids})
  assert (_one(got).text, _one(got).finish_reason) == (text, "stop")
  assert got.usage.completion_tokens == tokens


def test_the_checkpoints_eos_ids_stop_unless_ignored(client):
  got = client.completions.create(model=MODEL, prompt=IDS_PROMPT, max_tokens=40, temperature=0)
  # '</s>' (id 2) ends it as the 6th token; special tokens are not in the text.
  assert (_one(got).text, _one(got).finish_reason, got.usage.completion_tokens) == (
      "b,Qfx", "stop", 6)
  got = client.completions.create(model=MODEL, prompt=IDS_PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
  assert (_one(got).text, _one(got).finish_reason, got.usage.completion_tokens) == (
      "b,Qfx3#", "length", 8)   # the </s> among them is not text


@pytest.mark.parametrize("stop, text", [
    (["y,+"], "heesrycaq,+,"),           # spans three tokens; its first match is the second 'y'
    (["?-F", "q,"], "heesryca"),         # the earliest of two strings wins
    ("es", "he"),                         # inside one token ('es'), given as a bare string
    (["zz"], "heesrycaq,+,y,+?-Fhe"),     # never comes: the 16-token limit ends it
])
def test_stop_strings_cut_the_text_before_them(client, stop, text):
  got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0,
                                  stop=stop)
  reason = "length" if stop == ["zz"] else "stop"
  assert (_one(got).text, _one(got).finish_reason) == (text, reason)
  streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=16,
                                            temperature=0, stop=stop, stream=True))
  assert "".join(c.choices[0].text for c in streamed if c.choices) == text
  assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == reason


def test_n_returns_n_indexed_choices_and_counts_all_their_tokens(client):
  got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, n=3)
  assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [
      (i, "heesrycaq,+", "length") for i in range(3)]
  assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (7, 24)
  chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                        n=2)
  assert [(c.index, c.message.content) for c in chat.choices] == [(0, "uO"), (1, "uO")]
  assert chat.usage.completion_tokens == 4


def test_a_seed_fixes_the_samples_and_another_seed_changes_them(client):
  def sample(seed, n=2):
    got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0,
                                    n=n, seed=seed, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in got.choices] == ["length"] * n
    assert got.usage.completion_tokens == 12 * n
    return [c.text for c in got.choices]

  first = sample(7)
  assert sample(7) == first
  # Each sample draws 12 tokens from the tiny model's broad distribution over 128 ids, so equal
  # texts from different streams would mean the seed is ignored.
  assert first[0] != first[1]
  assert sample(8) != first
  assert HELLO_TEXT[:15] not in first   # the greedy text of 12 tokens


def _log_softmax(row):
  row = np.asarray(row, np.float64)
  shifted = row - row.max()
  return shifted - math.log(np.exp(shifted).sum())


def test_completion_logprobs_equal_the_committed_transformers_logits(client):
  tok = tokenizers.Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
  data = np.load(os.path.join(CHECKPOINT, "logits.npz"))
  assert data["tokens_3"].tolist() == IDS_PROMPT
  want = _log_softmax(data["logits_3"][-1])
  order = np.argsort(-want)
  piece = lambda i: tok.decode([int(i)], skip_special_tokens=False)
  for count in (0, 1, 5):
    lp = _one(client.completions.create(model=MODEL, prompt=IDS_PROMPT, max_tokens=1,
                                        temperature=0, logprobs=count)).logprobs
    assert lp.tokens == [piece(order[0])] == ["b"]
    assert lp.token_logprobs == pytest.approx([want[order[0]]], abs=1e-4)
    assert lp.text_offset == [0]
    [top] = lp.top_logprobs
    # OpenAI's shape: the `count` likeliest tokens, and the chosen one even when count is 0.
    expected = {piece(i): want[i] for i in order[:max(count, 1)]}
    assert top == pytest.approx(expected, abs=1e-4)


def test_chat_logprobs_report_top_logprobs_by_count(client):
  for count in (0, 3):
    got = _one(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                              temperature=0, logprobs=True, top_logprobs=count))
    content = got.logprobs.content
    assert [c.token for c in content] == CHAT_HI[:3]
    for c in content:
      assert c.bytes == list(c.token.encode("utf-8")) and c.logprob < 0
      assert len(c.top_logprobs) == count
      # Greedy: the chosen token is the likeliest, so it leads its list.
      if count:
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (
            c.token, pytest.approx(c.logprob, abs=1e-6))
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True)
  plain = _one(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                              temperature=0))
  assert plain.logprobs is None and plain.message.content == "".join(CHAT_HI[:3])


@pytest.mark.parametrize("length", [63, 64, 65])
def test_a_repeated_prompt_around_a_whole_page_gets_the_same_text(client, length):
  """The server caches prefixes in pages of 64 tokens. A prompt sent again adopts its full
  pages (a 64-token one all but its last page: the step needs a token to feed, else it fails
  with EMPTY and drops every request). Oracle: the first answer, whose random prompt no
  earlier request shares, so nothing was adopted for it."""
  ids = np.random.default_rng(length).integers(8, 128, length).tolist()   # 0-7: special tokens
  answers = []
  for _ in range(3):
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (length, 6)
    answers.append((_one(got).text, _one(got).finish_reason))
  assert answers == [answers[0]] * 3 and answers[0][1] == "length"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_builds_the_prompt_the_template_renders_for_add_generation_prompt(
    client, add_generation_prompt):
  """The checkpoint's template, rendered here with jinja2 and encoded with `tokenizers`, ends
  with '<|assistant|>' only when add_generation_prompt is true. The chat's prompt has those
  ids: their count, and the greedy text of the same ids sent as a completion prompt."""
  import jinja2   # pylint: disable=g-import-not-at-top
  with open(os.path.join(CHECKPOINT, "tokenizer_config.json"), encoding="utf-8") as f:
    config = json.load(f)
  text = jinja2.Environment().from_string(config["chat_template"]).render(
      messages=HI, bos_token=config["bos_token"], add_generation_prompt=add_generation_prompt)
  tok = tokenizers.Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
  ids = tok.encode(text, add_special_tokens=False).ids   # the template writes <s> itself
  assert len(ids) == (6 if add_generation_prompt else 5)
  chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0,
                                        extra_body={"add_generation_prompt": add_generation_prompt,
                                                    "ignore_eos": True})
  assert chat.usage.prompt_tokens == len(ids)
  plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
  assert _one(chat).message.content == _one(plain).text


# Greedy "Hello": the pieces of its first output tokens (the module docstring's ids).
HELLO_PIECES = ["he", "es", "r", "y", "ca", "q", ",", "+", ",", "y", ",", "+", "?"]


def _expected_cut(stop: str, include: bool) -> tuple[str, int]:
  """`(text, completion tokens)` a stop string leaves of greedy "Hello", from its pieces: the
  text up to the stop string (with it, if included) and the tokens whose text reaches its end."""
  full = "".join(HELLO_PIECES)
  end = full.index(stop) + (len(stop) if include else 0)
  reach = next(k for k in range(len(HELLO_PIECES) + 1) if len("".join(HELLO_PIECES[:k])) >= end)
  return full[:end], reach


@pytest.mark.parametrize("stop", ["e", "y", "q,+", "ca"])
@pytest.mark.parametrize("include", [False, True])
def test_usage_counts_the_tokens_whose_text_was_returned(client, stop, include):
  """With a stop string, `usage.completion_tokens` counts exactly the tokens whose text came
  back (a token straddling the cut counts), plain and streamed, and the logprobs match it."""
  text, tokens = _expected_cut(stop, include)
  extra = {"ignore_eos": True, "include_stop_str_in_output": include}
  got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0,
                                  stop=[stop], logprobs=0, extra_body=extra)
  assert (_one(got).text, _one(got).finish_reason) == (text, "stop")
  assert got.usage.completion_tokens == tokens
  assert len(_one(got).logprobs.tokens) == tokens
  chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=20,
                                          temperature=0, stop=[stop], stream=True,
                                          stream_options={"include_usage": True},
                                          extra_body=extra))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == text
  assert chunks[-1].usage.completion_tokens == tokens


def test_skip_special_tokens_false_keeps_their_text(client):
  ids = [104, 107, 89, 96, 113, 88, 19, 18, 19, 96, 19, 18, 38, 20, 45, 104, 39, 89, 20, 5]
  tok = tokenizers.Tokenizer.from_file(os.path.join(CHECKPOINT, "tokenizer.json"))
  for skip in (True, False):
    got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "skip_special_tokens": skip})
    assert _one(got).text == tok.decode(ids, skip_special_tokens=skip)
  assert "<|user|>" in tok.decode(ids, skip_special_tokens=False)   # the check can tell


def test_chat_template_kwargs_reach_the_template(client):
  plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0)
  no_bos = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0,
                                          extra_body={"chat_template_kwargs": {"bos_token": ""}})
  assert (plain.usage.prompt_tokens, no_bos.usage.prompt_tokens) == (6, 5)
  _check_error(*_refusal(client, "chat", {"chat_template_kwargs": {"tools": []}}),
               param="chat_template_kwargs", fragment="set by the request itself")


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
  got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                  logprobs=1, extra_body={"return_tokens_as_token_ids": True})
  lp = _one(got).logprobs
  assert lp.tokens == [f"token_id:{t}" for t in (104, 107, 89, 96)]   # the docstring's ids
  assert all(len(top) >= 1 and all(k.startswith("token_id:") for k in top)
             for top in lp.top_logprobs)
  chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                        logprobs=True, top_logprobs=1,
                                        extra_body={"return_tokens_as_token_ids": True})
  assert [c.token for c in _one(chat).logprobs.content] == ["token_id:92", "token_id:54"]
