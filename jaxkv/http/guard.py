"""The body-size and API-key guard in front of every route."""

from __future__ import annotations

import hmac

from jaxkv.http.errors import error_response
from jaxkv.http.metrics import Metrics


class Guard:
  """Body size (413) and the API key (401), checked before a route runs.

  A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` would relay every
  chunk of every stream through a queue of its own.
  """

  def __init__(self, app, *, max_body_bytes: int, expected: bytes | None, metrics: Metrics):
    self.app, self.max_body_bytes, self.expected, self.metrics = (app, max_body_bytes, expected,
                                                                  metrics)

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope["headers"])
    length = headers.get(b"content-length")
    if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
      return await self._too_large(scope, receive, send)
    if (self.expected is not None and scope["path"].startswith("/v1")
        and scope["method"] != "OPTIONS"
        and not hmac.compare_digest(headers.get(b"authorization", b""), self.expected)):
      self.metrics.errors.labels("401").inc()
      return await error_response(401, "invalid or missing API key (Authorization: Bearer <key>)",
                          "invalid_request_error",
                          headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
    # The limit holds for the bytes received, whatever the framing (chunked, no Content-Length):
    # the body is read here up to the limit, and the route reads it back from memory.
    chunks, size, more = [], 0, True
    while more:
      message = await receive()
      if message["type"] != "http.request":   # the client left: the route sees it too
        return await self.app(scope, _replay([], message, receive), send)
      chunks.append(message.get("body", b""))
      size += len(chunks[-1])
      more = message.get("more_body", False)
      if size > self.max_body_bytes:   # answered now: nothing past the limit is read
        return await self._too_large(scope, receive, send)
    return await self.app(scope, _replay(chunks, None, receive), send)

  async def _too_large(self, scope, receive, send):
    self.metrics.errors.labels("413").inc()
    return await error_response(413, f"the request body is over {self.max_body_bytes} bytes",
                                "invalid_request_error")(scope, receive, send)


def _replay(chunks: list, first, receive):
  """An ASGI `receive` that hands out the body read already (or `first`), then the client's
  own messages (a disconnect)."""
  pending = [first] if first is not None else [
      {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

  async def replayed():
    return pending.pop() if pending else await receive()
  return replayed
