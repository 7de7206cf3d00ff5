"""Request bodies of the OpenAI-compatible endpoints, and their translation into sampling params.

Unknown fields are refused (a typo must not pass silently), and so are
OpenAI parameters this server does not implement, by name: `logit_bias`,
`best_of != n`, `suffix`, `echo`, tools and response formats. Logprobs
(`logprobs: n` on completions; `logprobs: true` and `top_logprobs: n` on
chat), `presence_penalty` and `frequency_penalty` are OpenAI's; `top_k`,
`min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos` and
`min_tokens == 0` are accepted as vLLM accepts them. Ranges are checked by
`SamplingParams` (vLLM's), the logprob count against the engine's
`max_logprobs`; either refusal is a 400 naming the field.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from jaxkv.serve.requests import SamplingParams


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid")
  include_usage: bool = False
  continuous_usage_stats: bool = False


class _Common(BaseModel):
  model_config = ConfigDict(extra="forbid")

  model: str | None = None
  max_tokens: int | None = Field(default=None, ge=1)
  temperature: float = Field(default=1.0, ge=0.0, le=2.0)
  top_p: float = Field(default=1.0, gt=0.0, le=1.0)
  top_k: int = Field(default=0, ge=-1)
  n: int = Field(default=1, ge=1)
  stream: bool = False
  stream_options: StreamOptions | None = None
  stop: Union[str, list[str], None] = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  seed: int | None = Field(default=None, ge=0, lt=2**31)
  user: str | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_p: float = 0.0
  logit_bias: dict | None = None
  min_tokens: int = 0

  @field_validator("stop")
  @classmethod
  def _stop_list(cls, v):
    return [v] if isinstance(v, str) else (v or [])

  def unsupported(self) -> str | None:
    """The first parameter set to a value this server cannot honour, as an error message."""
    if self.logit_bias:
      return "logit_bias is not supported"
    if self.min_tokens:
      return "min_tokens is not supported (only 0)"
    return None

  def num_logprobs(self) -> int | None:
    """Top logprobs per token the request asks for (None: no logprobs)."""
    raise NotImplementedError

  def sampling(self, *, max_tokens: int, stop_ids: tuple[int, ...]) -> SamplingParams:
    ids = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else stop_ids)
    return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                          top_k=max(self.top_k, 0), top_p=self.top_p, seed=self.seed,
                          stop_tokens=tuple(dict.fromkeys(ids)), n=self.n, min_p=self.min_p,
                          repetition_penalty=self.repetition_penalty,
                          presence_penalty=self.presence_penalty,
                          frequency_penalty=self.frequency_penalty,
                          logprobs=self.num_logprobs())


class CompletionRequest(_Common):
  max_tokens: int | None = Field(default=16, ge=1)
  prompt: Union[str, list[str], list[int], list[list[int]]]
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None
  logprobs: StrictInt | None = Field(default=None, ge=0)

  def num_logprobs(self) -> int | None:
    return self.logprobs

  def unsupported(self) -> str | None:
    if self.echo:
      return "echo is not supported"
    if self.suffix:
      return "suffix is not supported"
    if self.best_of not in (None, self.n):
      return f"best_of={self.best_of} is not supported (only best_of == n)"
    return super().unsupported()


class TextPart(BaseModel):
  model_config = ConfigDict(extra="forbid")
  type: Literal["text"]
  text: str


class ChatMessage(BaseModel):
  model_config = ConfigDict(extra="allow")   # names, tool fields: passed to the template
  role: str
  content: Union[str, list[TextPart], None] = None

  def for_template(self) -> dict:
    out = self.model_dump(exclude_none=True)
    if isinstance(self.content, list):
      out["content"] = "".join(p.text for p in self.content)
    return out


class ChatRequest(_Common):
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(default=None, ge=1)
  add_generation_prompt: bool = True
  tools: list | None = None
  tool_choice: Union[str, dict, None] = None
  response_format: dict | None = None
  logprobs: StrictBool = False
  top_logprobs: StrictInt | None = Field(default=None, ge=0)

  def num_logprobs(self) -> int | None:
    return (self.top_logprobs or 0) if self.logprobs else None

  def unsupported(self) -> str | None:
    if self.tools or self.tool_choice not in (None, "none"):
      return "tools are not supported"
    if self.response_format and self.response_format.get("type") != "text":
      return "response_format is not supported (only text)"
    if self.top_logprobs is not None and not self.logprobs:
      return "top_logprobs needs logprobs=true"
    return super().unsupported()
