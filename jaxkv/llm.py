"""`LLM`: text in, text out, from a checkpoint directory or a Hugging Face model id.

```python
from jaxkv import LLM, SamplingParams
llm = LLM("Qwen/Qwen3-0.6B")
print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].text)
```

The checkpoint is loaded and sized from memory by
`jaxkv.serve.loading.build_engine` (`jaxkv.serve.sizing.plan_serving`: paged K/V
with prefix caching, `max_len` from the checkpoint, `max_seqs` from the
budget; `LLM.plan` says what was chosen, `LLM.plan.lines()` in words) and
served by one `jaxkv.serve.Engine`, through its incremental API (`add_request`/`step`)
for `generate`, `chat` and `stream` alike: one loop state of fixed shape serves every
batch size and request kind, so the loop compiles once per variant (plain greedy, and
with the sampler), not per call shape. Results are shaped like vLLM's:
`generate` returns one `RequestOutput` per prompt, each holding
`SamplingParams.n` `CompletionOutput`s.

Defaults as a vLLM user expects them:
- requests stop at the checkpoint's end-of-sequence ids (generation_config.json's
  `eos_token_id`, else the tokenizer's eos token, else config.json's), added to
  `SamplingParams.stop_tokens`; `ignore_eos=True` turns that off;
- `jaxkv.SamplingParams` is spelled as vLLM's (`stop`, `stop_token_ids`,
  `ignore_eos`, `max_tokens=None`, temperature 1.0 and a fresh seed by default);
  with no `params`, requests use `SamplingParams()` (16 tokens), as vLLM's; the
  engine's `jaxkv.serve.SamplingParams` (temperature 0 and seed 0 by default)
  are taken too;
- a request that ends on a stop token keeps the token in `token_ids` but not
  its text in `text` (vLLM's rule);
- `SamplingParams(top_k=-1)` means no top-k, as in vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator, NamedTuple, Sequence

import jax
import numpy as np

from jaxkv.serve import loading, sizing
from jaxkv.serve.loading import build_engine
from jaxkv.serve import EngineError, Request, RequestTiming, TokenLogprob
from jaxkv.serve import SamplingParams as EngineParams
from jaxkv.structured.automaton import AutomatonCache, StructuredOutputs
from jaxkv.structured.vocab import model_token_bytes
from jaxkv.tokenizer import TextStream


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How `LLM` samples a prompt, spelled as vLLM's `SamplingParams` (`jaxkv.SamplingParams`).

  Attributes:
    n: samples of the prompt.
    max_tokens: most tokens to generate; None: up to the engine's `max_len`.
    temperature: 0 is greedy (default 1.0, as vLLM).
    top_p, top_k, min_p: nucleus, top-k (0 or -1: off) and min-p filtering.
    presence_penalty, frequency_penalty, repetition_penalty: as vLLM's.
    seed: the request's seed; None (the default): a fresh one per request,
      reported on each output (`CompletionOutput.seed`).
    stop: strings that end the text (not included unless
      `include_stop_str_in_output`).
    stop_token_ids: token ids that end the output (the id is kept in `token_ids`).
    ignore_eos: do not stop at the checkpoint's end-of-sequence ids.
    include_stop_str_in_output: keep the stop string found in the text.
    skip_special_tokens: leave special tokens' text out of `text`.
    logprobs: top alternatives reported per token (None: none).
    min_tokens: no stop token id (EOS included) and no stop string before this many
      tokens.
    logit_bias: `{token id: bias}`, each in [-100, 100], added to the logits.
    allowed_token_ids: None, or the only token ids that may be generated.
    structured_outputs: None, a `jaxkv.structured.automaton.StructuredOutputs`, or a
      dict of its fields (`{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`,
      `{"json_object": True}`): the output follows it, token by token on the device,
      and ends with an end-of-sequence id once complete (so not with `ignore_eos`
      unless `stop_token_ids` gives one).

  vLLM fields that are not here (`bad_words`,
  `prompt_logprobs`, ...) are refused by name (a TypeError); the README lists
  the differences that remain.
  """

  n: int = 1
  max_tokens: int | None = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  min_p: float = 0.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  seed: int | None = None
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] | None = None
  ignore_eos: bool = False
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  logprobs: int | None = None
  min_tokens: int = 0
  logit_bias: dict | None = None
  allowed_token_ids: Sequence[int] | None = None
  structured_outputs: StructuredOutputs | dict | None = None

  def __post_init__(self):
    stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
    if not all(isinstance(x, str) and x for x in stop):
      raise ValueError(f"stop={self.stop!r} must be a string or a list of non-empty strings")
    object.__setattr__(self, "stop", tuple(stop))
    object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
    so = self.structured_outputs
    if isinstance(so, dict):
      unknown = set(so) - {f.name for f in dataclasses.fields(StructuredOutputs)}
      if unknown:
        raise TypeError(f"structured_outputs: unknown fields {sorted(unknown)}")
      object.__setattr__(self, "structured_outputs", StructuredOutputs(**so))
    elif so is not None and not isinstance(so, StructuredOutputs):
      raise TypeError(f"structured_outputs={so!r:.100} must be a StructuredOutputs, a dict of "
                      "its fields, or None")
    # The engine's checks, by name (max_tokens None: up to max_len, checked per prompt).
    self.engine_params(max_tokens=self.max_tokens or max(self.min_tokens, 1), eos=())

  def engine_params(self, *, max_tokens: int, eos: Sequence[int], grammar=None) -> EngineParams:
    """The engine's `SamplingParams` of this request (`eos` added unless `ignore_eos`;
    `grammar`: the compiled `structured_outputs`)."""
    stops = tuple(self.stop_token_ids) + (() if self.ignore_eos else tuple(eos))
    return EngineParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                        top_p=self.top_p, seed=self.seed, stop_tokens=tuple(dict.fromkeys(stops)),
                        n=self.n, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                        presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, logprobs=self.logprobs,
                        min_tokens=self.min_tokens, logit_bias=self.logit_bias or (),
                        allowed_token_ids=self.allowed_token_ids, grammar=grammar)


