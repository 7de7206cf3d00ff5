"""Text and chat I/O of a checkpoint: tokenizer, chat template, stop ids, streaming detokenisation.

- `Tokenizer.from_checkpoint(dir)`: `tokenizer.json` (the `tokenizers`
  package), `tokenizer_config.json` (its `chat_template` and special tokens),
  `generation_config.json` (its `eos_token_id`, one id or a list: the default
  stop ids), all as Hugging Face writes them.
- Chat templates are rendered as `transformers` renders them (a sandboxed
  jinja2 environment with `trim_blocks`/`lstrip_blocks`, `loopcontrols`,
  `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII), with
  `messages`, `add_generation_prompt` and the special tokens as variables; the
  rendered text is encoded without adding special tokens (the template holds them).
- `TextStream` turns a sample's tokens into text deltas: only text that is
  stable (a byte sequence split over tokens decodes to U+FFFD until it is
  complete; a decoder may rewrite a token's text once the next arrives, as
  Metaspace does with a leading space) and that cannot be the start of a stop
  string is emitted; a stop string ends the text, trimmed.
"""

from __future__ import annotations

import datetime
import json
import os


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not readable JSON: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"{path}: must hold a JSON object")
  return data


def _ids(value, where: str) -> tuple[int, ...]:
  ids = value if isinstance(value, list) else [] if value is None else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f"{where}: eos_token_id={value!r} must be a token id or a list of them")
  return tuple(ids)


def generation_eos_ids(checkpoint: str) -> tuple[int, ...]:
  """The stop ids of `generation_config.json` (its `eos_token_id`, one id or a list); () without.

  `transformers`' `generate` stops at these, not at config.json's `eos_token_id`,
  when the file names them (instruct models often list several).

  Raises:
    ValueError: the file is not valid JSON, or an id is not a non-negative int.
  """
  path = os.path.join(checkpoint, "generation_config.json")
  return _ids(_read_json(path).get("eos_token_id"), path)


class Tokenizer:
  """A checkpoint's tokenizer, chat template and default stop ids.

  Args:
    tokenizer: a `tokenizers.Tokenizer`.
    config: the parsed `tokenizer_config.json` (may be empty).
    eos_ids: default stop ids (generation_config.json's, else the eos token's).
  """

  def __init__(self, tokenizer, config: dict | None = None, eos_ids: tuple[int, ...] = ()):
    self.tokenizer, self.config = tokenizer, dict(config or {})
    self.special = {k: _token_text(v) for k, v in self.config.items()
                    if k.endswith("_token") and _token_text(v) is not None}
    template = self.config.get("chat_template")
    if isinstance(template, list):   # named templates: the "default" one
      template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    self.chat_template: str | None = template
    if not eos_ids and self.special.get("eos_token") is not None:
      eos = tokenizer.token_to_id(self.special["eos_token"])
      eos_ids = () if eos is None else (eos,)
    self.eos_ids = tuple(eos_ids)
    self._template = None

  @classmethod
  def from_checkpoint(cls, checkpoint: str) -> Tokenizer:
    """Reads `tokenizer.json` (required), `tokenizer_config.json` and `generation_config.json`.

    Raises:
      ValueError: a missing tokenizer.json, or a file that is not valid.
      ImportError: the `tokenizers` package is missing (`pip install jaxkv[serve]`).
    """
    import tokenizers   # pylint: disable=g-import-not-at-top
    path = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(f"{path} does not exist: the server needs the checkpoint's tokenizer")
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:   # pylint: disable=broad-except  (the library raises plain Exception)
      raise ValueError(f"{path}: not a tokenizers file: {e}") from e
    config = _read_json(os.path.join(checkpoint, "tokenizer_config.json"))
    return cls(tok, config, generation_eos_ids(checkpoint))

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` through the chat template.

    Raises:
      ValueError: no chat template, or the template refused the messages.
    """
    if self.chat_template is None:
      raise ValueError("this checkpoint's tokenizer_config.json has no chat_template")
    import jinja2   # pylint: disable=g-import-not-at-top
    from jinja2 import sandbox   # pylint: disable=g-import-not-at-top
    if self._template is None:
      env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])

      def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

      def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

      env.filters["tojson"] = tojson
      env.globals["raise_exception"] = raise_exception
      env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
      self._template = env.from_string(self.chat_template)
    try:
      return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **self.special)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"the chat template refused the messages: {e}") from e

  def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
    return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt),
                       add_special_tokens=False)


class TextStream:
  """One sample's text, emitted as it becomes stable, ended by a stop string.

  Args:
    tokenizer: the `Tokenizer`.
    stop: stop strings (the text ends before the first one found; it is not
      part of the text).
  """

  def __init__(self, tokenizer: Tokenizer, stop=()):
    self.tokenizer = tokenizer
    self.stop = [s for s in stop if s]
    self.hold = max((len(s) for s in self.stop), default=1) - 1
    self.ids: list[int] = []
    self.text = ""            # stable text so far (stop strings not yet cut)
    self.emitted = 0          # characters of `text` handed out
    self.stopped = False
    self._prefix, self._read = 0, 0   # token offsets: decoded context, read so far

  def push(self, tokens) -> str:
    """Adds tokens; returns the text newly safe to emit ('' once stopped)."""
    if self.stopped:
      return ""
    self.ids.extend(int(t) for t in tokens)
    # Decode a short window: the tokens since the last stable point, with the one
    # before as context, so a decoder's rewrite of a token's first character (e.g. a
    # Metaspace leading space) is seen in both decodes and cancels out.
    before = self.tokenizer.decode(self.ids[self._prefix:self._read])
    after = self.tokenizer.decode(self.ids[self._prefix:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
      self.text += after[len(before):]
      self._prefix, self._read = self._read, len(self.ids)
    return self._release(final=False)

  def finish(self) -> str:
    """The sample ended: the rest of the text (a trailing incomplete character included)."""
    if self.stopped:
      return ""
    rest = self.tokenizer.decode(self.ids[self._prefix:])
    before = self.tokenizer.decode(self.ids[self._prefix:self._read])
    if len(rest) > len(before):
      self.text += rest[len(before):]
    return self._release(final=True)

  def _release(self, *, final: bool) -> str:
    start = max(self.emitted - self.hold, 0)   # a stop string may straddle the emitted end
    hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
    if hits:
      self.stopped, end = True, min(hits)
    else:
      end = len(self.text) if final else max(len(self.text) - self.hold, self.emitted)
    out = self.text[self.emitted:max(end, self.emitted)]
    self.emitted = max(end, self.emitted)
    return out
