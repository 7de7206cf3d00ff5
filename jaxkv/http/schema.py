"""Request bodies of the OpenAI-compatible endpoints, and their translation into sampling params.

Unknown fields are accepted (the app logs each name once), as vLLM accepts
them: clients send fields such as `store`, `metadata` or `reasoning_effort`
whose absence changes nothing here. OpenAI parameters whose meaning would
change the output if ignored are refused by name: `best_of != n`, `suffix`
and images. `response_format`, vLLM's `structured_outputs` and `guided_*` fields constrain
the output (`structured.py`), and `tools` with `tool_choice` call functions (`tools.py`);
`logit_bias` is OpenAI's and
`allowed_token_ids` vLLM's (at most `MAX_LOGIT_BIAS` tokens each). `echo` prepends
the prompt, and with `max_tokens: 0` returns it alone; with `logprobs` the
prompt's tokens come with theirs (`PromptScorer`). Logprobs
(`logprobs: n` on completions; `logprobs: true` and `top_logprobs: n` on
chat), `presence_penalty` and `frequency_penalty` are OpenAI's; `top_k`,
`min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos` and
`min_tokens` (no stop token or stop string before it) are vLLM's. Ranges are checked by
`SamplingParams` (vLLM's), the logprob count against the engine's
`max_logprobs`; either refusal is a 400 naming the field.

Types are strict, as OpenAI's are: `"5"` or `true` is not an integer and
`"yes"` is not a boolean. Every refusal a request body alone decides is a
validation error located at its field, so the 400's `param` names it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator,
                      model_validator)
from pydantic import ValidationInfo

from jaxkv.http.structured import FIELDS as CONSTRAINT_FIELDS
from jaxkv.http.tools import message_for_template
from jaxkv.serve.requests import SamplingParams

# Strict numbers: JSON numbers only (an int is a float; a bool or a string is neither).
Float = Annotated[float, Field(strict=True)]
Int = StrictInt


def _sampling_check(name: str, value):
  """`value` if `SamplingParams` accepts it as `name` (its own ranges), else ValueError."""
  SamplingParams(**{name: value})
  return value


# OpenAI parameters this server cannot honour: refused when set (truthy), with these messages.
_REFUSED = {
    "suffix": "suffix is not supported",
}


# Fields outside the schema that change nothing whatever their value: accepted. Any other field
# a request sets is refused with 400 naming it (`unsupported_field`), never accepted and ignored.
_NO_EFFECT = {
    "metadata",             # tags for stored completions; nothing is stored
    "service_tier",         # one tier
}
# Known vLLM/OpenAI fields this server does not implement yet, and why (the rest: "unknown").
_NOT_YET = {
    "reasoning_effort": "reasoning_effort is not supported (the model's template decides)",
    "store": "store=true is not supported: this server does not store completions",
}


def unsupported_field(extra: dict) -> tuple[str, str] | None:
  """`(field, message)` of the first field of `extra` (a request's fields outside the schema)
  that this server would otherwise ignore, or None."""
  for name in sorted(extra):
    if name in _NO_EFFECT or name in CONSTRAINT_FIELDS or (name == "store" and not extra[name]):
      continue
    return name, _NOT_YET.get(name, f"{name} is not a field this server knows")
  return None


def _refuse(name: str, refused: bool) -> None:
  if refused:
    raise ValueError(_REFUSED[name])


def _refuse_if_set(v, info: ValidationInfo):
  """`v`, unless it sets a parameter of `_REFUSED` (ValueError with its message)."""
  _refuse(info.field_name, bool(v))
  return v


def _strings(value, name: str) -> list[str]:
  """`stop`: a string, a list of non-empty strings or null, as a list."""
  if value is None:
    return []
  values = [value] if isinstance(value, str) else value
  if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
    raise ValueError(f"{name} must be a string or a list of strings")
  if not all(values):
    raise ValueError(f"{name} must not hold an empty string")
  return values


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid")
  include_usage: StrictBool = False
  continuous_usage_stats: StrictBool = False


class _Common(BaseModel):
  model_config = ConfigDict(extra="allow")

  model: str | None = None
  max_tokens: Int | None = Field(default=None, ge=1)
  max_completion_tokens: Int | None = Field(default=None, ge=1)
  temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
  top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
  top_k: Int = Field(default=0, ge=-1)
  n: Int = Field(default=1, ge=1)
  stream: StrictBool = False
  stream_options: StreamOptions | None = None
  stop: Any = None
  stop_token_ids: list[Int] | None = None
  ignore_eos: StrictBool = False
  seed: Int | None = Field(default=None, ge=0, lt=2**31)
  user: str | None = None
  presence_penalty: Float = 0.0
  frequency_penalty: Float = 0.0
  repetition_penalty: Float = 1.0
  min_p: Float = 0.0
  logit_bias: dict | None = None
  min_tokens: Int = Field(default=0, ge=0)
  include_stop_str_in_output: StrictBool = False
  return_tokens_as_token_ids: StrictBool = False
  skip_special_tokens: StrictBool = True
  prompt_logprobs: Int | None = Field(default=None, ge=0)   # vLLM's: the prompt tokens' top n
  allowed_token_ids: list[Int] | None = None   # vLLM's: only these may be drawn
  response_format: dict | None = None   # read by `structured.constraint_of`

  @field_validator("stop", mode="plain")
  @classmethod
  def _stop_list(cls, v):
    return _strings(v, "stop")

  @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
  @classmethod
  def _in_sampling_range(cls, v, info: ValidationInfo):
    return _sampling_check(info.field_name, v)

  @field_validator("stop_token_ids")
  @classmethod
  def _stop_ids(cls, v):
    return v if v is None else list(_sampling_check("stop_tokens", tuple(v)))

  @field_validator("allowed_token_ids")
  @classmethod
  def _allowed(cls, v):
    return v if v is None else list(_sampling_check("allowed_token_ids", tuple(v)))

  @field_validator("logit_bias", mode="plain")
  @classmethod
  def _bias(cls, v):
    """OpenAI's `{"token id": bias}`: as `{int: float}`, checked as `SamplingParams` checks it."""
    if v is None:
      return None
    if not isinstance(v, dict) or not all(isinstance(k, str) and k.strip().lstrip("-").isdigit()
                                          for k in v):
      raise ValueError("logit_bias must map token ids (as strings) to numbers")
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in v.values()):
      raise ValueError("logit_bias must map token ids (as strings) to numbers")
    bias = {int(k): b for k, b in v.items()}
    return dict(_sampling_check("logit_bias", bias))

  def num_logprobs(self) -> int | None:
    """Top logprobs per token the request asks for (None: no logprobs)."""
    raise NotImplementedError

  def output_limit(self) -> tuple[int | None, str]:
    """`(most tokens to generate or None: up to max_len, the field that set it)`:
    `max_completion_tokens` wins over `max_tokens` (OpenAI's newer name)."""
    if self.max_completion_tokens is not None:
      return self.max_completion_tokens, "max_completion_tokens"
    return self.max_tokens, "max_tokens"

  @field_validator("response_format")
  @classmethod
  def _format(cls, v):
    if v is not None and not isinstance(v.get("type"), str):
      raise ValueError("response_format needs a type (text, json_object or json_schema)")
    return v

  def sampling(self, *, max_tokens: int, stop_ids: tuple[int, ...],
               grammar=None) -> SamplingParams:
    ids = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else stop_ids)
    return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                          top_k=max(self.top_k, 0), top_p=self.top_p, seed=self.seed,
                          stop_tokens=tuple(dict.fromkeys(ids)), n=self.n, min_p=self.min_p,
                          repetition_penalty=self.repetition_penalty,
                          presence_penalty=self.presence_penalty,
                          frequency_penalty=self.frequency_penalty,
                          logprobs=self.num_logprobs(), min_tokens=self.min_tokens,
                          logit_bias=self.logit_bias or (),
                          allowed_token_ids=self.allowed_token_ids, grammar=grammar)