class _Text(NamedTuple):
  """How a finished sample's tokens become text: stop strings and special tokens."""
  stop: tuple = ()
  include_stop: bool = False
  skip_special_tokens: bool = True
  min_tokens: int = 0


class _Sample:
  """One sample's deltas, gathered as they come."""

  def __init__(self):
    self.tokens: list[int] = []
    self.logprobs: list[TokenLogprob] | None = None
    self.finish_reason: str | None = None
    self.seed: int | None = None
    self.timing: RequestTiming | None = None

  def add(self, delta) -> None:
    self.tokens += delta.tokens
    if delta.logprobs is not None:
      self.logprobs = (self.logprobs or []) + list(delta.logprobs)
    self.seed = delta.seed
    if delta.finish_reason is not None:
      self.finish_reason, self.timing = delta.finish_reason, delta.timing


@dataclasses.dataclass
class CompletionOutput:
  """One sample of a request (vLLM's `CompletionOutput`).

  Attributes:
    index: the sample's index (0..n-1).
    text: its text (the stop token's text left out; "" without a tokenizer).
    token_ids: its generated tokens (a stop token kept, last).
    finish_reason: `"stop"` (a stop token) or `"length"` (`max_tokens`).
    seed: the seed it was drawn with.
    timing: its `jaxkv.serve.RequestTiming` (queue, first token, total,
      inter-token seconds).
    logprobs: one `jaxkv.serve.TokenLogprob` per token when asked
      (`SamplingParams.logprobs`), else None.
  """

  index: int
  text: str
  token_ids: list[int]
  finish_reason: str
  seed: int | None = None
  timing: RequestTiming | None = None
  logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class RequestOutput:
  """The result of one prompt (vLLM's `RequestOutput`).

  Attributes:
    request_id: the prompt's index in the call.
    prompt: the prompt text (the rendered chat for `chat`; None for token ids).
    prompt_token_ids: the prompt's tokens.
    outputs: one `CompletionOutput` per sample, by index.
    finished: always True (`generate` returns finished requests).

  `text`, `token_ids` and `finish_reason` are those of `outputs[0]`.
  """

  request_id: int
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool = True

  @property
  def text(self) -> str:
    return self.outputs[0].text

  @property
  def token_ids(self) -> list[int]:
    return self.outputs[0].token_ids

  @property
  def finish_reason(self) -> str:
    return self.outputs[0].finish_reason


