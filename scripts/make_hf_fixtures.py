"""Makes the Hugging Face oracle fixtures under tests/fixtures/ (needs torch + transformers).

Builds tiny random Llama, Gemma 3 text, Qwen2 (q/k/v biases, a sliding layer
after a full one), Qwen3 (per-head q/k norms, head_dim != hidden/heads) and
Mistral (every layer a window-4 sliding window) models with `transformers`
(float32, CPU), saves each as a checkpoint directory
(`config.json` + `model.safetensors`) and the teacher-forced logits of a few token
sequences (`logits.npz`: `tokens_i` int32 and `logits_i` float32 `[len, vocab]`).
The tests load these with `jaxkv.models.hf` and replay the sequences through jaxkv;
they need neither torch nor transformers.

Run from the repository root, in a separate environment (never a project dependency):

  python3 -m venv /work/hfvenv && /work/hfvenv/bin/pip install torch transformers safetensors
  /work/hfvenv/bin/python scripts/make_hf_fixtures.py [--kinds qwen2 mistral]

Sequence 4 shares sequence 0's first 9 tokens (the fork tests clone there).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures")
VOCAB = 128
LENGTHS = (20, 13, 24, 7)
FORK_PREFIX, FORK_LENGTH = 9, 17
INIT_STD = 0.15   # larger than HF's 0.02, so attention weights are far from uniform


def sequences(seed: int = 0) -> list[np.ndarray]:
  """The fixture token sequences (deterministic)."""
  rng = np.random.default_rng(seed)
  seqs = [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in LENGTHS]
  suffix = rng.integers(0, VOCAB, size=FORK_LENGTH - FORK_PREFIX).astype(np.int32)
  seqs.append(np.concatenate([seqs[0][:FORK_PREFIX], suffix]))
  return seqs


def llama_config():
  from transformers import LlamaConfig   # pylint: disable=g-import-not-at-top
  return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     tie_word_embeddings=False, initializer_range=INIT_STD,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)


def gemma3_config():
  from transformers import Gemma3TextConfig   # pylint: disable=g-import-not-at-top
  return Gemma3TextConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
      rms_norm_eps=1e-6, sliding_window=4, query_pre_attn_scalar=16,
      layer_types=["sliding_attention", "sliding_attention", "full_attention",
                   "sliding_attention"],
      rope_parameters={
          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
      initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def qwen2_config():
  from transformers import Qwen2Config   # pylint: disable=g-import-not-at-top
  # Layer 0 full, layer 1 a window of 4 (use_sliding_window with max_window_layers=1).
  return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=128, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                     use_sliding_window=True, sliding_window=4, max_window_layers=1,
                     tie_word_embeddings=True, initializer_range=INIT_STD,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)


def qwen3_config():
  from transformers import Qwen3Config   # pylint: disable=g-import-not-at-top
  return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                     tie_word_embeddings=False, initializer_range=INIT_STD,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)


def mistral_config():
  from transformers import MistralConfig   # pylint: disable=g-import-not-at-top
  return MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       sliding_window=4, tie_word_embeddings=False,
                       initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


KINDS = ("llama", "gemma3", "qwen2", "qwen3", "mistral")


def build(kind: str, seed: int = 0):
  """A random float32 transformers model of `kind` (one of `KINDS`)."""
  import torch   # pylint: disable=g-import-not-at-top
  import transformers   # pylint: disable=g-import-not-at-top
  torch.manual_seed(seed)
  classes = {"llama": ("LlamaForCausalLM", llama_config), "gemma3": ("Gemma3ForCausalLM",
             gemma3_config), "qwen2": ("Qwen2ForCausalLM", qwen2_config),
             "qwen3": ("Qwen3ForCausalLM", qwen3_config),
             "mistral": ("MistralForCausalLM", mistral_config)}
  cls, make_config = classes[kind]
  model = getattr(transformers, cls)(make_config())
  with torch.no_grad():   # norms start at 1 (Llama) or 0 (Gemma), biases at 0: make them matter
    for name, param in model.named_parameters():
      if "norm" in name or name.endswith(".bias"):
        param.add_(0.2 * torch.randn_like(param))
  return model.eval().to(torch.float32)


def reference_logits(model, seqs) -> list[np.ndarray]:
  """Teacher-forced logits `[len, vocab]` of each sequence, one full forward each."""
  import torch   # pylint: disable=g-import-not-at-top
  out = []
  with torch.no_grad():
    for seq in seqs:
      ids = torch.as_tensor(np.asarray(seq, np.int64))[None]
      out.append(model(input_ids=ids).logits[0].float().numpy())
  return out


def load(checkpoint: str):
  """The saved fixture model, through transformers (for the live test)."""
  import torch   # pylint: disable=g-import-not-at-top
  from transformers import AutoModelForCausalLM   # pylint: disable=g-import-not-at-top
  return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def write(kind: str, out_dir: str) -> None:
  model = build(kind)
  checkpoint = os.path.join(out_dir, f"hf_{kind}")
  model.save_pretrained(checkpoint, safe_serialization=True)
  for extra in ("generation_config.json",):
    path = os.path.join(checkpoint, extra)
    if os.path.exists(path):
      os.remove(path)
  seqs = sequences()
  logits = reference_logits(model, seqs)
  arrays = {}
  for i, (seq, lg) in enumerate(zip(seqs, logits)):
    arrays[f"tokens_{i}"] = seq
    arrays[f"logits_{i}"] = lg.astype(np.float32)
  np.savez_compressed(os.path.join(checkpoint, "logits.npz"), **arrays)
  with open(os.path.join(checkpoint, "config.json")) as f:
    model_type = json.load(f)["model_type"]
  print(f"wrote {checkpoint} ({model_type}, {sum(p.numel() for p in model.parameters())} params)")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=FIXTURES, help=f"output folder (default {FIXTURES})")
  parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                      help="which fixtures to write (default: all)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  for kind in args.kinds:
    write(kind, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
