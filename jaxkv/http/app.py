"""The OpenAI-compatible FastAPI app: completions, chat completions, models, health, metrics.

Every request is checked before anything is queued (400 with an OpenAI error
body naming the problem), its samples are served by the `AsyncEngine`, text
comes from a `TextStream` per sample (stable text only, stop strings cut),
logprobs (when asked) come in OpenAI's shapes for the tokens up to the one
that completed a stop string (`logprobs.py`), and a client that goes away (a
closed stream, a dropped connection) aborts its requests in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from jaxkv.http.errors import (BadRequest, check_text, encode_or_refuse, engine_refusal,
                               error_body, error_response, public_message)
from jaxkv.http.guard import Guard
from jaxkv.http.logprobs import LogprobFormatter
from jaxkv.http.metrics import Metrics
from jaxkv.http.schema import (ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                               unsupported_field)
from jaxkv.http.structured import Constraint, constraint_of
from jaxkv.http.tools import PARSERS, StreamedCalls, split_calls, tool_call, tools_of
from jaxkv.http.tasks import Drain, Draining, disconnected, log_stats, off_loop, until
from jaxkv.serve.aio import AsyncEngine
from jaxkv.serve.engine import Engine
from jaxkv.serve.parallel import DataParallelEngine
from jaxkv.serve.scoring import PromptScorer
from jaxkv.serve.requests import Request as EngineRequest
from jaxkv.structured.vocab import model_token_bytes
from jaxkv.structured.worker import CompileTimeout, ProcessCompiler
from jaxkv.tokenizer import TextStream, Tokenizer


class _Sample:
  """One sample's text state, logprob formatter (None: not asked) and timing while it is served."""

  def __init__(self, tokenizer, stop, arrived, logprobs: LogprobFormatter | None, *,
               include_stop: bool = False, skip_special_tokens: bool = True,
               min_tokens: int = 0):
    self.text = TextStream(tokenizer, stop, include_stop=include_stop,
                           skip_special_tokens=skip_special_tokens, min_tokens=min_tokens)
    self.tokens, self.finish, self.arrived, self.last = 0, None, arrived, None
    self.logprobs = logprobs
    self.reported = 0   # logprob entries handed out

  @property
  def usage_tokens(self) -> int:
    """Completion tokens to report: those whose text was returned once a stop string ended
    the sample (`TextStream.tokens_returned`), else every token generated."""
    return self.text.tokens_returned() if self.text.stopped else self.tokens

  def push(self, delta) -> tuple[str, dict | None]:
    """The delta's new text, and the logprobs of its tokens up to a stop string (if asked)."""
    if self.logprobs is None or delta.logprobs is None:
      return self.text.push(delta.tokens), None
    text, entries = "", []
    for entry in delta.logprobs:   # one token at a time: the tokens after a stop string go
      if self.text.stopped:
        break
      text += self.text.push((entry.token,))
      entries.append(entry)
    if self.text.stopped:   # as many entries as `usage` counts tokens
      entries = entries[:max(self.text.tokens_returned() - self.reported, 0)]
    self.reported += len(entries)
    return text, self.logprobs.format(entries)


def _plain_json(value) -> bool:
  """Whether `value` is made of JSON's own types only (a config read from JSON always is, but
  a token's AddedToken dict stays as written)."""
  if value is None or isinstance(value, (str, bool, int, float)):
    return True
  if isinstance(value, list):
    return all(_plain_json(v) for v in value)
  return isinstance(value, dict) and all(isinstance(k, str) and _plain_json(v)
                                         for k, v in value.items())