class CompletionRequest(_Common):
  max_tokens: Int | None = Field(default=16, ge=0)   # 0: with echo, the prompt alone
  prompt: Any
  echo: StrictBool = False
  suffix: str | None = None
  best_of: Int | None = None
  logprobs: Int | None = Field(default=None, ge=0)

  @field_validator("prompt", mode="plain")
  @classmethod
  def _prompt(cls, v):
    """A string, a list of strings, a list of token ids or a list of such lists."""
    def ids(x):
      return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    if not (isinstance(v, str) or ids(v) or (isinstance(v, list) and (
        all(isinstance(x, str) for x in v) or all(ids(x) for x in v)))):
      raise ValueError("prompt must be a string, a list of strings, a list of token ids or a "
                       "list of token id lists")
    if not isinstance(v, str) and v and not isinstance(v[0], str):   # token ids
      for x in (v if isinstance(v[0], list) else [v]):
        if x and min(x) < 0:
          raise ValueError(f"prompt token ids must be >= 0; got {min(x)}")
    return v

  _refused_here = field_validator("suffix")(_refuse_if_set)

  @field_validator("best_of")
  @classmethod
  def _best_of_is_n(cls, v, info: ValidationInfo):
    if v is not None and v != info.data.get("n"):
      raise ValueError(f"best_of={v} is not supported (only best_of == n)")
    return v

  def num_logprobs(self) -> int | None:
    return self.logprobs


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
    return message_for_template(out)


class ChatRequest(_Common):
  messages: list[ChatMessage] = Field(min_length=1)
  add_generation_prompt: StrictBool = True
  chat_template_kwargs: dict[str, Any] | None = None   # passed to the template (enable_thinking)
  tools: list | None = None          # checked by `tools.tools_of`
  tool_choice: Union[str, dict, None] = None
  parallel_tool_calls: StrictBool = True
  logprobs: StrictBool = False
  top_logprobs: Int | None = Field(default=None, ge=0)

  @field_validator("chat_template_kwargs")
  @classmethod
  def _template_variables(cls, v):
    taken = sorted(set(v or ()) & {"messages", "add_generation_prompt", "chat_template", "tools",
                                   "documents"})
    if taken:
      raise ValueError(f"{taken[0]!r} is set by the request itself, not by chat_template_kwargs")
    return v

  @field_validator("top_logprobs")
  @classmethod
  def _needs_logprobs(cls, v, info: ValidationInfo):
    if v is not None and not info.data.get("logprobs"):
      raise ValueError("top_logprobs needs logprobs=true")
    return v

  def num_logprobs(self) -> int | None:
    return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
  """`/tokenize` (vLLM's): a `prompt` text, or chat `messages` through the template."""
  model_config = ConfigDict(extra="allow")
  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  tools: list | None = None   # with messages: passed to the template, as chat completions do
  add_special_tokens: StrictBool = True
  add_generation_prompt: StrictBool = True

  @model_validator(mode="after")
  def _one_of(self):
    if (self.prompt is None) == (self.messages is None):
      raise ValueError("give exactly one of prompt and messages")
    return self


class DetokenizeRequest(BaseModel):
  """`/detokenize` (vLLM's): token ids back to text."""
  model_config = ConfigDict(extra="allow")
  model: str | None = None
  tokens: list[Annotated[StrictInt, Field(ge=0)]]
