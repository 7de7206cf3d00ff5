"""Text and chat I/O of a checkpoint: tokenizer, chat templates, stop ids, streaming detokenisation.

Used by `jaxkv.LLM` and the server (`jaxkv serve`).

- `Tokenizer.from_checkpoint(dir)`: `tokenizer.json` (the `tokenizers`
  package), `tokenizer_config.json` (special tokens, `chat_template`),
  `special_tokens_map.json` (special tokens the config lacks), the chat
  template files and `generation_config.json` (its `eos_token_id`, one id or a
  list: the default stop ids), all as Hugging Face writes them.
- Chat templates are found as `transformers` finds them: `chat_template.jinja`
  and `additional_chat_templates/<name>.jinja` replace the config's
  `chat_template` key when present (one file alone is the template; with
  others they form a named set whose `chat_template.jinja` is "default"); a
  config key holding a list of `{"name", "template"}` is a named set too. Of a
  named set, `render_chat` uses the one asked for by name, else "tool_use"
  when tools are given and it exists, else "default".
- They are rendered as `transformers` renders them (a sandboxed jinja2
  environment with `trim_blocks`/`lstrip_blocks`, `loopcontrols`, the
  `{% generation %}` block, `raise_exception`, `strftime_now` and a `tojson`
  that keeps non-ASCII), with `messages`, `tools`, `documents`,
  `add_generation_prompt`, the special tokens and any extra keyword as
  variables; the rendered text is encoded without adding special tokens (the
  template holds them).
- `TextStream` turns a sample's tokens into text deltas: only text that is
  stable (a byte sequence split over tokens decodes to U+FFFD until it is
  complete; a decoder may rewrite a token's text once the next arrives, as
  Metaspace does with a leading space) and that cannot be the start of a stop
  string is emitted; a stop string ends the text, trimmed.

`tokenizers` and `jinja2` come with the serve extra (`pip install "jaxkv[serve]"`);
a missing one raises ImportError saying so.
"""

from __future__ import annotations

import datetime
import json
import os
import re

from jaxkv import _optional

CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_TEMPLATES_DIR = "additional_chat_templates"
# Text past this many characters is encoded through `encode_batch`, which releases the GIL.
_LONG_TEXT = 1 << 16


_WHITESPACE = re.compile(r"\s+")
# Pre-tokenisers that keep every byte of their input, and those that drop whitespace only.
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
_DROPPING_WHITESPACE = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}


def _token_bound(tokenizer) -> tuple[int, bool] | None:
  """`(most normalised bytes one token stands for, whether whitespace is dropped)`, or None
  where `Tokenizer.min_tokens` can give no bound (see there)."""
  try:
    spec = json.loads(tokenizer.to_str())
  except Exception:   # pylint: disable=broad-except  (a tokenizer that cannot describe itself)
    return None
  if spec.get("truncation") is not None:
    return None
  model = spec.get("model") or {}
  kind = model.get("type")
  if kind == "BPE":
    if model.get("fuse_unk") and not model.get("byte_fallback") and model.get("unk_token"):
      return None   # a run of unknown characters, however long, is one token
  elif not (kind == "Unigram" and model.get("byte_fallback")):
    return None
  drops = [False]

  def keeps(pre) -> bool:
    if pre is None:
      return True
    t = pre.get("type")
    if t == "Sequence":
      return all(keeps(p) for p in pre.get("pretokenizers", []))
    if t in _DROPPING_WHITESPACE:
      drops[0] = True
      return True
    return t in _KEEPING and str(pre.get("behavior", "")).lower() != "removed"

  if not keeps(spec.get("pre_tokenizer")):
    return None
  vocab = model.get("vocab") or {}
  pieces = [p[0] for p in vocab] if isinstance(vocab, list) else list(vocab)   # Unigram: pairs
  added = [a.get("content", "") for a in spec.get("added_tokens") or []]
  normalizer = tokenizer.normalizer
  if normalizer is not None:   # an added token's text may grow when normalised
    added += [normalizer.normalize_str(a) for a in added]
  longest = max((len(p.encode("utf-8", "surrogatepass")) for p in pieces + added), default=0)
  return max(longest, 4), drops[0]   # at least one whole character a token


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


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not a readable UTF-8 template: {e}") from e


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


