"""Structured output and tool calling through the official `openai` client against the server.

The fixture model's free text is gibberish, so only the constraint can make an output valid.
Oracles: `jsonschema` and `re` judge the texts; the tool-call parsers are judged on texts
written here in each family's format. Refusals are 400s naming the field, with nothing queued.
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the server tests need the test extra's openai")
pytest.importorskip("fastapi", reason="the server tests need the serve extra's fastapi")
pytest.importorskip("outlines_core", reason="structured output needs outlines-core")
jsonschema = pytest.importorskip("jsonschema")

from http_server import running  # noqa: E402  pylint: disable=wrong-import-order
from jaxkv.cli import build_server  # noqa: E402
from jaxkv.http import tools as tl  # noqa: E402
from jaxkv.http.app import create_app  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
CHECKPOINT = os.path.join(FIXTURES, "hf_llama")
with open(os.path.join(FIXTURES, "schemas.json"), encoding="utf-8") as _f:
  SCHEMAS = json.load(_f)
MODEL = "tiny-llama"
HI = [{"role": "user", "content": "Give me data"}]
# The fixture's template, and the tools' names when a request has tools (as transformers
# passes them: OpenAI's shape).
TEMPLATE = ("{{ bos_token }}{% if tools %}<|system|>tools:{% for t in tools %} "
            "{{ t['function']['name'] }}{% endfor %}<|end|>{% endif %}"
            "{% for message in messages %}{{ '<|' + message['role'] + '|>' + "
            "(message['content'] or '') + '<|end|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "wx", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]}}}


@pytest.fixture(scope="module")
def server():
  engine, tokenizer, _ = build_server(CHECKPOINT, max_seqs=4, max_len=128, max_write=16)
  app = create_app(engine, tokenizer, model_name=MODEL, interval=8, chat_template=TEMPLATE,
                   tool_call_parser="hermes")
  with running(app) as base:
    yield engine, base


@pytest.fixture(scope="module")
def client(server):
  with openai.OpenAI(base_url=server[1] + "/v1", api_key="x", max_retries=0, timeout=300) as c:
    yield c


def _fmt(schema):
  return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                  "strict": True}}


def test_every_schema_of_the_set_validates(server):
  """All 20 schemas at once (sampled, so the outputs differ): each output parses and
  validates, and ends because the schema was complete (`stop`)."""
  async def main():
    async with openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="x", max_retries=0,
                                  timeout=600) as c:
      return await asyncio.gather(*(c.chat.completions.create(
          model=MODEL, messages=HI, max_tokens=110, temperature=0.8, seed=i,
          response_format=_fmt(s)) for i, s in enumerate(SCHEMAS)))
  outs = asyncio.run(main())
  assert len(SCHEMAS) >= 20
  for schema, out in zip(SCHEMAS, outs):
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), schema)
    assert choice.finish_reason == "stop"
  assert server[0].counts() == (0, 0)


def test_each_field_spelling_constrains_the_output(client):
  schema = SCHEMAS[3]
  chat = lambda **kw: client.chat.completions.create(model=MODEL, messages=HI, max_tokens=110,
                                                     temperature=0, **kw).choices[0]
  for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema}):
    jsonschema.validate(json.loads(chat(extra_body=extra).message.content), schema)
  for extra in ({"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}},
                {"guided_regex": r"[A-Z]{2}-[0-9]{3}"}):
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", chat(extra_body=extra).message.content)
  for extra in ({"structured_outputs": {"choice": ["alpha", "beta"]}},
                {"guided_choice": ["alpha", "beta"]}):
    assert chat(extra_body=extra).message.content in ("alpha", "beta")
  # Any object: its strings and members are unbounded, so gibberish may run to max_tokens (cut,
  # so not parsed); every sample that ended is an object.
  for kw in ({"response_format": {"type": "json_object"}},
             {"extra_body": {"structured_outputs": {"json_object": True}}}):
    outs = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=110, n=4, seed=5,
                                          temperature=1.0, **kw).choices
    ended = [c.message.content for c in outs if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(t), dict) for t in ended)
    assert all(c.message.content.startswith("{") for c in outs)
  # Completions take the same fields; n > 1 and a stream are constrained alike.
  out = client.completions.create(model=MODEL, prompt="Data:", max_tokens=110, temperature=0.9,
                                  seed=3, n=2, extra_body={"guided_json": schema})
  for c in out.choices:
    jsonschema.validate(json.loads(c.text), schema)
  streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
      model=MODEL, messages=HI, max_tokens=110, temperature=0, stream=True,
      response_format=_fmt(schema)))
  assert streamed == chat(response_format=_fmt(schema)).message.content


@pytest.mark.parametrize("body, param, fragment", [
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs",
     "not supported"),
    ({"guided_grammar": "root ::= \"a\""}, "guided_grammar", "not supported"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs",
     "structured_outputs.whitespace_pattern"),
    ({"response_format": _fmt({"type": "array", "uniqueItems": True})}, "response_format",
     "'uniqueItems'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "both constrain"),
    ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens", "cannot be combined"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex",
     "both constrain"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "function.name"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_refusals_name_the_field_and_queue_nothing(server, body, param, fragment):
  engine, base = server
  r = httpx.post(base + "/v1/chat/completions", timeout=120,
                 json={"model": MODEL, "messages": HI, "max_tokens": 4} | body)
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == param and fragment in error["message"], error
  assert engine.counts() == (0, 0) and engine.waiting_tokens == 0


def test_a_named_function_and_required_calls_come_back_as_tool_calls(client):
  named = {"type": "function", "function": {"name": "wx"}}
  out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=90, temperature=0,
                                       tools=[WEATHER, CLOCK], tool_choice=named).choices[0]
  [call] = out.message.tool_calls
  assert call.function.name == "wx" and call.id.startswith("call_")
  jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
  # Streamed: the deltas assemble into the same call.
  args, names = "", []
  for chunk in client.chat.completions.create(model=MODEL, messages=HI, max_tokens=90,
                                              temperature=0, tools=[WEATHER, CLOCK],
                                              tool_choice=named, stream=True):
    for d in chunk.choices[0].delta.tool_calls or ():
      names += [d.function.name] if d.function.name else []
      args += d.function.arguments or ""
  assert names == ["wx"] and args == call.function.arguments
  schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
  for stream in (False, True):
    for seed in range(2):
      # One call each (the fixture's 128 positions leave no room for two).
      kw = dict(model=MODEL, messages=HI, max_tokens=90, temperature=0.9, seed=seed,
                tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
      if stream:
        calls, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
          calls += chunk.choices[0].delta.tool_calls or []
          finish = chunk.choices[0].finish_reason or finish
      else:
        choice = client.chat.completions.create(**kw).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
      assert finish == "tool_calls" and len(calls) == 1
      for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_auto_returns_text_without_a_call_and_the_template_sees_the_tools(server, client):
  # Sampled (seeded), to share the loop program the constrained requests compiled.
  out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0.5,
                                       seed=1, tools=[WEATHER])
  plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0.5,
                                         seed=1, tools=[WEATHER], tool_choice="none")
  assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")
  assert out.choices[0].message.content == plain.choices[0].message.content
  ids = httpx.post(server[1] + "/tokenize", json={"messages": HI, "tools": [WEATHER, CLOCK]}
                   ).json()["tokens"]
  text = httpx.post(server[1] + "/detokenize", json={"tokens": ids}).json()["prompt"]
  assert "tools: wx now" in text
  # An earlier call in the history reaches the template (arguments as an object).
  history = HI + [{"role": "assistant", "content": None, "tool_calls": [{
      "id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{\"utc\": true}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
  assert client.chat.completions.create(model=MODEL, messages=history, max_tokens=2, seed=1,
                                        temperature=0.5).choices[0].finish_reason in ("stop",
                                                                                      "length")


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
     "Let me look.", [("f", '{"x": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", '
     '"arguments": {"y": "z"}}</tool_call>', "", [("f", "{}"), ("g", '{"y": "z"}')]),
    ("hermes", "no call <tool_", "no call <tool_", []),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", ' {"name": "f", "parameters": {"x": [1, 2]}}', " ", [("f", '{"x": [1, 2]}')]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": '
     '{}}', "", [("f", "{}"), ("g", "{}")]),
    ("llama3_json", 'It is {"name": "f"}', 'It is {"name": "f"}', []),
    ("mistral", 'ok[TOOL_CALLS][{"name": "f", "arguments": {"a": true}}]', "ok",
     [("f", '{"a": true}')]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "", [("f", '{"a": 1}'),
                                                                       ("g", "{}")]),
])
def test_tool_call_parsers_whole_and_streamed(parser, text, content, calls):
  p = tl.PARSERS[parser]
  tools = tl.Tools({"f": {}, "g": {}}, "auto")
  assert tl.split_calls(tools, p, text) == (content, calls)
  for cut in (1, 3, 7):   # streamed in pieces: the same content and calls
    stream = tl.StreamedCalls(tools, p)
    got_content, got_calls = "", []
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for k, piece in enumerate(pieces):
      delta, finish = stream.push(piece, "stop" if k == len(pieces) - 1 else None)
      got_content += (delta or {}).get("content", "")
      got_calls += [(c["function"]["name"], c["function"]["arguments"])
                    for c in (delta or {}).get("tool_calls", [])]
    assert (got_content, got_calls) == (content, calls), cut
    assert finish == ("tool_calls" if calls else "stop")


def test_required_calls_allow_many_unless_parallel_calls_are_off():
  fns = {"f": {"type": "object"}, "g": {"type": "object"}}
  many, one = tl.Tools(fns, "required").schema(), tl.Tools(fns, "required", None, False).schema()
  assert many["minItems"] == one["minItems"] == one["maxItems"] == 1 and "maxItems" not in many
  assert [c["properties"]["name"]["enum"] for c in many["items"]["anyOf"]] == [["f"], ["g"]]
