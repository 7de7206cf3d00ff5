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
served by one `jaxkv.serve.Engine`. Results are shaped like vLLM's:
`generate` returns one `RequestOutput` per prompt, each holding
`SamplingParams.n` `CompletionOutput`s.

Defaults as a vLLM user expects them:
- requests stop at the checkpoint's end-of-sequence ids (generation_config.json's
  `eos_token_id`, else the tokenizer's eos token, else config.json's), added to
  `SamplingParams.stop_tokens`; `ignore_eos=True` turns that off;
- with no `params`, requests are greedy (`SamplingParams()`: 16 tokens) and draw
  a fresh seed each; a `SamplingParams` given keeps its `seed` (0 unless set:
  pass `seed=None` for a fresh random seed per request);
- a request that ends on a stop token keeps the token in `token_ids` but not
  its text in `text` (vLLM's rule);
- `SamplingParams(top_k=-1)` means no top-k, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import numpy as np

from jaxkv.serve import sizing
from jaxkv.serve.loading import build_engine
from jaxkv.serve import Request, RequestTiming, SamplingParams, TokenLogprob
from jaxkv.tokenizer import TextStream, Tokenizer


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
               implementation: str | None = None):
    self.engine, self.model, self.tokenizer, self.plan = build_engine(
        model, dtype=_dtype_arg("dtype", dtype),
        kv_cache_dtype=_dtype_arg("kv_cache_dtype", kv_cache_dtype), max_len=max_len,
        max_seqs=max_seqs, page_size=page_size, kv_cache_memory=kv_cache_memory,
        gpu_memory_utilization=gpu_memory_utilization, prefix_caching=prefix_caching,
        max_write=max_write, implementation=implementation)
    eos = self.tokenizer.eos_ids if self.tokenizer is not None else ()
    self.eos_ids = tuple(eos) or tuple(self.model.config.eos_token_ids)

  # ------------------------------------------------------------------ requests

  def _encode(self, prompt) -> tuple[str | None, tuple[int, ...]]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer.json: give prompts as token ids")
      return prompt, tuple(self.tokenizer.encode(prompt))
    return None, tuple(int(t) for t in prompt)

  def _params(self, params: SamplingParams | None, ignore_eos: bool) -> SamplingParams:
    if params is None:
      params = SamplingParams(seed=None)
    if not isinstance(params, SamplingParams):
      raise TypeError(f"params={params!r} must be a jaxkv.serve.SamplingParams (or None)")
    if ignore_eos:
      return params
    extra = tuple(t for t in self.eos_ids if t not in params.stop_tokens)
    return dataclasses.replace(params, stop_tokens=params.stop_tokens + extra)

  def _per_prompt(self, params, count: int, ignore_eos: bool) -> list[SamplingParams]:
    if isinstance(params, (list, tuple)):
      if len(params) != count:
        raise ValueError(f"params has {len(params)} entries for {count} prompts")
      return [self._params(p, ignore_eos) for p in params]
    return [self._params(params, ignore_eos)] * count

  def _text(self, tokens: Sequence[int], finish_reason: str | None) -> str:
    """The text of a finished sample, as `stream` would deliver it."""
    if self.tokenizer is None:
      return ""
    kept = list(tokens[:-1]) if finish_reason == "stop" else list(tokens)
    s = TextStream(self.tokenizer)
    return s.push(kept) + s.finish()

  # ------------------------------------------------------------------ public API

  def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
               *, ignore_eos: bool = False) -> list[RequestOutput]:
    """Generates for every prompt; returns one `RequestOutput` per prompt, in order.

    Args:
      prompts: a str, a list of token ids, or a list of those.
      params: one `SamplingParams` for all prompts, one per prompt, or None
        (greedy, 16 tokens, a random seed).
      ignore_eos: do not stop at the checkpoint's eos ids.

    Raises:
      TypeError, ValueError: a malformed prompt or parameters, or a request the
        engine cannot hold (nothing is served then).
    """
    prompts = _prompts(prompts)
    return self._generate([self._encode(p) for p in prompts],
                          self._per_prompt(params, len(prompts), ignore_eos))

  def _generate(self, encoded, params) -> list[RequestOutput]:
    requests = [Request(ids, p, request_id=i) for i, ((_, ids), p) in
                enumerate(zip(encoded, params))]
    completions = self.engine.run(requests, admission="fcfs")
    outputs = [RequestOutput(i, text, list(ids), []) for i, (text, ids) in enumerate(encoded)]
    for c in completions:
      outputs[c.request_id].outputs.append(CompletionOutput(
          c.index, self._text(c.tokens, c.finish_reason), list(c.tokens), c.finish_reason,
          c.seed, c.timing, c.logprobs))
    return outputs

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
    return self._generate(encoded, self._per_prompt(params, len(encoded), ignore_eos))

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
    p = self._params(params, ignore_eos)
    if p.n != 1:
      raise ValueError(f"stream: n={p.n} must be 1 (use generate for several samples)")
    rid = self.engine.add_request(Request(ids, p, request_id=f"stream-{time.monotonic_ns()}"))
    text = TextStream(self.tokenizer)
    finished = False
    try:
      while not finished:
        for delta in self.engine.step(steps):
          if delta.request_id != rid:
            continue
          tokens = list(delta.tokens)
          if delta.finish_reason == "stop":
            tokens = tokens[:-1]   # the stop token's text is left out, as in generate
          out = text.push(tokens)
          if delta.finish_reason is not None:
            finished = True
            out += text.finish()
          if out:
            yield out
    finally:
      if not finished:
        self.engine.abort(rid)
        while self.engine.has_unfinished():
          self.engine.step(steps)


def _dtype_arg(name: str, value):
  """A dtype argument: "auto", a dtype name jax.numpy knows, or a dtype."""
  if isinstance(value, str) and value != "auto":
    import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
    if value not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"{name}={value!r} must be 'auto', 'float32', 'bfloat16' or 'float16'")
    return getattr(jnp, value)
  return value


__all__ = ["LLM", "CompletionOutput", "RequestOutput"]
