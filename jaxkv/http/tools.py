"""Tool calling: `tools` and `tool_choice` checked, the constraint they set, and tool calls read
back out of the generated text in OpenAI's `tool_calls` shape.

- `tool_choice: "none"`: the template sees the tools; the text is returned as content.
- `"auto"` (the default with tools): the model decides; its text is read by the tool-call
  parser of its family (`PARSERS`: how Llama 3, Mistral and Qwen/Hermes templates spell a
  call). Without a parser for the served model, "auto" is refused naming `tool_choice`.
- `"required"`: the output is constrained to a JSON array of at least one call
  `{"name": ..., "parameters": {...}}`, each valid against its function's parameters
  (at most one with `parallel_tool_calls: false`).
- a named function: the output is constrained to that function's parameters; it is the
  call's `arguments`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Callable

from jaxkv.http.errors import BadRequest

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class Tools:
  """A request's tools: `functions` {name: parameters schema}, the mode ("none", "auto",
  "required" or "named"), the named function, and whether calls may be parallel."""

  functions: dict
  mode: str
  name: str | None = None
  parallel: bool = True

  def schema(self) -> dict | None:
    """The JSON schema the output is constrained to (None: "none" and "auto" are free)."""
    if self.mode == "named":
      return self.functions[self.name]
    if self.mode != "required":
      return None
    calls = [{"type": "object", "properties": {"name": {"enum": [n]}, "parameters": p},
              "required": ["name", "parameters"], "additionalProperties": False}
             for n, p in self.functions.items()]
    array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
             "minItems": 1}
    if not self.parallel:
      array["maxItems"] = 1
    return array


def tools_of(tools, tool_choice, parallel: bool, parser: str | None) -> Tools | None:
  """The request's `Tools` (None: no tools), checked.

  Raises:
    BadRequest: a malformed tool or choice, a function named twice or not among the tools,
      or "auto" without a parser for the model (naming the field).
  """
  if not tools:
    if tool_choice not in (None, "none"):
      raise BadRequest("tool_choice needs tools", param="tool_choice")
    return None
  functions = {}
  for i, tool in enumerate(tools):
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
        tool.get("function"), dict):
      raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                       param="tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
      raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, _ . or -",
                       param="tools")
    if name in functions:
      raise BadRequest(f"{where}: function {name!r} is given twice", param="tools")
    params = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(params, dict):
      raise BadRequest(f"{where}.function.parameters must be a JSON schema object",
                       param="tools")
    functions[name] = params
  choice = "auto" if tool_choice is None else tool_choice
  if isinstance(choice, dict):
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
        fn.get("name"), str):
      raise BadRequest("tool_choice must be none, auto, required or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice")
    if fn["name"] not in functions:
      raise BadRequest(f"tool_choice names function {fn['name']!r}, which is not among the "
                       "tools", param="tool_choice")
    return Tools(functions, "named", fn["name"], parallel)
  if choice not in ("none", "auto", "required"):
    raise BadRequest(f"tool_choice={choice!r} must be none, auto, required or a named "
                     "function", param="tool_choice")
  if choice == "auto" and parser is None:
    raise BadRequest("tool_choice=auto needs a tool-call parser for this model (jaxkv serve "
                     "--tool-call-parser); use required or a named function",
                     param="tool_choice")
  return Tools(functions, choice, None, parallel)


def for_template(tools) -> list | None:
  """`tools` as transformers passes them to a chat template: as given (OpenAI's shape)."""
  return list(tools) if tools else None


def message_for_template(message: dict) -> dict:
  """A message as templates read it: an assistant's tool calls with their `arguments` as an
  object (transformers' templates write `arguments | tojson`), as vLLM passes them."""
  calls = message.get("tool_calls")
  if not isinstance(calls, list):
    return message
  out = []
  for call in calls:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
      try:
        fn = fn | {"arguments": json.loads(fn["arguments"])}
      except json.JSONDecodeError:
        pass   # the template gets the text, as the client wrote it
      call = call | {"function": fn}
    out.append(call)
  return message | {"tool_calls": out}


def call_id() -> str:
  return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str, index: int | None = None) -> dict:
  """One call in OpenAI's shape (`index` for a streamed delta)."""
  out = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
  return out if index is None else {"index": index} | out


