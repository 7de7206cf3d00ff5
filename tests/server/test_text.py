"""Text I/O: checkpoint tokenizer files, chat templates, stable streaming text, stop strings."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="text I/O needs the tokenizers package")
pytest.importorskip("jinja2", reason="chat templates need jinja2 (the serve extra)")

from jaxkv.tokenizer import TextStream, Tokenizer  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf_llama")
TEXT = "héllo wörld, 你好! The naïve café — déjà vu. 🙂 ok"


@pytest.fixture(scope="module")
def byte_level():
  """A byte-level BPE: non-ASCII characters span several tokens (split UTF-8 sequences)."""
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["hello world the cafe"] * 5, trainer=trainer)
  return Tokenizer(tok)


def _stream(tok, ids, stop=(), chunk=1):
  s = TextStream(tok, stop)
  parts = [s.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
  parts.append(s.finish())
  return parts, s


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_is_stable_and_complete(byte_level, chunk):
  ids = byte_level.encode(TEXT)
  assert len(ids) > len(TEXT) // 2 and byte_level.decode(ids) == TEXT
  parts, _ = _stream(byte_level, ids, chunk=chunk)
  assert "".join(parts) == TEXT
  assert not any("\ufffd" in p for p in parts)   # never half a character


def test_metaspace_spaces_survive_streaming():
  tok = Tokenizer.from_checkpoint(FIXTURE)
  text = "The quick brown fox jumps over the lazy dog."
  ids = tok.encode(text)
  assert "".join(_stream(tok, ids)[0]) == tok.decode(ids) == text


def test_stop_strings_cut_the_text_and_never_leak(byte_level, rng):
  ids = byte_level.encode(TEXT)
  for _ in range(20):
    start = int(rng.integers(0, len(TEXT) - 4))
    stop = TEXT[start:start + int(rng.integers(1, 5))]
    want = TEXT[:TEXT.index(stop)]
    parts, s = _stream(byte_level, ids, stop=["zzz", stop], chunk=int(rng.integers(1, 4)))
    assert "".join(parts) == want and s.stopped, stop
  parts, s = _stream(byte_level, ids, stop=["absent"])
  assert "".join(parts) == TEXT and not s.stopped


def test_checkpoint_files_and_chat_template(tmp_path):
  tok = Tokenizer.from_checkpoint(FIXTURE)
  assert tok.eos_ids == (2, 7) and tok.vocab_size == 128
  messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
  assert tok.render_chat(messages) == "<s><|system|>S<|end|><|user|>Hi<|end|><|assistant|>"
  assert tok.render_chat(messages, add_generation_prompt=False).endswith("Hi<|end|>")
  ids = tok.encode_chat(messages)
  assert ids[:2] == [1, 4] and ids.count(1) == 1   # bos from the template, not added twice
  with pytest.raises(ValueError, match="unknown role: tool"):
    tok.render_chat([{"role": "tool", "content": "x"}])

  # No generation_config.json: the eos token's id; a named template list and transformers'
  # block-whitespace rules (trim_blocks, lstrip_blocks) and tojson without ASCII escapes.
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(FIXTURE, name), tmp_path / name)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = [
      {"name": "other", "template": "wrong"},
      {"name": "default", "template": "{% for m in messages %}\n{{ m['content'] | tojson }}\n"
                                      "    {% endfor %}{{ eos_token }}"}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tok = Tokenizer.from_checkpoint(str(tmp_path))
  assert tok.eos_ids == (2,)
  assert tok.render_chat([{"role": "user", "content": "é"}]) == '"é"\n</s>'


def test_bad_checkpoint_files_are_named(tmp_path):
  with pytest.raises(ValueError, match="tokenizer.json does not exist"):
    Tokenizer.from_checkpoint(str(tmp_path))
  shutil.copy(os.path.join(FIXTURE, "tokenizer.json"), tmp_path / "tokenizer.json")
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": "two"}')
  with pytest.raises(ValueError, match="eos_token_id='two'"):
    Tokenizer.from_checkpoint(str(tmp_path))
  (tmp_path / "generation_config.json").write_text("{")
  with pytest.raises(ValueError, match="not readable JSON"):
    Tokenizer.from_checkpoint(str(tmp_path))
  with pytest.raises(ValueError, match="no chat_template"):
    Tokenizer(Tokenizer.from_checkpoint(FIXTURE).tokenizer).render_chat([])
  assert np.array_equal(Tokenizer.from_checkpoint(FIXTURE).encode("a", add_special_tokens=False),
                        [tokenizers.Tokenizer.from_file(os.path.join(FIXTURE, "tokenizer.json"))
                         .token_to_id("\u2581a")])


def _trained(model, pre=None, normalizer=None, trainer=None):
  from tokenizers import pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(model)
  if pre is not None:
    tok.pre_tokenizer = pre
  if normalizer is not None:
    tok.normalizer = normalizer
  trainer = trainer or trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TEXT, "the quick brown fox jumps over the lazy dog " * 20] * 5,
                          trainer=trainer)
  return Tokenizer(tok)


def _bounded_tokenizers():
  from tokenizers import models, normalizers, pre_tokenizers, trainers
  out = {"hf_llama": Tokenizer.from_checkpoint(FIXTURE)}
  out["byte_level"] = _trained(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=True))
  out["whitespace"] = _trained(models.BPE(unk_token="[UNK]"), pre_tokenizers.Whitespace(),
                               trainer=trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                           special_tokens=["[UNK]"]))
  out["nfkc_split"] = _trained(
      models.BPE(), pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "isolated"),
                                             pre_tokenizers.ByteLevel(add_prefix_space=False)]),
      normalizers.NFKC())
  return out


def _random_text(rng, size):
  alphabet = list("abc xyz  \n\t.,!?") + list("éüß你好🙂ﬁ①—") + ["the ", "<s>", "</s>", "  "]
  return "".join(rng.choice(alphabet, size=size))


def test_min_tokens_never_exceeds_the_tokenisation(rng):
  """`Tokenizer.min_tokens` is a lower bound: checked against the tokenizers library itself on
  random text (spaces, tabs, CJK, emoji, ligatures NFKC rewrites, special tokens' text)."""
  for name, tok in _bounded_tokenizers().items():
    assert tok.min_tokens("a" * 10_000) > 0, name   # these pipelines do give a bound
    for size in (0, 1, 7, 300, 5000):
      text = _random_text(rng, size)
      assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False)), (name, text)