def read_chat_templates(checkpoint: str, config: dict) -> str | dict[str, str] | None:
  """The checkpoint's chat template(s), found as `transformers` finds them (module docstring).

  Returns:
    One template, a `{name: template}` dict, or None.

  Raises:
    ValueError: an unreadable template file, or a malformed `chat_template` key.
  """
  files = {}
  path = os.path.join(checkpoint, CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    files["default"] = _read_text(path)
  extra = os.path.join(checkpoint, ADDITIONAL_TEMPLATES_DIR)
  if os.path.isdir(extra):
    for name in sorted(os.listdir(extra)):
      if name.endswith(".jinja"):
        files[name[:-len(".jinja")]] = _read_text(os.path.join(extra, name))
  if files:
    return files["default"] if list(files) == ["default"] else files
  return _config_templates(config.get("chat_template"),
                           os.path.join(checkpoint, "tokenizer_config.json"))


def _config_templates(value, where: str) -> str | dict[str, str] | None:
  """tokenizer_config.json's `chat_template`: a string, or a list of named templates."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(
      isinstance(t, dict) and isinstance(t.get("name"), str)
      and isinstance(t.get("template"), str) for t in value):
    return {t["name"]: t["template"] for t in value}
  raise ValueError(f"{where}: chat_template must be a string or a list of "
                   "{\"name\": ..., \"template\": ...} objects")


def _compile(template: str):
  """`template` compiled in the environment `transformers` renders chat templates in."""
  jinja2 = _optional.require("jinja2", "rendering a chat template")
  from jinja2 import ext, nodes, sandbox   # pylint: disable=g-import-not-at-top

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers marks the
    assistant's tokens with it; the text is the same)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ValueError(f"the chat template is not valid jinja2: {e}") from e


class Tokenizer:
  """A checkpoint's tokenizer, chat templates and default stop ids.

  Args:
    tokenizer: a `tokenizers.Tokenizer`.
    config: the parsed `tokenizer_config.json` (may be empty).
    eos_ids: default stop ids (generation_config.json's, else the eos token's).
    chat_template: the template(s) (`read_chat_templates`); default the
      config's `chat_template` key.

  Attributes:
    chat_template: one template string, a `{name: template}` dict, or None.
    special: the special tokens' texts by name (`bos_token`, `eos_token`, ...),
      template variables.
    eos_ids: the default stop ids.
  """

  def __init__(self, tokenizer, config: dict | None = None, eos_ids: tuple[int, ...] = (),
               chat_template: str | dict[str, str] | None = None):
    self.tokenizer, self.config = tokenizer, dict(config or {})
    self.special = {k: _token_text(v) for k, v in self.config.items()
                    if k.endswith("_token") and _token_text(v) is not None}
    if chat_template is None:
      chat_template = _config_templates(self.config.get("chat_template"), "tokenizer_config")
    self.chat_template = chat_template
    if not eos_ids and self.special.get("eos_token") is not None:
      eos = tokenizer.token_to_id(self.special["eos_token"])
      eos_ids = () if eos is None else (eos,)
    self.eos_ids = tuple(eos_ids)
    self._compiled: dict[str, object] = {}
    self._bound = _token_bound(tokenizer)

  @classmethod
  def from_checkpoint(cls, checkpoint: str) -> Tokenizer:
    """Reads `tokenizer.json` (required), `tokenizer_config.json`, `special_tokens_map.json`,
    the chat template files and `generation_config.json`.

    Raises:
      ValueError: a missing tokenizer.json, or a file that is not valid.
      ImportError: the `tokenizers` package is missing (`pip install "jaxkv[serve]"`).
    """
    path = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(f"{path} does not exist: text needs the checkpoint's tokenizer")
    tokenizers = _optional.require("tokenizers", f"reading {path}")
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:   # pylint: disable=broad-except  (the library raises plain Exception)
      raise ValueError(f"{path}: not a tokenizers file: {e}") from e
    config = _read_json(os.path.join(checkpoint, "tokenizer_config.json"))
    for key, value in _read_json(os.path.join(checkpoint, "special_tokens_map.json")).items():
      config.setdefault(key, value)
    return cls(tok, config, generation_eos_ids(checkpoint),
               chat_template=read_chat_templates(checkpoint, config))

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def min_tokens(self, text: str) -> int:
    """A lower bound on `len(encode(text))`, found without tokenising (linear in the text).

    Each token stands for at most `B` bytes of the normalised text (`B`: the longest
    token's UTF-8 bytes, or an added token's), so a text of `n` such bytes is at least
    `n / B` tokens. That holds only where no step of the pipeline drops text or maps
    unbounded text to one token; for any other pipeline (WordPiece, WordLevel, a
    splitter that removes what it matches, fused unknowns, truncation) this is 0.
    Whitespace-splitting pre-tokenisers drop whitespace, which is then not counted.
    """
    if self._bound is None:
      return 0
    per_token, drops_whitespace = self._bound
    normalizer = self.tokenizer.normalizer
    if normalizer is not None:
      text = normalizer.normalize_str(text)
    n = len(text.encode("utf-8", "surrogatepass"))
    if drops_whitespace:
      n -= sum(len(w.encode("utf-8")) for w in _WHITESPACE.findall(text))
    return -(-n // per_token)

  def encode(self, text: str, *, add_special_tokens: bool = True,
             max_tokens: int | None = None) -> list[int]:
    """`text` as token ids.

    Args:
      max_tokens: refuse (ValueError) a long text that `min_tokens` shows to exceed this,
        before tokenising it: a prompt no sequence could hold costs a linear scan, not
        the whole tokenisation.
    """
    if len(text) > _LONG_TEXT:
      if max_tokens is not None and (least := self.min_tokens(text)) > max_tokens:
        raise ValueError(f"the text is at least {least} tokens long ({len(text)} characters); "
                         f"at most {max_tokens} fit")
      # `tokenizers` holds the GIL through `encode` but releases it in `encode_batch` (same
      # pipeline, same ids): a megabyte prompt then no longer stalls every other thread.
      return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
    return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
    return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def template(self, name: str | None = None, *, tools=None) -> str:
    """The template text `render_chat` uses (transformers' `get_chat_template` rules).

    Args:
      name: a template name of a named set, or None (the default; "tool_use"
        when `tools` are given and the set has one). A name that is not in the
        set is itself the template text, as in transformers.

    Raises:
      ValueError: no chat template, or a named set without "default" and no name.
    """
    templates = self.chat_template
    if isinstance(templates, dict):
      if name is not None:
        return templates.get(name, name)
      if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
      if "default" in templates:
        return templates["default"]
      raise ValueError(f"this checkpoint has several chat templates ({sorted(templates)}) and "
                       "none is named 'default': name one")
    if name is not None:
      return name
    if templates is None:
      raise ValueError("this checkpoint has no chat_template (tokenizer_config.json, "
                       f"{CHAT_TEMPLATE_FILE} or {ADDITIONAL_TEMPLATES_DIR}/)")
    return templates

  def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                  chat_template: str | None = None, tools=None, documents=None,
                  **kwargs) -> str:
    """The prompt text of `messages` through the chat template.

    Args:
      messages: `{"role": ..., "content": ...}` dicts.
      add_generation_prompt: end with the assistant's turn header.
      chat_template: a template name or text (`template`).
      tools, documents: passed to the template (None when not given).
      **kwargs: more template variables (e.g. `enable_thinking`).

    Raises:
      ValueError: no chat template, or the template refused the messages.
    """
    text = self.template(chat_template, tools=tools)
    if text not in self._compiled:
      self._compiled[text] = _compile(text)
    import jinja2   # pylint: disable=g-import-not-at-top  (loaded by _compile)
    variables = {**self.special, **kwargs}
    try:
      return self._compiled[text].render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"the chat template refused the messages: {e}") from e

  def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                  **kwargs) -> list[int]:
    """`render_chat`'s text as token ids (no special tokens added: the template holds them)."""
    return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                        **kwargs), add_special_tokens=False)