def _arguments(value) -> str:
  return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def constrained_calls(tools: Tools, text: str) -> list[tuple[str, str]]:
  """`(name, arguments)` of a constrained output ("named": the text is the arguments;
  "required": the array of calls). An output cut by `max_tokens` is not valid JSON: no
  calls then (the text is returned as content)."""
  if tools.mode == "named":
    return [(tools.name, text)]
  try:
    calls = json.loads(text)
  except json.JSONDecodeError:
    return []
  return [(c["name"], _arguments(c["parameters"])) for c in calls]


@dataclasses.dataclass(frozen=True)
class Parser:
  """A family's spelling of tool calls in free text (`tool_choice: "auto"`): where a call
  begins (`marker` anywhere, or with `heads` only at the reply's start, after whitespace),
  and `read`, the calls of the text from there on ([] when none parse)."""

  name: str
  marker: str
  read: Callable[[str], list]
  heads: tuple[str, ...] = ()
  needs_special_tokens: bool = False   # the marker is a special token: decode without skipping

  def start(self, text: str) -> int | None:
    """Where the first call begins in `text`, or None."""
    if self.heads:
      stripped = text.lstrip()
      return len(text) - len(stripped) if stripped.startswith(self.heads) else None
    i = text.find(self.marker)
    return None if i < 0 else i

  def held(self, text: str) -> int:
    """How many trailing characters of `text` may yet begin a call (not streamed yet)."""
    if self.heads:
      stripped = text.lstrip()
      return len(text) if not stripped or any(h.startswith(stripped) for h in self.heads) else 0
    for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
      if self.marker.startswith(text[-k:]):
        return k
    return 0

  def calls(self, text: str) -> list[tuple[str, str]]:
    """`(name, arguments)` of the calls in `text` from `start` on ([]: none parse)."""
    return self.read(text)


def _named(obj, args_keys=("arguments", "parameters")) -> tuple[str, str] | None:
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return None
  args = next((obj[k] for k in args_keys if k in obj), {})
  return obj["name"], _arguments(args)


def _json_values(text: str) -> list:
  """The JSON values written one after another in `text` (separated by whitespace, `;` or
  `,`); [] unless all of it parses."""
  decoder, values, i = json.JSONDecoder(), [], 0
  while True:
    while i < len(text) and text[i] in " \t\r\n;,":
      i += 1
    if i == len(text):
      return values
    try:
      value, i = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      return []
    values.append(value)


def _llama3_json(text: str) -> list[tuple[str, str]]:
  """Llama 3.1-3.3: the whole reply is `{"name": ..., "parameters": {...}}` (several
  separated by `;`), after an optional `<|python_tag|>`."""
  text = text.lstrip().removeprefix("<|python_tag|>")
  calls = [_named(v) for v in _json_values(text)]
  return calls if calls and None not in calls else []