def _is_ids(x) -> bool:
  if isinstance(x, np.ndarray):
    return x.ndim == 1 and x.dtype.kind in "iu"
  return (isinstance(x, (list, tuple)) and len(x) > 0
          and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x))


def _prompts(prompts) -> list[str | list[int]]:
  """A list of prompts (text or token ids) from one prompt or a list of them."""
  if isinstance(prompts, str) or _is_ids(prompts):
    return [prompts]
  if isinstance(prompts, (list, tuple)) and prompts and all(
      isinstance(p, str) or _is_ids(p) for p in prompts):
    return list(prompts)
  raise TypeError(f"prompts={prompts!r:.200} must be a str, a list of token ids, or a "
                  "non-empty list of those")


class LLM:
  """A checkpoint served offline: `generate`, `chat` and `stream` on text or token ids.

  Args:
    model: a checkpoint directory or a Hugging Face model id
      (`jaxkv.models.hf.resolve_checkpoint`).
    dtype: compute dtype, `"auto"` (the checkpoint's), `"float32"`,
      `"bfloat16"` or `"float16"` (or a dtype).
    kv_cache_dtype: K/V dtype, `"auto"` (the compute dtype) or a name.
    max_len: longest prompt + completion (default the checkpoint's
      `max_position_embeddings`).
    max_seqs: sequences at once (default: derived from the memory budget).
    page_size: positions per K/V page (None: column storage).
    kv_cache_memory: K/V bytes (wins over `gpu_memory_utilization`).
    gpu_memory_utilization: the share of device memory this LLM may use
      (default 0.9; weights included).
    prefix_caching: reuse the K/V of prompt prefixes across requests (paged).
    max_write: tokens per step (the widest compiled step).
    implementation: attention implementation (None: automatic).
    tensor_parallel_size: devices the weights and K/V are split over.
    max_model_len, max_num_seqs: vLLM's names of `max_len` and `max_seqs`.
    compilation_cache: JAX's persistent compilation cache directory, shared with
      `jaxkv serve` (a second process compiles nothing it already compiled):
      `"auto"` keeps one already configured (`JAX_COMPILATION_CACHE_DIR`) and
      otherwise uses `~/.cache/jaxkv/jax`; None leaves JAX's setting alone.
    speculative: a `jaxkv.serve.SpeculativeConfig`: greedy requests are drafted
      and verified several tokens a step (the same tokens); None: one a step.

  Attributes:
    plan: the `jaxkv.serve.sizing.ServingPlan` it runs on.
    tokenizer: the `jaxkv.tokenizer.Tokenizer` (None when the checkpoint has
      no tokenizer.json: prompts must then be token ids).
    engine: the `jaxkv.serve.Engine`.
    eos_ids: the stop ids added to every request unless `ignore_eos`.

  Raises:
    ValueError, TypeError: a bad checkpoint or size (named).
    ImportError: an optional package the checkpoint needs (naming the extra).
  """

  def __init__(self, model: str, *, dtype="auto", kv_cache_dtype="auto",
               max_len: int | None = None, max_seqs: int | None = None,
               page_size: int | None = sizing.DEFAULT_PAGE_SIZE,
               kv_cache_memory: int | None = None, gpu_memory_utilization: float | None = None,
               prefix_caching: bool = True, max_write: int = sizing.DEFAULT_MAX_WRITE,
               implementation: str | None = None, tensor_parallel_size: int = 1,
               max_model_len: int | None = None, max_num_seqs: int | None = None,
               compilation_cache: str | None = "auto", speculative=None):
    for ours, value, theirs, alias in (("max_len", max_len, "max_model_len", max_model_len),
                                       ("max_seqs", max_seqs, "max_num_seqs", max_num_seqs)):
      if value is not None and alias is not None:
        raise ValueError(f"give {ours} or {theirs} (vLLM's name), not both")
    max_len = max_len if max_model_len is None else max_model_len
    max_seqs = max_seqs if max_num_seqs is None else max_num_seqs
    if compilation_cache == "auto":
      compilation_cache = (None if jax.config.jax_compilation_cache_dir
                           else loading.DEFAULT_COMPILATION_CACHE)
    elif compilation_cache is not None and not isinstance(compilation_cache, (str, os.PathLike)):
      raise TypeError(f"compilation_cache={compilation_cache!r} must be a directory, 'auto' or None")
    loading.use_compilation_cache(None if compilation_cache is None else os.fspath(compilation_cache))
    self.engine, self.model, self.tokenizer, self.plan = build_engine(
        model, tensor_parallel_size=tensor_parallel_size, dtype=_dtype_arg("dtype", dtype),
        kv_cache_dtype=_dtype_arg("kv_cache_dtype", kv_cache_dtype), max_len=max_len,
        max_seqs=max_seqs, page_size=page_size, kv_cache_memory=kv_cache_memory,
        gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching,
        max_write=max_write, implementation=implementation, speculative=speculative)
    eos = self.tokenizer.eos_ids if self.tokenizer is not None else ()
    self.eos_ids = tuple(eos) or tuple(self.model.config.eos_token_ids)
    # Requests in flight (generate's and open streams'): their deltas, and samples not ended.
    self._inbox: dict[str, list] = {}
    self._open: dict[str, int] = {}
    # Requests an engine failure dropped while another call pumped: raised by their own call.
    self._failed: dict[str, EngineError] = {}
    self._ids = 0
    self._automaton_cache: AutomatonCache | None = None

  # ------------------------------------------------------------------ requests

  def _encode(self, prompt) -> tuple[str | None, tuple[int, ...]]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer.json: give prompts as token ids")
      return prompt, tuple(self.tokenizer.encode(prompt))
    return None, tuple(int(t) for t in prompt)

  def _params(self, params, ignore_eos: bool, prompt_len: int) -> tuple[EngineParams, _Text]:
    """The engine's parameters of one prompt, and how its tokens become text.

    `params`: a `jaxkv.SamplingParams` (vLLM's spelling), the engine's
    `jaxkv.serve.SamplingParams`, or None (`jaxkv.SamplingParams()`, as vLLM).
    """
    if params is None:
      params = SamplingParams()
    if isinstance(params, SamplingParams):
      max_tokens = params.max_tokens
      if max_tokens is None:   # up to max_len, as vLLM's up to max_model_len
        max_tokens = self.engine.max_len - prompt_len
        if max_tokens < 1:
          raise ValueError(f"the prompt has {prompt_len} tokens; max_len={self.engine.max_len} "
                           "leaves none to generate")
      eos = () if ignore_eos else self.eos_ids
      grammar = None
      if params.structured_outputs is not None:
        grammar = self._automata().compile(*params.structured_outputs.spec())
      return (params.engine_params(max_tokens=max_tokens, eos=eos, grammar=grammar),
              _Text(params.stop, params.include_stop_str_in_output, params.skip_special_tokens,
                    params.min_tokens))
    if not isinstance(params, EngineParams):
      raise TypeError(f"params={params!r} must be a jaxkv.SamplingParams, a "
                      "jaxkv.serve.SamplingParams or None")
    if not ignore_eos:
      extra = tuple(t for t in self.eos_ids if t not in params.stop_tokens)
      params = dataclasses.replace(params, stop_tokens=params.stop_tokens + extra)
    return params, _Text()

  def _automata(self) -> AutomatonCache:
    """The compiled structured outputs of this LLM's vocabulary (made on first use)."""
    if self._automaton_cache is None:
      if self.tokenizer is None:
        raise ValueError("structured_outputs needs the checkpoint's tokenizer.json (text "
                         "grammars are over the tokens' bytes)")
      self._automaton_cache = AutomatonCache(model_token_bytes(self.tokenizer,
                                                               self.engine.vocab_size))
    return self._automaton_cache

  def _per_prompt(self, params, encoded, ignore_eos: bool) -> list[tuple[EngineParams, _Text]]:
    if isinstance(params, (list, tuple)):
      if len(params) != len(encoded):
        raise ValueError(f"params has {len(params)} entries for {len(encoded)} prompts")
      return [self._params(p, ignore_eos, len(ids)) for p, (_, ids) in zip(params, encoded)]
    return [self._params(params, ignore_eos, len(ids)) for _, ids in encoded]

  def _text_stream(self, how: _Text) -> TextStream:
    return TextStream(self.tokenizer, how.stop, include_stop=how.include_stop,
                      skip_special_tokens=how.skip_special_tokens, min_tokens=how.min_tokens)

  def _finish(self, tokens: Sequence[int], finish_reason: str,
              text: _Text) -> tuple[str, list[int], str]:
    """`(text, token_ids, finish_reason)` of a finished sample, as `stream` delivers its text:
    a stop string ends the text (the tokens kept are those whose text came back)."""
    if self.tokenizer is None:
      return "", list(tokens), finish_reason
    kept = list(tokens[:-1]) if finish_reason == "stop" else list(tokens)
    s = self._text_stream(text)
    out = s.push(kept) + s.finish()
    if s.stopped:
      return out, kept[:s.tokens_returned()], "stop"
    return out, list(tokens), finish_reason

  # ------------------------------------------------------------------ public API

  def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
               *, ignore_eos: bool = False) -> list[RequestOutput]:
    """Generates for every prompt; returns one `RequestOutput` per prompt, in order.

    Args:
      prompts: a str, a list of token ids, or a list of those.
      params: one `SamplingParams` for all prompts, one per prompt, or None
        (`SamplingParams()`: 16 tokens at temperature 1, a fresh seed, as vLLM);
        the engine's `jaxkv.serve.SamplingParams` are taken too.
      ignore_eos: do not stop at the checkpoint's eos ids (as `SamplingParams.ignore_eos`).

    Prompts are served together (fcfs into the engine's columns); a sample whose
    text reaches a stop string is aborted there.

    Raises:
      TypeError, ValueError: a malformed prompt or parameters, or a request the
        engine cannot hold (nothing is served then).
      EngineError: the model or device failed; nothing of the call stays in the engine.
    """
    encoded = [self._encode(p) for p in _prompts(prompts)]
    return self._generate(encoded, self._per_prompt(params, encoded, ignore_eos))

  def _generate(self, encoded, params) -> list[RequestOutput]:
    # On the incremental API, as `stream`: one loop state of fixed shape serves every batch
    # size, logprobs or not, so each loop variant compiles once per LLM, not per request kind.
    requests = [Request(ids, p, request_id=self._next_id()) for (_, ids), (p, _) in
                zip(encoded, params)]
    for i, r in enumerate(requests):   # every request is checked (named by its index) first
      self.engine.check(r.replace(request_id=i))
    samples = {(r.request_id, j): _Sample() for r in requests for j in range(r.params.n)}
    # A sample whose text reaches a stop string is aborted there, not run to max_tokens.
    texts = {(r.request_id, j): self._text_stream(how) for r, (_, how) in zip(requests, params)
             if how.stop and self.tokenizer is not None for j in range(r.params.n)}
    with self._serving(requests):
      while any(self._open[r.request_id] for r in requests):
        self._pump()
        for r in requests:
          for delta in self._inbox[r.request_id]:
            key = (r.request_id, delta.index)
            samples[key].add(delta)
            text = texts.get(key)
            if text is not None and delta.finish_reason is None and not text.stopped:
              text.push(list(delta.tokens))
              if text.stopped:
                self.engine.abort(r.request_id, delta.index)
          self._inbox[r.request_id].clear()
      self._raise_dropped(requests)
    outputs = [RequestOutput(i, text, list(ids), []) for i, (text, ids) in enumerate(encoded)]
    for i, r in enumerate(requests):
      for j in range(r.params.n):
        sample = samples[r.request_id, j]
        text, token_ids, reason = self._finish(sample.tokens, sample.finish_reason, params[i][1])
        logprobs = None if sample.logprobs is None else sample.logprobs[:len(token_ids)]
        outputs[i].outputs.append(CompletionOutput(j, text, token_ids, reason, sample.seed,
                                                   sample.timing, logprobs))
    return outputs

  def _next_id(self) -> str:
    self._ids += 1
    return f"llm-{self._ids}"

  @contextlib.contextmanager
  def _serving(self, requests):
    """Queues `requests` and gives each an inbox `_pump` fills; on the way out, whatever of
    them still runs (an error, an interrupt, a closed stream) is aborted and, unless
    interrupted, stepped out, so the engine holds nothing of them."""
    interrupted = False
    try:
      for r in requests:
        self.engine.add_request(r)
        self._inbox[r.request_id], self._open[r.request_id] = [], r.params.n
      yield
    except BaseException as e:
      interrupted = not isinstance(e, (Exception, GeneratorExit))   # Ctrl-C: stop now
      raise
    finally:
      running = [r.request_id for r in requests if self._open.get(r.request_id)]
      for rid in running:
        self.engine.abort(rid)
      try:
        while not interrupted and any(self._open.get(rid) for rid in running):
          self._pump()   # the aborted end at the next entry
      finally:
        for r in requests:
          self._inbox.pop(r.request_id, None)
          self._open.pop(r.request_id, None)
          self._failed.pop(r.request_id, None)

  def _raise_dropped(self, requests) -> None:
    """Raises the engine failure that dropped one of `requests` during another call's pump (it
    ended without a finish reason: never reported as complete)."""
    for r in requests:
      failure = self._failed.pop(r.request_id, None)
      if failure is not None:
        raise failure

  def _pump(self, steps: int | None = None) -> None:
    """One loop entry (`steps` steps, default the engine's); its deltas go to the inboxes of
    the requests this LLM is serving."""
    try:
      deltas = self.engine.step(steps or self.engine.max_steps)
    except EngineError as e:
      self._route(getattr(e, "deltas", None) or [])
      for rid in getattr(e, "failed", None) or ():   # dropped: they send no more deltas
        if self._open.get(rid):
          self._failed[rid] = e
        self._open[rid] = 0
      raise
    self._route(deltas)

  def _route(self, deltas) -> None:
    for delta in deltas:
      box = self._inbox.get(delta.request_id)
      if box is not None:
        box.append(delta)
        if delta.finish_reason is not None and self._open.get(delta.request_id):
          self._open[delta.request_id] -= 1

  def chat(self, messages, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
           add_generation_prompt: bool = True, chat_template: str | None = None,
           ignore_eos: bool = False, **template_kwargs) -> list[RequestOutput]:
    """Generates replies to conversations rendered through the checkpoint's chat template.

    Args:
      messages: one conversation (a list of `{"role", "content"}` dicts) or a
        list of conversations.
      params, ignore_eos: as `generate`.
      add_generation_prompt: end each prompt with the assistant's turn header.
      chat_template: a template name of the checkpoint's set, or template text.
      **template_kwargs: more template variables (e.g. `enable_thinking=False`).

    Returns:
      One `RequestOutput` per conversation; its `prompt` is the rendered text.

    Raises:
      ValueError: no tokenizer or chat template, or the template refused a
        conversation.
    """
    if self.tokenizer is None:
      raise ValueError("this checkpoint has no tokenizer.json: chat needs one")
    if isinstance(messages, (list, tuple)) and messages and all(
        isinstance(m, dict) for m in messages):
      conversations = [messages]
    elif isinstance(messages, (list, tuple)) and messages and all(
        isinstance(c, (list, tuple)) for c in messages):
      conversations = list(messages)
    else:
      raise TypeError("messages must be a conversation (a list of dicts) or a non-empty list "
                      "of conversations")
    encoded = []
    for conversation in conversations:
      text = self.tokenizer.render_chat(list(conversation),
                                        add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template, **template_kwargs)
      encoded.append((text, tuple(self.tokenizer.encode(text, add_special_tokens=False))))
    return self._generate(encoded, self._per_prompt(params, encoded, ignore_eos))

  def stream(self, prompt, params: SamplingParams | None = None, *,
             ignore_eos: bool = False, steps: int = 1) -> Iterator[str]:
    """Yields the text of one prompt's completion as it is generated.

    Runs on the engine's incremental API (`add_request`/`step`), `steps` steps
    per loop entry; the deltas concatenate to `generate`'s `text` for the same
    prompt and parameters. Closing the iterator early aborts the request.

    Args:
      prompt: a str or a list of token ids.
      params: a `SamplingParams` with `n == 1`, or None (as `generate`).
      ignore_eos: as `generate`.
      steps: engine steps between deltas.

    Raises:
      ValueError: `n > 1`, or a request the engine cannot hold.
    """
    if self.tokenizer is None:
      raise ValueError("this checkpoint has no tokenizer.json: stream yields text")
    if not (isinstance(prompt, str) or _is_ids(prompt)):
      raise TypeError(f"prompt={prompt!r:.200} must be a str or a list of token ids")
    _, ids = self._encode(prompt)
    p, how = self._params(params, ignore_eos, len(ids))
    if p.n != 1:
      raise ValueError(f"stream: n={p.n} must be 1 (use generate for several samples)")
    request = Request(ids, p, request_id=self._next_id())
    self.engine.check(request)
    text = self._text_stream(how)
    rid = request.request_id
    with self._serving([request]):   # leaving early (a stop string, close()) aborts the rest
      while self._open[rid] or self._inbox[rid]:
        if not self._inbox[rid]:
          self._pump(steps)
        deltas, self._inbox[rid] = self._inbox[rid], []
        for delta in deltas:
          tokens = list(delta.tokens)
          if delta.finish_reason == "stop":
            tokens = tokens[:-1]   # the stop token's text is left out, as in generate
          out = text.push(tokens)
          if text.stopped or delta.finish_reason is not None:   # a stop string ends it early
            out += text.finish()
            if out:
              yield out
            return
          if out:
            yield out
      self._raise_dropped([request])


def _dtype_arg(name: str, value):
  """A dtype argument: "auto", a dtype name jax.numpy knows, or a dtype; `kv_cache_dtype`
  also takes vLLM's fp8 names (passed on: the loader reads them)."""
  if isinstance(value, str) and value != "auto":
    import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
    if name == "kv_cache_dtype" and value in ("fp8", "fp8_e4m3", "fp8_e5m2"):
      return value
    if value not in ("float32", "bfloat16", "float16"):
      extra = ", 'fp8', 'fp8_e4m3', 'fp8_e5m2'" if name == "kv_cache_dtype" else ""
      raise ValueError(f"{name}={value!r} must be 'auto', 'float32', 'bfloat16' or "
                       f"'float16'{extra}")
    return getattr(jnp, value)
  return value


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