def test_no_bound_where_text_can_vanish_into_one_token():
  """WordLevel and WordPiece map a whole (unknown) word to one token, and a splitter may remove
  what it matches: no bound, so no legal prompt is ever refused by it."""
  from tokenizers import models, pre_tokenizers, trainers
  word_level = _trained(models.WordLevel(unk_token="[UNK]"), pre_tokenizers.WhitespaceSplit(),
                        trainer=trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
  word_piece = _trained(models.WordPiece(unk_token="[UNK]"), pre_tokenizers.Whitespace(),
                        trainer=trainers.WordPieceTrainer(special_tokens=["[UNK]"]))
  removing = _trained(models.BPE(), pre_tokenizers.Split("x", "removed"))
  for tok in (word_level, word_piece, removing):
    assert tok.min_tokens("x" * 100_000) == 0
    assert tok.encode("x" * 100_000, max_tokens=10) is not None   # tokenised, not refused


def test_a_long_text_is_refused_before_tokenising():
  tok = Tokenizer.from_checkpoint(FIXTURE)
  text = "hello world " * 100_000
  with pytest.raises(ValueError, match="at least .* tokens long"):
    tok.encode(text, max_tokens=1000)
  ids = tok.encode(text[:20_000], max_tokens=100_000)   # short texts are tokenised as before
  assert ids == tok.encode(text[:20_000])


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_stop_string_within_the_first_min_tokens_does_not_count(byte_level, chunk):
  """vLLM's `min_tokens`: a stop string ending in the first `min_tokens` tokens' text is text;
  the first one ending past it stops the sample, whether pushed a token or a few at a time."""
  text = "hello world the cafe hello world"
  ids = byte_level.encode(text)
  upto = lambda k: len(byte_level.decode(ids[:k]))
  first = next(k for k in range(len(ids) + 1) if upto(k) >= len("hello wo"))   # past "wo"
  for min_tokens, want in ((0, "hello "), (first, "hello world the cafe hello ")):
    s = TextStream(byte_level, ["wo"], min_tokens=min_tokens)
    out = "".join(s.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + s.finish()
    assert out == want and s.stopped, (min_tokens, out)
  s = TextStream(byte_level, ["wo"], min_tokens=len(ids))   # never past it: no stop at all
  out = "".join(s.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + s.finish()
  assert out == text and not s.stopped
