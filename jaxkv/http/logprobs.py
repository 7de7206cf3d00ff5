"""OpenAI's logprobs shapes from the engine's `TokenLogprob`s.

- `/v1/completions` (`logprobs: n`): `{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}`, one entry per token; each `top_logprobs`
  entry maps token text to logprob for the `n` most likely tokens, plus the
  chosen one when it is not among them (as vLLM does).
- `/v1/chat/completions` (`logprobs: true`, `top_logprobs: n`):
  `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.

A token's text is its id decoded alone with special tokens kept (so a byte
of a multi-byte character shows as U+FFFD, as in vLLM), or `token_id:<id>`
with `return_tokens_as_token_ids` (vLLM's spelling, for tokens that do not
decode alone); `bytes` is that text's UTF-8. `text_offset` counts those
texts' characters from the start of the completion. Values are the model's raw log-probabilities (see
`SamplingParams.logprobs`); a `-inf` is reported as -9999.0 (OpenAI's
convention; JSON has no infinity).
"""

from __future__ import annotations

import math

_FLOOR = -9999.0


def _value(x: float) -> float:
  return x if math.isfinite(x) else _FLOOR


class LogprobFormatter:
  """Formats one sample's token logprobs, keeping its running text offset.

  Args:
    tokenizer: the server's `Tokenizer`.
    chat: chat shape (else the completions shape).
    as_ids: name tokens `token_id:<id>` instead of their text.
  """

  def __init__(self, tokenizer, *, chat: bool, as_ids: bool = False):
    self.tokenizer, self.chat, self.offset, self.as_ids = tokenizer, chat, 0, as_ids
    self._texts: dict[int, str] = {}

  def text(self, token: int) -> str:
    if self.as_ids:
      return f"token_id:{token}"
    if token not in self._texts:
      self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
    return self._texts[token]

  def format(self, entries) -> dict:
    """The logprobs object of `entries` (a sequence of `TokenLogprob`)."""
    if self.chat:
      item = lambda t, v: {"token": self.text(t), "logprob": _value(v),
                           "bytes": list(self.text(t).encode("utf-8"))}
      return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(t, v)
                                                                        for t, v in e.top]}
                          for e in entries]}
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
      text = self.text(e.token)
      out["tokens"].append(text)
      out["token_logprobs"].append(_value(e.logprob))
      top = {self.text(t): _value(v) for t, v in e.top}
      top.setdefault(text, _value(e.logprob))
      out["top_logprobs"].append(top)
      out["text_offset"].append(self.offset)
      self.offset += len(text)
    return out

  def format_prompt(self, first: int, entries) -> dict:
    """The completions logprobs object of an echoed prompt: its first token has no logprob
    (null, as OpenAI's), each later one its `PromptLogprob` (`entries`); the offsets go on
    from there for the generated tokens."""
    text = self.text(first)
    head = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None],
            "text_offset": [self.offset]}
    self.offset += len(text)
    return self.merge([head, self.format(entries)], chat=False)

  def prompt_logprobs(self, entries) -> list:
    """vLLM's `prompt_logprobs` of a prompt's `PromptLogprob`s: null for the first token,
    then per token `{token id: {"logprob", "rank", "decoded_token"}}` for it and the top n."""
    out: list = [None]
    for e in entries:
      ranked = {e.token: (e.logprob, e.rank)}
      for r, (t, v) in enumerate(e.top, 1):
        ranked.setdefault(t, (v, r))
      out.append({str(t): {"logprob": _value(v), "rank": r,
                           "decoded_token": self.tokenizer.decode([t], skip_special_tokens=False)}
                  for t, (v, r) in ranked.items()})
    return out

  @staticmethod
  def merge(parts: list[dict], *, chat: bool) -> dict:
    """One logprobs object from the per-delta ones of a sample, in order."""
    if chat:
      return {"content": [c for p in parts for c in p["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for p in parts for v in p[k]] for k in keys}
