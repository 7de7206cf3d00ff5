"""`python -m jaxkv.demo`: flags, output and the optional greedy check."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import tokenizers

import jaxkv
from jaxkv import _implementation, demo


def test_demo_serves_and_checks(capsys):
  code = demo.main(["--requests", "3", "--max-tokens", "5", "--layers", "3", "--prompt-max",
                    "20", "--max-write", "8", "--window", "4", "--initial-capacity", "16",
                    "--check"])
  out = capsys.readouterr().out
  assert code == 0
  assert len(re.findall(r"request \d+ \[", out)) == 3
  assert "generated 15 tokens" in out
  # One line per (implementation, reason): on CPU every layer runs the reference.
  assert re.findall(r"^attention: .*$", out, re.M) == [
      "attention: reference on layers 0-2 (3 of 3): the default device (cpu: cpu) is not an "
      "NVIDIA GPU of compute capability >= 9.0"]
  assert re.findall(r"^decode GEMM: .*$", out, re.M) == [
      "decode GEMM: gemm='xla': XLA's for every product"]
  # The warm-up run compiled the loop; the measured run compiles again here only because its
  # flat rows grow past --initial-capacity (a new cache shape); see the next test.
  warm = float(re.search(r"^compile: ([\d.]+) s \(a warm-up run", out, re.M).group(1))
  more, serve_s = map(float, re.search(
      r"generated 15 tokens in [\d.]+ s: compile ([\d.]+) s more .*, serving ([\d.]+) s",
      out).groups())
  assert warm > 0 and more >= 0 and serve_s > 0
  assert re.search(r"serving, compilation excluded: [\d.]+ tokens/s, [\d.]+ step tokens/s, "
                   r"[\d.]+ ms/step", out)
  assert re.search(r"latency per sample, mean/max ms .*: queue [\d.]+/[\d.]+, first token "
                   r"[\d.]+/[\d.]+, total [\d.]+/[\d.]+, inter-token [\d.]+/[\d.]+", out)
  assert re.search(r"mean batch occupancy \d+\.\d+ sequences", out)
  assert re.search(r"cache: peak \d+ rows in use", out)
  assert out.count(": OK") == 3


def test_demo_parallel_samples_llama(capsys):
  code = demo.main(["--model", "llama", "--requests", "2", "--n", "2", "--max-tokens", "3",
                    "--layers", "1", "--temperature", "1.0", "--top-k", "5", "--quiet"])
  out = capsys.readouterr().out
  assert code == 0 and "generated 12 tokens" in out and "request 0" not in out
  # Without growth the warm-up (1-token prompts: no fork) compiled the very loop the run uses.
  warm = float(re.search(r"^compile: ([\d.]+) s \(a warm-up run", out, re.M).group(1))
  more = float(re.search(r"generated 12 tokens in [\d.]+ s: compile ([\d.]+) s more", out)[1])
  assert warm > 0 and more < warm / 4


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


class _Device:
  """A stand-in for `jax.devices()[0]`: only what the default selection and sizing read."""

  def __init__(self, platform, kind, capability):
    self.platform, self.device_kind, self.compute_capability = platform, kind, capability
    self.id = 0

  def memory_stats(self):
    return {"bytes_limit": 80 * 2**30, "bytes_in_use": 0}


@pytest.mark.parametrize("device, dtype, head_dim, runs", [
    (_Device("gpu", "NVIDIA H200", "9.0"), "bfloat16", 64, "mosaic_gpu"),
    (_Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), "float32", 16, "reference"),
    (None, "float32", 16, "reference"),   # this machine's CPU
])
def test_demo_defaults_to_what_the_kernels_serve_on_hopper(monkeypatch, device, dtype, head_dim,
                                                           runs):
  """On a Hopper GPU the demo's random model is bf16 with head_dim 64, and every layer is then
  planned onto the compiled kernels; elsewhere it keeps the small float32 model."""
  if device is not None:
    monkeypatch.setattr(_implementation.jax, "devices", lambda *a: [device])
  _, args = demo._parse_args(["--requests", "2"])
  assert (args.dtype, args.head_dim) == (dtype, head_dim)
  config = demo._model_config(args, args.layers)
  cache = config.cache_config(capacity=args.capacity, max_seqs=args.max_seqs,
                              max_write=args.max_write, kv_dtype=demo._DTYPES[args.dtype])
  assert {r.implementation for r in jaxkv.implementation_plan(cache, config.num_heads)} == {runs}
  if device is not None and runs == "mosaic_gpu":
    # The old defaults (float32, head_dim 16) would silently run the reference there.
    _, old = demo._parse_args(["--requests", "2", "--dtype", "float32", "--head-dim", "16"])
    config = demo._model_config(old, old.layers)
    cache = config.cache_config(capacity=old.capacity, max_seqs=old.max_seqs,
                                max_write=old.max_write, kv_dtype=demo._DTYPES[old.dtype])
    assert {r.implementation for r in jaxkv.implementation_plan(cache, config.num_heads)} == {
        "reference"}
    # An explicit reference run keeps the small float32 model.
    _, ref = demo._parse_args(["--requests", "2", "--implementation", "reference"])
    assert (ref.dtype, ref.head_dim) == ("float32", 16)


def test_head_dim_is_for_the_random_model_only(capsys):
  fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "hf_llama"
  with pytest.raises(SystemExit, match="2"):
    demo.main(["--checkpoint", str(fixture), "--head-dim", "64"])
  assert "--head-dim applies to the random model only" in capsys.readouterr().err


def test_demo_stops_at_every_generation_config_id(tmp_path, capsys):
  """A checkpoint's generation_config.json names the stop ids (as transformers' generate reads
  them), here more than the 8 default slots: every one ends a sample, none is dropped."""
  fixture = pathlib.Path(__file__).parent.parent / "fixtures" / "hf_llama"
  for name in ("config.json", "model.safetensors"):
    (tmp_path / name).write_bytes((fixture / name).read_bytes())
  ids = list(range(20, 128, 9))   # 12 ids, none of them config.json's eos_token_id (2)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
  argv = ["--checkpoint", str(tmp_path), "--requests", "4", "--max-tokens", "6", "--prompt-max",
          "10", "--max-write", "8", "--temperature", "1.0"]
  _, args = demo._parse_args(argv)
  model, config, tokenizer = demo._build(args)
  requests = demo._requests(args, config, tokenizer)
  assert all(r.params.stop_tokens == tuple(ids) for r in requests)
  assert demo._max_stop(requests) == len(ids)
  assert demo.main(argv) == 0
  rows = re.findall(r"request \d+ \[\s*\d+ prompt\] ([\d ]+)  \((stop|length)\)",
                    capsys.readouterr().out)
  assert len(rows) == 4
  for text, reason in rows:
    tokens = [int(t) for t in text.split()]
    ended = [i for i, t in enumerate(tokens) if t in ids]
    assert ended == ([len(tokens) - 1] if reason == "stop" else []), (tokens, reason)
    assert reason == "stop" or len(tokens) == 6
  # With these seeds a sample ends at the 9th id: one an 8-slot engine would have dropped.
  assert any(reason == "stop" and int(text.split()[-1]) in ids[8:] for text, reason in rows)
