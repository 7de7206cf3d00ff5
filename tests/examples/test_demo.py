"""`python -m jaxkv.demo`: flags, output and the optional greedy check."""

from __future__ import annotations

import pathlib
import re

import pytest

from jaxkv import demo


def test_demo_serves_and_checks(capsys):
  code = demo.main(["--requests", "3", "--max-tokens", "5", "--layers", "3", "--prompt-max",
                    "20", "--max-write", "8", "--window", "4", "--initial-capacity", "16",
                    "--check"])
  out = capsys.readouterr().out
  assert code == 0
  assert len(re.findall(r"request \d+ \[", out)) == 3
  assert "generated 15 tokens" in out
  assert re.search(r"mean batch occupancy \d+\.\d+ sequences", out)
  assert re.search(r"cache: peak \d+ rows in use", out)
  assert out.count(": OK") == 3


def test_demo_parallel_samples_llama(capsys):
  code = demo.main(["--model", "llama", "--requests", "2", "--n", "2", "--max-tokens", "3",
                    "--layers", "1", "--temperature", "1.0", "--top-k", "5", "--quiet"])
  out = capsys.readouterr().out
  assert code == 0 and "generated 12 tokens" in out and "request 0" not in out


def test_help_documents_every_flag(capsys):
  with pytest.raises(SystemExit, match="0"):
    demo.main(["--help"])
  text = capsys.readouterr().out
  parser_flags = re.findall(r"add_argument\(\"(--[a-z-]+)\"", pathlib.Path(demo.__file__).read_text())
  assert len(parser_flags) > 20
  for flag in parser_flags:
    assert re.search(re.escape(flag) + r"\b.*\n?\s+\S", text), flag


def test_bad_flags_are_refused(capsys):
  with pytest.raises(SystemExit, match="2"):
    demo.main(["--requests", "0"])
  assert "--requests=0 must be in [1, 2**31)" in capsys.readouterr().err


def test_demo_loads_a_checkpoint(capsys):
  fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "hf_llama"
  code = demo.main(["--checkpoint", str(fixture), "--requests", "2", "--max-tokens", "3",
                    "--prompt-max", "10", "--max-write", "8", "--check"])
  out = capsys.readouterr().out
  assert code == 0 and "llama (checkpoint, 2 layers" in out and out.count(": OK") == 2


def test_demo_text_prompts_with_a_tokenizer(tmp_path, capsys):
  """A checkpoint with tokenizer.json: --prompt text is encoded and outputs are decoded."""
  tokenizers = pytest.importorskip("tokenizers", reason="the optional tokenizers package is "
                                   "not installed")
  fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "hf_llama"
  for name in ("config.json", "model.safetensors"):
    (tmp_path / name).write_bytes((fixture / name).read_bytes())
  vocab = {f"w{i}": i for i in range(128)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  code = demo.main(["--checkpoint", str(tmp_path), "--prompt", "w5 w17 w99", "--max-tokens",
                    "3", "--max-write", "8"])
  out = capsys.readouterr().out
  assert code == 0 and "1 requests" in out
  assert re.search(r"request 0 \[  3 prompt\] 'w\d+", out)


def test_demo_parallel_samples_fill_every_column(capsys):
  """`--n 2` with more requests than column pairs (issue 9: the host admission let a later
  request take the columns a waiting fork needed, and the demo crashed with NO_FREE_ID)."""
  code = demo.main(["--model", "llama", "--requests", "5", "--n", "2", "--max-seqs", "4",
                    "--max-tokens", "3", "--layers", "1", "--quiet"])
  out = capsys.readouterr().out
  assert code == 0 and "generated 30 tokens" in out
