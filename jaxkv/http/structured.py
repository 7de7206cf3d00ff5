"""A request's output constraint and tools: which field set it, what spec it compiles from.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's
`structured_outputs` {json, regex, choice, json_object} and its older `guided_json`,
`guided_regex` and `guided_choice` each name one spec; a request sets at most one of them.
`tools` with `tool_choice` `"required"` or a named function constrain the output too (a
schema made from the functions' parameters, `tools.py`). Context-free grammars
(`structured_outputs.grammar`, `guided_grammar`) are refused by name: the engine follows
token automata, which hold regular languages only.
"""

from __future__ import annotations

import dataclasses

from jaxkv.http.errors import BadRequest
from jaxkv.structured.automaton import StructuredOutputs

# `structured_outputs` keys of vLLM's `StructuredOutputsParams` served here; the others
# (whitespace patterns, structural tags, backend switches) are refused by name.
_SERVED_KEYS = ("json", "regex", "choice", "json_object", "grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# JSON-schema `json_schema` keys of OpenAI's `response_format`.
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}

# `json_object`: any JSON object whose values nest at most two levels (objects or arrays of
# scalars inside it). Regular, so it compiles small; unbounded nesting is not regular.
_WS = r"[ ]?"
_STR = r'"([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_NUM = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_SCALAR = f"({_STR}|{_NUM}|true|false|null)"


def _array(v: str) -> str:
  return rf"\[{_WS}({v}({_WS},{_WS}{v})*)?{_WS}\]"


def _object(v: str) -> str:
  return rf"\{{{_WS}({_STR}{_WS}:{_WS}{v}({_WS},{_WS}{_STR}{_WS}:{_WS}{v})*)?{_WS}\}}"


JSON_OBJECT_REGEX = _object(f"({_SCALAR}|{_array(_SCALAR)}|{_object(_SCALAR)})")


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A request's output constraint: the field that set it (400s name it) and its spec."""

  field: str
  kind: str      # "json", "regex" or "choice" (`spec_regex`'s kinds)
  value: object


def _checked(field: str, spec: StructuredOutputs | dict) -> Constraint:
  """The constraint of a `StructuredOutputs` (or its fields as a dict), refusals naming `field`."""
  try:
    so = spec if isinstance(spec, StructuredOutputs) else StructuredOutputs(**spec)
  except (ValueError, TypeError) as e:
    raise BadRequest(f"{field}: {e}", param=field) from e
  if so.json_object:
    return Constraint(field, "regex", JSON_OBJECT_REGEX)
  kind, value = so.spec()
  if kind == "json" and isinstance(value, bool):
    raise BadRequest(f"{field}: a JSON schema must be an object", param=field)
  if kind == "json" and not isinstance(value, (dict, str)):
    raise BadRequest(f"{field}: a JSON schema must be an object or JSON text", param=field)
  return Constraint(field, kind, value)


def constraint_of(body, extra: dict) -> Constraint | None:
  """The constraint `body` (a request; `extra`: its fields outside the schema) sets, or None.

  Raises:
    BadRequest: a malformed spec, an unserved key, or more than one field setting one.
  """
  found: list[Constraint] = []
  rf = getattr(body, "response_format", None)
  if rf is not None:
    kind = rf.get("type")
    if kind == "json_object":
      found.append(Constraint("response_format", "regex", JSON_OBJECT_REGEX))
    elif kind == "json_schema":
      js = rf.get("json_schema")
      if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise BadRequest("response_format: json_schema needs a json_schema object with a "
                         "schema", param="response_format")
      unknown = sorted(set(js) - _JSON_SCHEMA_KEYS)
      if unknown:
        raise BadRequest(f"response_format: json_schema.{unknown[0]} is not a field this "
                         "server knows", param="response_format")
      found.append(_checked("response_format", {"json": js["schema"]}))
    elif kind != "text":
      raise BadRequest(f"response_format: type {kind!r} is not supported (text, json_object, "
                       "json_schema)", param="response_format")
  so = extra.get("structured_outputs")
  if so is not None:
    if not isinstance(so, dict):
      raise BadRequest("structured_outputs must be an object", param="structured_outputs")
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_SERVED_KEYS))
    if unknown:
      raise BadRequest(f"structured_outputs.{unknown[0]} is not supported (json, regex, choice, "
                       "json_object are)", param="structured_outputs")
    found.append(_checked("structured_outputs", given))
  for name, kind in _GUIDED.items():
    if extra.get(name) is not None:
      found.append(_checked(name, {kind: extra[name]}))
  if len(found) > 1:
    raise BadRequest(f"{found[0].field} and {found[1].field} both constrain the output; give "
                     "one", param=found[1].field)
  return found[0] if found else None


# Request fields outside the schema that `constraint_of` reads.
FIELDS = ("structured_outputs",) + tuple(_GUIDED)
