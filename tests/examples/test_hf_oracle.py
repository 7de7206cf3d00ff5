"""Hugging Face `transformers` as the external oracle (fixtures from scripts/make_hf_fixtures.py).

The fixtures are tiny random float32 Llama, Gemma 3, Qwen2 (q/k/v biases, one
full and one window-4 layer), Qwen3 (q/k norms) and Mistral (window 4 on every
layer) checkpoints plus the
logits `transformers` computed for five token sequences in one full forward
each. Here the same weights run through `jaxkv.models` on jaxkv, with the
sequences fed in interleaved chunks (prefill mixed with decode in one step), a
fork (sequence 4 shares sequence 0's first 9 tokens and is cloned from it), a
rewind after wrong tokens, and the window-4 ring layers (Gemma 3, Qwen2,
Mistral) wrapping (R = 11, sequences up to 24 tokens). Every sequence's logits
must match the reference.

Tolerance: both sides compute in float32 and differ only in reduction order
(one full-sequence forward versus per-step attention over cached K/V); observed
differences are below 5e-6 on logits of magnitude ~3. `ATOL = 5e-5` leaves a 10x
margin, while a wrong position, window or mask moves logits by more than 1e-2
(the negative control below).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import jax
import numpy as np
import pytest

from jaxkv.models import hf
from jaxkv.models import Decoder
from jaxkv.serve import ModelRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
KINDS = ["llama", "gemma3", "qwen2", "qwen3", "mistral"]
ATOL = 5e-5
FORK_PREFIX = 9


def _reference(kind):
  data = np.load(os.path.join(FIXTURES, f"hf_{kind}", "logits.npz"))
  n = len([k for k in data.files if k.startswith("tokens_")])
  return [data[f"tokens_{i}"] for i in range(n)], [data[f"logits_{i}"] for i in range(n)]


def _runner(kind, **overrides):
  model, config, cache_config = hf.load_model(os.path.join(FIXTURES, f"hf_{kind}"), capacity=256,
                                              max_seqs=6, max_write=8)
  if overrides:   # same weights, different architecture facts (negative controls)
    from flax import nnx   # pylint: disable=g-import-not-at-top
    config = dataclasses.replace(config, **overrides)
    other = Decoder(config, config.cache_config(capacity=256, max_seqs=6, max_write=8),
                    rngs=nnx.Rngs(0))
    nnx.update(other, nnx.state(model))
    model = other
  return ModelRunner(model), config


def _replay(runner, tokens, seed=0):
  """Feeds sequences 0-3 interleaved in random chunks, forks 4 off 0, rewinds 2 once."""
  rng = np.random.default_rng(seed)
  width = runner.config.step_width
  ids = {i: runner.seq_new() for i in range(4)}
  fed = {i: 0 for i in range(4)}
  logits = {i: [] for i in range(5)}
  rewound = False
  while any(fed[i] < len(tokens[i]) for i in ids):
    seq_ids, toks, spans = [], [], []
    order = [i for i in ids if fed[i] < len(tokens[i])]
    rng.shuffle(order)
    for i in order:
      room = width - len(seq_ids)
      if room == 0:
        break
      count = min(int(rng.integers(1, 6)), room, len(tokens[i]) - fed[i])
      spans.append((i, len(seq_ids), count))
      seq_ids += [ids[i]] * count
      toks += [int(t) for t in tokens[i][fed[i]:fed[i] + count]]
    out = runner.step(seq_ids, toks)
    for i, start, count in spans:
      logits[i].append(out[start:start + count])
      fed[i] += count
      if i == 0 and 4 not in ids and fed[0] >= FORK_PREFIX:
        fork = runner.seq_clone(ids[0], FORK_PREFIX)
        assert fork is not None and runner.pos(fork) == FORK_PREFIX
        ids[4], fed[4] = fork, FORK_PREFIX
        logits[4].append(np.concatenate(logits[0])[:FORK_PREFIX])
    if not rewound and fed[2] >= 10:
      # Three wrong tokens in one step, then back: rewinding inside the last step is never refused.
      pos = runner.pos(ids[2])
      runner.step([ids[2]] * 3, [5, 6, 7])
      assert runner.rewind(ids[2], pos)
      rewound = True
  assert rewound and 4 in ids
  return {i: np.concatenate(parts) for i, parts in logits.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_batched_replay_matches_transformers(kind):
  tokens, reference = _reference(kind)
  runner, config = _runner(kind)
  sliding = {"gemma3": 3, "qwen2": 1, "mistral": 2}.get(kind, 0)
  assert config.layer_types.count("sliding") == sliding
  if sliding:
    assert config.sliding_window == 4
    ring = config.layer_types.index("sliding")
    assert max(len(t) for t in tokens) > runner.config.ring_rows(ring)   # rings wrap
  assert config.attention_bias == (kind == "qwen2")
  assert config.qk_norm == {"gemma3": "gemma", "qwen3": "llama"}.get(kind)
  # Full float32 matmuls on GPUs too (their default may use TF32, ~1e-3 off).
  with jax.default_matmul_precision("highest"):
    got = _replay(runner, tokens)
  for i, want in enumerate(reference):
    assert got[i].shape == want.shape, i
    np.testing.assert_allclose(got[i], want, atol=ATOL, rtol=0, err_msg=f"sequence {i}")


@pytest.mark.parametrize("kind, overrides", [
    ("gemma3", dict(sliding_window=5)),
    ("llama", dict(rope_theta=20000.0)),
    ("qwen2", dict(sliding_window=5)),
    ("qwen3", dict(rms_eps=1e-1)),
    ("mistral", dict(sliding_window=5)),
], ids=["gemma3-window", "llama-rope", "qwen2-window", "qwen3-eps", "mistral-window"])
def test_negative_control(kind, overrides):
  """A wrong window, RoPE base or eps with the same weights misses the reference by far."""
  tokens, reference = _reference(kind)
  runner, _ = _runner(kind, **overrides)
  got = _replay(runner, tokens)
  assert np.abs(got[2] - reference[2]).max() > 1e-2


def _have_torch():
  return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


# CI installs no torch (the committed fixtures carry its logits); the GPU check's host has it, and
# benchmarks/gpu_checks.sh fails if these skip there.
@pytest.mark.skipif(not _have_torch(), reason="torch and transformers are not installed: "
                    "benchmarks/gpu_checks.sh runs these where they are")
@pytest.mark.parametrize("kind", KINDS)
def test_live_transformers_agree_with_fixtures(kind):
  spec = importlib.util.spec_from_file_location(
      "make_hf_fixtures", os.path.join(ROOT, "scripts", "make_hf_fixtures.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  tokens, reference = _reference(kind)
  model = script.load(os.path.join(FIXTURES, f"hf_{kind}"))
  for got, want in zip(script.reference_logits(model, tokens), reference):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