class TextStream:
  """One sample's text, emitted as it becomes stable, ended by a stop string.

  Args:
    tokenizer: the `Tokenizer`.
    stop: stop strings (the text ends before the first one found).
    include_stop: the stop string found ends the text, included in it.
    skip_special_tokens: leave special tokens' text out (`Tokenizer.decode`).
    min_tokens: a stop string ending within the first `min_tokens` tokens' text does not
      count (vLLM checks stop strings only past `min_tokens`).
  """

  def __init__(self, tokenizer: Tokenizer, stop=(), *, include_stop: bool = False,
               skip_special_tokens: bool = True, min_tokens: int = 0):
    self.tokenizer = tokenizer
    self.min_tokens = min_tokens
    self._floor = 0 if min_tokens == 0 else None   # text of the first min_tokens tokens
    self.stop = [s for s in stop if s]
    self.include_stop, self.skip = include_stop, skip_special_tokens
    self.hold = max((len(s) for s in self.stop), default=1) - 1
    self.ids: list[int] = []
    self.text = ""            # stable text so far (stop strings not yet cut)
    self.emitted = 0          # characters of `text` handed out
    self.stopped = False
    self._prefix, self._read = 0, 0   # token offsets: decoded context, read so far
    self._returned: int | None = None   # `tokens_returned` once stopped (nothing changes after)

  def _decode(self, ids) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

  def tokens_returned(self) -> int:
    """Tokens whose text was handed out: all of them, or, once a stop string ended the
    text, the fewest whose decoded text reaches its end (a token straddling the end counts)."""
    if not self.stopped:
      return len(self.ids)
    if self._returned is not None:
      return self._returned
    lo, hi = 0, len(self.ids)   # decoded length grows with the tokens: bisect
    while lo < hi:
      mid = (lo + hi) // 2
      if len(self._decode(self.ids[:mid])) >= self.emitted:
        hi = mid
      else:
        lo = mid + 1
    self._returned = lo
    return lo

  def push(self, tokens) -> str:
    """Adds tokens; returns the text newly safe to emit ('' once stopped)."""
    if self.stopped:
      return ""
    self.ids.extend(int(t) for t in tokens)
    # Decode a short window: the tokens since the last stable point, with the one
    # before as context, so a decoder's rewrite of a token's first character (e.g. a
    # Metaspace leading space) is seen in both decodes and cancels out.
    before = self._decode(self.ids[self._prefix:self._read])
    after = self._decode(self.ids[self._prefix:])
    if len(after) > len(before) and not after.endswith("\ufffd"):
      self.text += after[len(before):]
      self._prefix, self._read = self._read, len(self.ids)
    if self._floor is None and len(self.ids) >= self.min_tokens:
      self._floor = len(self._decode(self.ids[:self.min_tokens]))
    return self._release(final=False)

  def finish(self) -> str:
    """The sample ended: the rest of the text (a trailing incomplete character included)."""
    if self.stopped:
      return ""
    rest = self._decode(self.ids[self._prefix:])
    before = self._decode(self.ids[self._prefix:self._read])
    if len(rest) > len(before):
      self.text += rest[len(before):]
    return self._release(final=True)

  def _release(self, *, final: bool) -> str:
    start = max(self.emitted - self.hold, 0)   # a stop string may straddle the emitted end
    floor = self._floor
    hits = [] if floor is None else [   # each match ends past the first min_tokens' text
        (i, len(s)) for i, s in ((self.text.find(s, max(start, floor - len(s) + 1)), s)
                                 for s in self.stop) if i >= 0]
    if hits:
      at = min(i for i, _ in hits)   # the first stop string found
      size = max(n for i, n in hits if i == at)   # the longest of those starting there
      self.stopped, end = True, at + (size if self.include_stop else 0)
    else:
      end = len(self.text) if final else max(len(self.text) - self.hold, self.emitted)
    out = self.text[self.emitted:max(end, self.emitted)]
    self.emitted = max(end, self.emitted)
    return out