def create_app(engine, tokenizer: Tokenizer, *, model_name: str, interval: int = 16,
               min_interval: int | None = None, max_queued: int = 4096,
               max_queued_tokens: int = 2**23,
               stats_interval: float = 0.0, api_key: str | None = None,
               allowed_origins: list[str] | None = None, max_body_bytes: int = 32 * 2**20,
               max_prompts: int = 1024, on_shutdown: Callable[[], None] | None = None,
               chat_template: str | None = None, stepping: str = "entries",
               client=None, tool_call_parser: str | None = None,
               grammar_compile_timeout: float = 60.0) -> FastAPI:
  """The app serving `engine` (a `jaxkv.serve.Engine`) with `tokenizer`'s text and chat I/O.

  `interval`, `min_interval` and `stepping` are the `AsyncEngine`'s (steps per entry
  while requests wait, and while a column is free; single steps or loop entries). A
  request that would put more than `max_queued` requests in the waiting queue is answered 503 with `Retry-After`
  (nothing already accepted is dropped), and so is one that would put more than
  `max_queued_tokens` prompt tokens there. Every `stats_interval` seconds (0: never)
  one line of serving stats is printed while requests are in flight. With
  `api_key`, every `/v1` route needs `Authorization: Bearer <api_key>` (401
  otherwise; `/health`, `/metrics`, `/version` stay open); `allowed_origins`
  turns on CORS for those origins. A body over `max_body_bytes` is answered 413,
  and so is a request of more than `max_prompts` prompts. `on_shutdown` is called
  when the app stops, after the driver thread has ended (the CLI prints its summary).
  `chat_template` (a template name of the checkpoint's set, or template text)
  replaces the checkpoint's default chat template. `client` serves the requests in
  place of an `AsyncEngine` over `engine` (a front process's `fronts.RemoteEngine`, with
  `engine` its `fronts.EngineView`); the stepping arguments are then the host's.
  `tool_call_parser` (a name of `tools.PARSERS`, or None: `tool_choice: "auto"` is refused)
  reads tool calls out of free text. A structured-output spec compiles in a child process
  (`ProcessCompiler`), at most `grammar_compile_timeout` seconds (a 400 naming the field
  after that).
  """
  if tool_call_parser is not None and tool_call_parser not in PARSERS:
    raise ValueError(f"tool_call_parser={tool_call_parser!r} must be one of {sorted(PARSERS)}")
  parser = None if tool_call_parser is None else PARSERS[tool_call_parser]
  for name, value in (("max_queued", max_queued), ("max_queued_tokens", max_queued_tokens),
                      ("max_body_bytes", max_body_bytes),
                      ("max_prompts", max_prompts)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be an int >= 1")
  if api_key is not None and (not isinstance(api_key, str) or not api_key):
    raise ValueError("api_key must be a non-empty string (or None: no key)")
  metrics = Metrics(engine.capacity, model_name)
  after_step = lambda deltas: metrics.after_step(engine, deltas)
  if client is None:
    aio = AsyncEngine(engine, interval=interval, min_interval=min_interval, stepping=stepping,
                      on_step=after_step)
  else:
    aio = client
    aio.on_step = after_step

  drain = Drain(lambda: aio.fail_all(Draining()))
  # Prompt logprobs (`echo` with `logprobs`) run the engine's model here: not in a front process.
  scoring = (engine if isinstance(engine, Engine) else engine.engines[0]
             if isinstance(engine, DataParallelEngine) else None)
  scorers: list[PromptScorer] = []   # made on the first request that asks
  compilers: list[ProcessCompiler] = []   # made on the first constrained request

  async def grammar_of(constraint: Constraint | None):
    """The compiled automaton of a request's constraint (None: none), off the event loop."""
    if constraint is None:
      return None
    field = constraint.field

    def compiled():
      if not compilers:
        compilers.append(ProcessCompiler(model_token_bytes(tokenizer, engine.vocab_size),
                                         timeout=grammar_compile_timeout))
      return compilers[0].compile(constraint.kind, constraint.value)
    try:
      return await asyncio.to_thread(compiled)
    except CompileTimeout as e:
      raise BadRequest(f"{field}: {e} (the server's --grammar-compile-timeout); a smaller schema "
                       "compiles faster", param=field) from e
    except ValueError as e:
      raise BadRequest(f"{field}: {public_message(e)}", param=field) from e

  @contextlib.asynccontextmanager
  async def lifespan(_):
    drain.attach()
    logger = (asyncio.ensure_future(log_stats(engine, metrics, stats_interval))
              if stats_interval > 0 else None)
    yield
    if logger is not None:
      logger.cancel()
    drain.report()
    await asyncio.to_thread(aio.close, 60.0)   # the driver thread ends with the app
    for c in compilers:
      c.close()
    if on_shutdown is not None:
      on_shutdown()

  app = FastAPI(title="jaxkv", version=_version(), lifespan=lifespan)
  app.state.engine, app.state.aio, app.state.metrics = engine, aio, metrics
  app.state.drain = drain   # `jaxkv serve` starts it when the shutdown begins
  created = int(time.time())
  expected = None if api_key is None else f"Bearer {api_key}".encode()

  app.add_middleware(Guard, max_body_bytes=max_body_bytes, expected=expected, metrics=metrics)
  if allowed_origins:
    from fastapi.middleware.cors import CORSMiddleware   # pylint: disable=g-import-not-at-top
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])

  @app.exception_handler(BadRequest)
  async def _bad(_, e: BadRequest):
    metrics.errors.labels(str(e.status)).inc()
    return error_response(e.status, e.message, e.kind, e.param, e.headers)

  @app.exception_handler(RequestValidationError)
  async def _invalid(_, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    metrics.errors.labels("400").inc()
    return error_response(400, f"{where}: {first.get('msg', 'invalid request')}",
                          "invalid_request_error", where or None)

  @app.exception_handler(Exception)
  async def _failed(_, e: Exception):   # the server stays up; the client gets a JSON 500
    metrics.errors.labels("500").inc()
    _log.exception("internal error while serving a request", exc_info=e)
    return error_response(500, "internal server error", "server_error")

  @app.get("/health")
  async def health():
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus():
    return Response(metrics.render(), media_type="text/plain; version=0.0.4")

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "jaxkv", "max_model_len": engine.max_len}]}

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str):
    if model_id != model_name:
      raise BadRequest(f"model {model_id!r} does not exist; this server serves {model_name!r}",
                       status=404, param="model", kind="not_found_error")
    return (await models())["data"][0]

  @app.get("/version")
  async def version():
    return {"version": _version()}

  @app.get("/tokenizer_info")
  async def tokenizer_info():
    """vLLM's: the tokenizer's configuration as clients that tokenise remotely read it (the
    JSON fields of tokenizer_config.json, the chat template this server renders, its stop ids,
    `model_max_length` = the engine's `max_len`)."""
    info = {k: v for k, v in tokenizer.config.items() if _plain_json(v)}
    try:
      template = tokenizer.template(chat_template)
    except ValueError:
      template = None
    return info | {"tokenizer_class": info.get("tokenizer_class", "PreTrainedTokenizerFast"),
                   "chat_template": template, "model_max_length": engine.max_len,
                   "vocab_size": tokenizer.vocab_size, "eos_token_ids": list(tokenizer.eos_ids)}

  @app.post("/tokenize")
  async def tokenize(body: TokenizeRequest):
    check_model(body)
    check_text([body.prompt, [m.for_template() for m in body.messages or ()]],
                "messages" if body.messages is not None else "prompt")
    if body.messages is not None:
      ids = encode_or_refuse(lambda: tokenizer.encode_chat(
          [m.for_template() for m in body.messages],
          add_generation_prompt=body.add_generation_prompt, chat_template=chat_template,
          tools=body.tools or None), "messages")
    else:
      ids = encode_or_refuse(lambda: tokenizer.encode(body.prompt,
                                             add_special_tokens=body.add_special_tokens), "prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_len}

  @app.post("/detokenize")
  async def detokenize(body: DetokenizeRequest):
    check_model(body)
    bad = [t for t in body.tokens if t >= tokenizer.vocab_size]
    if bad:
      raise BadRequest(f"tokens holds {bad[0]}, outside [0, vocab_size={tokenizer.vocab_size})",
                       param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}

  def check_model(body):
    if body.model not in (None, model_name):
      raise BadRequest(f"model {body.model!r} does not exist; this server serves "
                       f"{model_name!r}", status=404, param="model", kind="not_found_error")
    refused = unsupported_field(body.model_extra or {})
    if refused is not None:   # never accepted and ignored: the client would not know
      raise BadRequest(refused[1], param=refused[0])

  def check_prompts(prompts: list[list[int]], prompt_field: str) -> None:
    """How many prompts, and each one's length (a prompt's fault whatever the output limit)."""
    if len(prompts) > max_prompts:
      raise BadRequest(f"prompt holds {len(prompts)} prompts; at most {max_prompts} per request",
                       status=413, param="prompt")
    for prompt in prompts:
      if not prompt:
        raise BadRequest("the prompt encodes to no tokens", param=prompt_field)
      if len(prompt) >= engine.max_len:
        raise BadRequest(f"the prompt has {len(prompt)} tokens; max_len={engine.max_len} "
                         "leaves none to generate", param=prompt_field)

  def build(body, prompts: list[list[int]], chat: bool, grammar=None,
            constraint: Constraint | None = None) -> list[EngineRequest]:
    max_tokens, limit_field = body.output_limit()
    check_prompts(prompts, "messages" if chat else "prompt")
    if grammar is not None:   # what a constrained output cannot be combined with
      for name, clash in (("min_tokens", body.min_tokens > 0),
                          ("allowed_token_ids", body.allowed_token_ids is not None),
                          ("ignore_eos", body.ignore_eos and not body.stop_token_ids)):
        if clash:
          raise BadRequest(f"{name} cannot be combined with {constraint.field}: the constraint "
                           "decides the tokens and where the output ends (with a stop token)",
                           param=name)
    out = []
    for prompt in prompts:
      limit = max_tokens if max_tokens is not None else engine.max_len - len(prompt)
      try:
        params = body.sampling(max_tokens=limit, stop_ids=tokenizer.eos_ids, grammar=grammar)
        request = EngineRequest(tuple(prompt), params)
        engine.check(request)
      except (ValueError, TypeError) as e:
        raise engine_refusal(e, chat=chat, limit_field=limit_field,
                             limit_given=max_tokens is not None,
                             grammar_field=None if constraint is None else constraint.field) from e
      out.append(request)
    return out

  async def serve(http: Request, requests, body, chat: bool,
                  tools=None) -> tuple[list, list, dict]:
    """Adds every request (all or none); returns its ids, samples and an event stream."""
    arrived = time.perf_counter()
    # A request no queue could ever take is the request's fault (413), not the server's (503).
    if len(requests) > max_queued:
      raise BadRequest(f"the request holds {len(requests)} prompts; at most max_queued="
                       f"{max_queued} may wait at once", status=413, param="prompt")
    own = sum(len(r.prompt) for r in requests)
    if own > max_queued_tokens:
      raise BadRequest(f"the request's prompts hold {own} tokens; at most max_queued_tokens="
                       f"{max_queued_tokens} may wait at once", status=413, param="prompt")
    waiting = engine.counts()[1]
    if waiting + len(requests) > max_queued:
      raise BadRequest(f"the server is busy: {waiting} requests are waiting (at most "
                       f"{max_queued}); retry later", status=503, kind="server_busy",
                       headers={"Retry-After": "1"})
    tokens = engine.waiting_tokens + own
    if tokens > max_queued_tokens:
      raise BadRequest(f"the server is busy: the waiting prompts would hold {tokens} tokens (at "
                       f"most {max_queued_tokens}); retry later", status=503,
                       kind="server_busy", headers={"Retry-After": "1"})
    ids = []
    try:
      for r in requests:
        ids.append(aio.add_request(r))
    except (ValueError, TypeError) as e:
      aio.abort_many(ids)
      raise BadRequest(public_message(e)) from e
    metrics.accepted(own)
    stop = body.stop or []
    include_stop, skip_special_tokens = body.include_stop_str_in_output, body.skip_special_tokens
    if tools is not None and tools.mode == "auto" and parser.needs_special_tokens:
      skip_special_tokens = False   # the parser's marker is a special token
    samples = [[_Sample(tokenizer, stop, arrived,
                        None if r.params.logprobs is None else LogprobFormatter(
                            tokenizer, chat=chat, as_ids=body.return_tokens_as_token_ids),
                        include_stop=include_stop, skip_special_tokens=skip_special_tokens,
                        min_tokens=r.params.min_tokens)
                for _ in range(r.params.n)] for r in requests]
    return ids, samples, arrived

  async def events(ids, samples):
    """Merged `(request index, sample index, text, finish or None, logprobs or None)`."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, rid):
      try:
        async for d in aio.deltas(rid):
          await queue.put((i, d))
      except Exception as e:   # pylint: disable=broad-except  (reported to the client)
        await queue.put((i, e))
      await queue.put((i, None))

    async def merged():
      live = len(tasks)
      while live:
        i, d = await queue.get()
        if d is None:
          live -= 1
        else:
          yield i, d

    async def single():   # one prompt (the common request): no pump task, no second queue
      try:
        async for d in aio.deltas(ids[0]):
          yield 0, d
      except Exception as e:   # pylint: disable=broad-except  (reported to the client)
        yield 0, e

    tasks = [asyncio.ensure_future(pump(i, rid)) for i, rid in enumerate(ids)] if len(ids) > 1 else []
    source = merged() if tasks else single()
    slice_start = time.perf_counter()
    failed = False
    try:
      async for i, d in source:
        # An entry's deltas arrive together, and taking a ready item from a queue does not
        # yield: detokenising and formatting them is cut into slices, between which the
        # event loop serves everyone else (/health, other clients, new requests).
        if time.perf_counter() - slice_start > _SLICE_SECONDS:
          await asyncio.sleep(0)
          slice_start = time.perf_counter()
        if isinstance(d, Draining):   # counted in one line by the drain
          drain.answered += 1
          raise BadRequest("the server is shutting down and this request did not finish within "
                           "its shutdown timeout; retry it", status=503,
                           kind="service_unavailable")
        if isinstance(d, BaseException):
          # The failure's text names every dropped request and the engine's internals: it goes
          # to the server's log (once), and each client hears only of its own request.
          failed = True
          if not getattr(d, "_logged", False):
            _log.error("the engine failed; its requests were dropped: %s", d)
            d._logged = True   # pylint: disable=protected-access
          raise BadRequest("the engine failed while serving this request, which was dropped; "
                           "the server serves on (see its log)", status=500, kind="server_error")
        s = samples[i][d.index]
        if s.finish is not None:
          continue
        now = time.perf_counter()
        if d.tokens:
          if s.last is None:
            metrics.ttft.observe(now - s.arrived)
          else:
            metrics.itl.observe((now - s.last) / len(d.tokens), len(d.tokens))
          s.last = now
        s.tokens += len(d.tokens)
        text, logprobs = s.push(d)
        if s.text.stopped:   # a stop string: end this sample in the engine too
          if d.finish_reason is None:
            aio.abort(ids[i], d.index)
          s.finish = "stop"
        elif d.finish_reason is not None:
          text += s.text.finish()
          s.finish = d.finish_reason
        if s.finish is not None:
          metrics.finished.labels(s.finish).inc()
          metrics.e2e.observe(now - s.arrived)
        if d.timing is not None and d.timing.queue_seconds is not None:
          metrics.queue.observe(d.timing.queue_seconds)
        yield i, d.index, text, s.finish, logprobs
    finally:
      await source.aclose()
      left = [rid for i, rid in enumerate(ids) if any(s.finish is None for s in samples[i])]
      aio.abort_many(left)   # a client that sent many prompts and left: one call
      for t in tasks:
        t.cancel()   # their generators close (what they would abort is aborted already)
      unfinished = sum(s.finish is None for ss in samples for s in ss)
      if unfinished:   # the engine's failure, or a client that went away
        metrics.finished.labels("error" if failed else "abort").inc(unfinished)

  def usage(requests, samples):
    prompt = sum(len(r.prompt) for r in requests)
    completion = sum(s.usage_tokens for ss in samples for s in ss)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

  async def score(body, prompts: list[list[int]]) -> _Scored | None:
    """The prompts' own logprobs where asked (`echo` with `logprobs`, `prompt_logprobs`)."""
    echo_k = body.logprobs if getattr(body, "echo", False) else None
    asked = [(k, name) for k, name in ((echo_k, "logprobs"),
                                       (body.prompt_logprobs, "prompt_logprobs")) if k is not None]
    if not asked:
      return None
    for k, name in asked:
      if scoring is None:
        raise BadRequest(f"{name} on the prompt is served by the engine's process: not with "
                         "--api-server-count > 1", param=name)
      if k > scoring.max_logprobs:
        raise BadRequest(f"{name}={k} is over the server's max_logprobs={scoring.max_logprobs}",
                         param=name)
    check_prompts(prompts, "messages" if isinstance(body, ChatRequest) else "prompt")
    if not scorers:
      scorers.append(PromptScorer(scoring))
    k = max(k for k, _ in asked)
    try:
      scored = await asyncio.to_thread(lambda: [scorers[0].score(q, k) for q in prompts])
    except ValueError as e:   # a token outside the vocabulary
      raise BadRequest(public_message(e), param="prompt") from e
    return _Scored(prompts, scored, echo_k, body.prompt_logprobs)

  def echo_only(body, prompts: list[list[int]], echoed: list[str], scored=None):
    """`max_tokens: 0` with `echo`: each prompt's text as its choices (with its logprobs if
    asked), nothing generated."""
    check_prompts(prompts, "prompt")
    head = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": model_name,
            "object": "text_completion"}
    as_ids = body.return_tokens_as_token_ids
    choices = [{"index": i * body.n + j, "text": text, "finish_reason": "length",
                "logprobs": None} for i, text in enumerate(echoed) for j in range(body.n)]
    if scored is not None:
      for c in choices:
        c.update(scored.fields(c["index"] // body.n, LogprobFormatter(tokenizer, chat=False,
                                                                      as_ids=as_ids)))
    prompt_tokens = sum(map(len, prompts))
    usage_ = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
              "total_tokens": prompt_tokens}
    if not body.stream:
      return head | {"choices": choices, "usage": usage_}

    async def events():
      for choice in choices:
        yield "data: " + json.dumps(head | {"choices": [choice]}) + "\n\n"
      if body.stream_options and body.stream_options.include_usage:
        yield "data: " + json.dumps(head | {"choices": [], "usage": usage_}) + "\n\n"
      yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")

  async def respond(http, body, requests, *, chat: bool, echoed: list[str] | None = None,
                    scored: _Scored | None = None, tools=None):
    ids, samples, _ = await serve(http, requests, body, chat, tools)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    n = body.n
    head = {"id": rid, "created": int(time.time()), "model": model_name}
    # Each choice's prompt logprobs: a sample's formatter goes on from the echoed prompt's offsets.
    firsts = [[{} if scored is None else scored.fields(
        i, samples[i][j].logprobs or LogprobFormatter(tokenizer, chat=chat)) for j in range(n)]
        for i in range(len(requests))]
    if body.stream:
      return StreamingResponse(_sse(head, ids, samples, requests, body, chat=chat, echoed=echoed,
                                    firsts=firsts, tools=tools), media_type="text/event-stream")
    texts = [[echoed[i] if echoed else ""] * n for i in range(len(requests))]
    lps = [[[firsts[i][j]["logprobs"]] if "logprobs" in firsts[i][j] else [] for j in range(n)]
           for i in range(len(requests))]
    watcher = asyncio.ensure_future(disconnected(http))
    gen = events(ids, samples)
    try:
      async for i, j, text, _, logprobs in until(gen, watcher):
        texts[i][j] += text
        if logprobs is not None:
          lps[i][j].append(logprobs)
    finally:
      watcher.cancel()
      await gen.aclose()
    # Each choice is merged and encoded on its own, the event loop let in between slices: a
    # response of many samples with logprobs (tens of MB) never holds it for long.
    choices, slice_start = [], time.perf_counter()
    for i in range(len(requests)):
      for j in range(n):
        if time.perf_counter() - slice_start > _SLICE_SECONDS:
          await asyncio.sleep(0)
          slice_start = time.perf_counter()
        reason = samples[i][j].finish
        reason = "stop" if reason == "abort" else reason
        logprobs = (None if samples[i][j].logprobs is None
                    else LogprobFormatter.merge(lps[i][j], chat=chat))
        if chat:
          message = {"role": "assistant", "content": texts[i][j]}
          if tools is not None and tools.mode != "none":
            content, calls = split_calls(tools, parser, texts[i][j])
            if calls:
              message = {"role": "assistant", "content": content or None,
                         "tool_calls": [tool_call(name, args) for name, args in calls]}
              reason = "tool_calls" if tools.mode != "named" and reason == "stop" else reason
          choice = {"index": i * n + j, "finish_reason": reason, "logprobs": logprobs,
                    "message": message}
        else:
          choice = {"index": i * n + j, "text": texts[i][j], "finish_reason": reason,
                    "logprobs": logprobs}
        if "prompt_logprobs" in firsts[i][j]:
          choice["prompt_logprobs"] = firsts[i][j]["prompt_logprobs"]
        choices.append(_json(choice))
    head = _json(head | {"object": "chat.completion" if chat else "text_completion"})
    return Response(f'{head[:-1]},"choices":[{",".join(choices)}],'
                    f'"usage":{_json(usage(requests, samples))}}}'.encode(),
                    media_type="application/json")

  async def _sse(head, ids, samples, requests, body, *, chat: bool,
                 echoed: list[str] | None = None, firsts: list[list[dict]], tools=None):
    kind = "chat.completion.chunk" if chat else "text_completion"
    n = body.n
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices, **extra):
      return "data: " + json.dumps(head | {"object": kind, "choices": choices} | extra) + "\n\n"

    # Each choice's first chunk: the role (chat), the echoed prompt; its prompt logprobs.
    if chat:
      yield chunk([{"index": i * n + j, "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None} | firsts[i][j]
                   for i in range(len(requests)) for j in range(n)])
    elif echoed or any(f for fs in firsts for f in fs):
      yield chunk([{"index": i * n + j, "text": echoed[i] if echoed else "",
                    "finish_reason": None, "logprobs": None} | firsts[i][j]
                   for i in range(len(requests)) for j in range(n)])
    calls = ({} if tools is None or tools.mode == "none" else
             {(i, j): StreamedCalls(tools, parser) for i in range(len(requests)) for j in range(n)})
    gen = events(ids, samples)
    try:
      async for i, j, text, finish, logprobs in gen:
        has_tokens = logprobs is not None and any(logprobs.get("content", logprobs.get("tokens")))
        if not text and finish is None and not has_tokens:
          continue
        finish = "stop" if finish == "abort" else finish
        if chat and calls:   # content and tool calls, as the tool mode splits them
          delta, finish = calls[i, j].push(text, finish)
          if delta is not None or finish is not None or has_tokens:
            yield chunk([{"index": i * n + j, "delta": delta or {}, "finish_reason": finish,
                          "logprobs": logprobs}])
        elif chat:
          yield chunk([{"index": i * n + j, "delta": {"content": text} if text else {},
                        "finish_reason": finish, "logprobs": logprobs}])
        else:
          yield chunk([{"index": i * n + j, "text": text, "finish_reason": finish,
                        "logprobs": logprobs}])
      if include_usage:
        yield chunk([], usage=usage(requests, samples))
      yield "data: [DONE]\n\n"
    except BadRequest as e:   # headers are sent: report in the stream, then end it as usual
      yield "data: " + json.dumps(error_body(e.message, e.kind, e.param)) + "\n\n"
      yield "data: [DONE]\n\n"
    finally:
      await gen.aclose()

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, http: Request):
    check_model(body)
    p = body.prompt
    check_text(p, "prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
      texts = [p] if isinstance(p, str) else p
      if len(texts) > max_prompts:
        raise BadRequest(f"prompt holds {len(texts)} prompts; at most {max_prompts} per request",
                         status=413, param="prompt")
      prompts = await off_loop(sum(map(len, texts)), lambda: [
          encode_or_refuse(lambda t=t: tokenizer.encode(t, max_tokens=engine.max_len - 1),
                           "prompt") for t in texts])
    else:
      texts = None
      prompts = [p] if not p or isinstance(p[0], int) else p
    if not prompts:
      raise BadRequest("prompt must not be empty", param="prompt")
    echoed = None
    if body.echo:   # the prompt as given, or the token ids' text
      echoed = texts or [tokenizer.decode(q, skip_special_tokens=body.skip_special_tokens)
                         for q in prompts]
    if body.max_tokens == 0 and body.max_completion_tokens is None:
      if not body.echo:
        raise BadRequest("max_tokens=0 generates nothing; it needs echo=true", param="max_tokens")
      return echo_only(body, prompts, echoed, await score(body, prompts))
    constraint = constraint_of(body, body.model_extra or {})
    requests = build(body, prompts, chat=False, grammar=await grammar_of(constraint),
                     constraint=constraint)   # every refusal before the scoring runs
    return await respond(http, body, requests, chat=False, echoed=echoed,
                         scored=await score(body, prompts))

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatRequest, http: Request):
    check_model(body)
    messages = [m.for_template() for m in body.messages]
    check_text(messages, "messages")
    tools = tools_of(body.tools, body.tool_choice, body.parallel_tool_calls, tool_call_parser)
    constraint = constraint_of(body, body.model_extra or {})
    schema = None if tools is None else tools.schema()
    if schema is not None:
      if constraint is not None:
        raise BadRequest(f"tool_choice={body.tool_choice!r} and {constraint.field} both "
                         "constrain the output; give one", param=constraint.field)
      constraint = Constraint("tools", "json", schema)
    size = sum(len(str(m.get("content", ""))) for m in messages)
    prompt = await off_loop(size, lambda: encode_or_refuse(lambda: tokenizer.encode(
        tokenizer.render_chat(messages, add_generation_prompt=body.add_generation_prompt,
                              chat_template=chat_template, tools=body.tools or None,
                              **(body.chat_template_kwargs or {})),
        add_special_tokens=False, max_tokens=engine.max_len - 1), "messages"))
    grammar = await grammar_of(constraint)
    requests = build(body, [prompt], chat=True, grammar=grammar, constraint=constraint)
    return await respond(http, body, requests, chat=True, scored=await score(body, [prompt]),
                         tools=tools)

  return app