def _hermes(text: str) -> list[tuple[str, str]]:
  """Qwen 2/2.5/3 (Hermes' format): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
  calls = []
  for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
    values = _json_values(body.strip())
    call = _named(values[0]) if len(values) == 1 else None
    if call is None:
      return []
    calls.append(call)
  return calls


def _mistral(text: str) -> list[tuple[str, str]]:
  """Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`, or (v11
  tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call."""
  calls = []
  for part in (p.strip() for p in text.split("[TOOL_CALLS]")[1:]):
    if "[ARGS]" in part:
      name, _, args = part.partition("[ARGS]")
      values = _json_values(args.strip())
      if len(values) != 1 or not name.strip():
        return []
      calls.append((name.strip(), _arguments(values[0])))
      continue
    values = _json_values(part)
    if len(values) != 1 or not isinstance(values[0], list):
      return []
    for v in values[0]:
      call = _named(v)
      if call is None:
        return []
      calls.append(call)
  return calls


PARSERS = {p.name: p for p in (
    Parser("llama3_json", "{", _llama3_json, heads=("<|python_tag|>", "{")),
    Parser("hermes", "<tool_call>", _hermes),
    Parser("mistral", "[TOOL_CALLS]", _mistral, needs_special_tokens=True))}
# The parser of each model family jaxkv loads (`model_type` of config.json); Gemma 3 has no
# tool-call format of its own.
FAMILY_PARSERS = {"llama": "llama3_json", "mistral": "mistral", "qwen2": "hermes",
                  "qwen3": "hermes"}


class CallStream:
  """One streamed sample's text split into content and tool calls as it grows ("auto").

  `push(text)` returns the content that can be streamed now; text from a call's start on
  is held, and `finish()` returns `(content held back, calls)`: the calls when they parse,
  else the held text as content.
  """

  def __init__(self, parser: Parser):
    self.parser, self.text, self.sent, self.in_call = parser, "", 0, False

  def push(self, text: str) -> str:
    self.text += text
    if self.in_call:
      return ""
    start = self.parser.start(self.text)
    if start is not None:
      self.in_call = True
      out, self.sent = self.text[self.sent:start], start
      return out
    end = len(self.text) - self.parser.held(self.text)
    out, self.sent = self.text[self.sent:end], max(end, self.sent)
    return out

  def finish(self) -> tuple[str, list[tuple[str, str]]]:
    rest = self.text[self.sent:]
    calls = self.parser.calls(rest) if self.in_call else []
    return ("" if calls else rest), calls


def split_calls(tools: Tools, parser: Parser | None, text: str) -> tuple[str, list]:
  """A whole sample's `(content, [(name, arguments)])` under `tools`' mode."""
  if tools.mode in ("named", "required"):
    calls = constrained_calls(tools, text)
    return ("" if calls else text), calls
  if tools.mode == "auto":
    start = parser.start(text)
    calls = [] if start is None else parser.calls(text[start:])
    if calls:
      return text[:start], calls if tools.parallel else calls[:1]
  return text, []


class StreamedCalls:
  """One streamed sample's deltas under `tools`' mode: `push(text, finish)` returns the
  chat delta to send (None: nothing yet) and the finish reason to report."""

  def __init__(self, tools: Tools, parser: Parser | None):
    self.tools, self.parser = tools, parser
    self.calls = CallStream(parser) if tools.mode == "auto" else None
    self.buffer, self.opened = "", False

  def push(self, text: str, finish: str | None) -> tuple[dict | None, str | None]:
    mode = self.tools.mode
    if mode == "named":   # the text is the arguments: streamed as they come
      if not text and (self.opened or finish is None):
        return None, finish
      if not self.opened:
        self.opened = True
        return {"tool_calls": [tool_call(self.tools.name, text, index=0)]}, finish
      return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, finish
    if mode == "required":   # an array of calls: sent whole once it parses
      self.buffer += text
      if finish is None:
        return None, None
      calls = constrained_calls(self.tools, self.buffer)
      if not calls:
        return ({"content": self.buffer} if self.buffer else None), finish
      return {"tool_calls": [tool_call(n, a, index=k) for k, (n, a) in enumerate(calls)]}, (
          "tool_calls" if finish == "stop" else finish)
    content = self.calls.push(text)
    if finish is None:
      return ({"content": content} if content else None), None
    rest, calls = self.calls.finish()
    content += rest
    delta = {"content": content} if content else {}
    if calls:
      calls = calls if self.tools.parallel else calls[:1]
      delta["tool_calls"] = [tool_call(n, a, index=k) for k, (n, a) in enumerate(calls)]
      finish = "tool_calls" if finish == "stop" else finish
    return (delta or None), finish
