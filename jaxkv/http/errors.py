"""The HTTP front's refusals: a 400 (or another status) in OpenAI's error shape, naming a field."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse


class BadRequest(Exception):
  """A refusal the app answers with `status` and an OpenAI error body (`param`: the field)."""

  def __init__(self, message: str, *, status: int = 400, param: str | None = None,
               kind: str = "invalid_request_error", headers: dict | None = None):
    super().__init__(message)
    self.message, self.status, self.param, self.kind = message, status, param, kind
    self.headers = headers


def error_body(message: str, kind: str, param=None) -> dict:
  """OpenAI's error object (a response's body, or a stream's event)."""
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_response(status: int, message: str, kind: str, param=None,
                   headers=None) -> JSONResponse:
  """OpenAI's error body with `status`."""
  return JSONResponse(error_body(message, kind, param), status_code=status, headers=headers)


# The engine names a request by its internal id ("request 7: ..."); clients never see those.
_LABEL = re.compile(r"request [^:]*: ")


def public_message(e: Exception) -> str:
  """The engine's message without its internal request label."""
  return _LABEL.sub("", str(e))


def check_text(value, param: str) -> None:
  """Refuses (400 naming `param`) any string in `value` that is not valid Unicode: JSON can
  carry a lone surrogate (`"\\ud800"`), which no tokenizer can encode."""
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeError as e:
      raise BadRequest(f"{param} is not valid Unicode text: {e.reason}", param=param) from e
  elif isinstance(value, (list, tuple)):
    for v in value:
      check_text(v, param)
  elif isinstance(value, dict):
    for v in value.values():
      check_text(v, param)


def encode_or_refuse(encode, param: str) -> list[int]:
  """`encode()`, a refusal of the template or tokenizer as a 400 naming `param`."""
  try:
    return encode()
  except ValueError as e:
    raise BadRequest(public_message(e), param=param) from e


def engine_refusal(e: Exception, *, chat: bool, limit_field: str, limit_given: bool,
                   grammar_field: str | None = None):
  """The engine's refusal of a request as a 400 naming the request field it is about
  (`grammar_field`: the field whose constraint became the request's grammar)."""
  message = public_message(e)
  head = message.split("=")[0].split(" ")[0].split("[")[0]
  param = {"n": "n", "logprobs": "top_logprobs" if chat else "logprobs",
           "stop_tokens": "stop_token_ids", "max_tokens": limit_field,
           "prompt": "messages" if chat else "prompt", "min_tokens": "min_tokens",
           "logit_bias": "logit_bias", "allowed_token_ids": "allowed_token_ids",
           "grammar": grammar_field}.get(head)
  if head == "grammar" and grammar_field is not None:   # the automaton does not fit the pool
    message = f"{grammar_field}: {message}"
  if head == "prompt" and "max_tokens" in message and limit_given:
    param = limit_field   # prompt + max_tokens past max_len: the limit the client set
  return BadRequest(message, param=param)
