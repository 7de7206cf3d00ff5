"""Each token id's bytes: what a grammar over text needs to know of a tokenizer.

A grammar constrains text; the sampler picks token ids. The bridge is the exact bytes each id
adds to the text when decoded after other tokens, read from the tokenizer's model vocabulary
and decoder (not by decoding ids one at a time, which loses the leading spaces of Metaspace
tokens and splits multi-byte characters of byte-level ones into replacement characters).
Special tokens map to None: a grammar never allows them (the request's stop tokens end a
finished grammar instead).
"""

from __future__ import annotations

import json
import re

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
  """GPT-2's byte-to-unicode map, inverted: the printable stand-in of each byte -> the byte."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def _decoders(spec: dict | None) -> list[dict]:
  if not spec:
    return []
  if spec.get("type") == "Sequence":
    return [d for s in spec.get("decoders", []) for d in _decoders(s)]
  return [spec]


def token_bytes(tokenizer) -> list[bytes | None]:
  """The bytes of every token id of a `tokenizers.Tokenizer` (or a `jaxkv.tokenizer.Tokenizer`).

  Supports the decoders of the checkpoints jaxkv loads: byte-level BPE (GPT-2, Llama 3,
  Qwen), Metaspace with or without byte fallback (SentencePiece-converted: Llama 2, Mistral,
  Gemma), and word-level vocabularies split on whitespace (each word after a space).

  Raises:
    ValueError: a decoder this mapping does not know (named), so a grammar is never
      compiled against guessed bytes.
  """
  tok = getattr(tokenizer, "tokenizer", tokenizer)
  spec = json.loads(tok.to_str())
  size = tok.get_vocab_size(with_added_tokens=True)
  special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
  kinds = [d.get("type") for d in _decoders(spec.get("decoder"))]
  model = spec.get("model", {}).get("type")
  vocab = tok.get_vocab(with_added_tokens=True)
  out: list[bytes | None] = [None] * size
  if "ByteLevel" in kinds:
    table = _byte_level_table()
    for text, i in vocab.items():
      if i in special or i >= size:
        continue
      try:
        out[i] = bytes(table[c] for c in text)
      except KeyError:   # an added non-special token kept as plain text
        out[i] = text.encode()
    return out
  metaspace = next((d for d in _decoders(spec.get("decoder"))
                    if d.get("type") in ("Metaspace", "Replace")), None)
  if metaspace is not None or model == "WordLevel":
    space = "\u2581"
    if metaspace is not None and metaspace.get("type") == "Replace":
      space = metaspace.get("pattern", {}).get("String", space)
    elif metaspace is not None:
      space = metaspace.get("replacement", space)
    fallback = "ByteFallback" in kinds or spec.get("model", {}).get("byte_fallback")
    for text, i in vocab.items():
      if i in special or i >= size:
        continue
      m = _BYTE_FALLBACK.match(text) if fallback else None
      if m is not None:
        out[i] = bytes([int(m.group(1), 16)])
      elif model == "WordLevel":
        out[i] = (" " + text).encode()
      else:
        out[i] = text.replace(space, " ").encode()
    return out
  raise ValueError(f"structured output: the tokenizer's decoder {kinds or model!r} is not one "
                   "whose token bytes jaxkv can read (byte-level, Metaspace or word-level)")


def model_token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
  """`token_bytes` sized to a model of `vocab_size` logits: ids the tokenizer lacks (a model's
  padded rows) are None (never allowed by a text grammar); ids past the model are dropped
  (never sampled)."""
  out = token_bytes(tokenizer)[:vocab_size]
  return out + [None] * (vocab_size - len(out))