_log = logging.getLogger("jaxkv.http")


class _Scored:
  """The prompts' `PromptLogprob`s, and the fields a choice carries from them."""

  def __init__(self, prompts, scored, echo_k: int | None, prompt_k: int | None):
    self.prompts, self.scored, self.echo_k, self.prompt_k = prompts, scored, echo_k, prompt_k

  def fields(self, i: int, formatter: LogprobFormatter) -> dict:
    """Prompt `i`'s `logprobs` (echoed: OpenAI's shape, via the choice's `formatter`) and
    `prompt_logprobs` (vLLM's), each with its own top n."""
    top = lambda k: [dataclasses.replace(e, top=e.top[:k]) for e in self.scored[i]]
    out = {}
    if self.echo_k is not None:
      out["logprobs"] = formatter.format_prompt(self.prompts[i][0], top(self.echo_k))
    if self.prompt_k is not None:
      out["prompt_logprobs"] = formatter.prompt_logprobs(top(self.prompt_k))
    return out


def _json(obj) -> str:
  """`obj` as FastAPI's JSONResponse writes it (UTF-8 text, no NaN, compact)."""
  return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

# Most time one request's delta formatting holds the event loop before it lets others in.
_SLICE_SECONDS = 0.005


def _version() -> str:
  from jaxkv import __version__   # pylint: disable=g-import-not-at-top
  return __version__
