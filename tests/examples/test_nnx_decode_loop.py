"""The README's NNX snippet (`examples/nnx_decode_loop.py`) against a dense float64 recomputation.

The oracle reads the model's weights and recomputes every generated position from
scratch: the whole sequence (prompt + generated tokens) through plain causal
attention (`oracle.attend_naive`) with its own RoPE, no cache and no jaxkv code.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from examples import nnx_decode_loop as example
from oracle import attend_naive


def _rope(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
  """Rotate-half RoPE (Llama's) of `x [T, H, D]` at `positions [T]`, in float64."""
  half = x.shape[-1] // 2
  inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2 / x.shape[-1])
  angles = positions[:, None] * inv_freq[None, :]                   # [T, D/2]
  cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _dense_logits(model, tokens: list[int]) -> np.ndarray:
  """Logits `[T, vocab]` of one whole sequence, recomputed densely in float64."""
  w = lambda p: np.asarray(p[...], np.float64)
  x = w(model.embed.embedding)[np.asarray(tokens)]
  positions = np.arange(len(tokens), dtype=np.float64)
  visible = np.tril(np.ones((len(tokens), len(tokens)), bool))
  for attn in model.attn:
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = (x @ w(attn.q_proj.kernel)).reshape(len(tokens), heads, dim)
    k = (x @ w(attn.k_proj.kernel)).reshape(len(tokens), kv_heads, dim)
    v = (x @ w(attn.v_proj.kernel)).reshape(len(tokens), kv_heads, dim)
    out = attend_naive(_rope(q, positions), _rope(k, positions), v, visible, dim ** -0.5)
    x = x + out.reshape(len(tokens), heads * dim) @ w(attn.o_proj.kernel)
  return x @ w(model.head.kernel) + w(model.head.bias)


@pytest.fixture(scope="module")
def run():
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    model, prompts, tokens, logits = example.main()
  return model, prompts, np.asarray(tokens), np.asarray(logits), printed.getvalue()


def test_generated_tokens_match_a_dense_recomputation(run):
  model, prompts, tokens, logits, _ = run
  assert tokens.shape == (len(prompts), 6)
  for prompt, out, seen in zip(prompts, tokens.tolist(), logits):
    want = _dense_logits(model, prompt + out)[len(prompt) - 1:-1]   # the logits behind each token
    np.testing.assert_allclose(seen, want, rtol=1e-4, atol=1e-4)
    # Greedy: each token is the oracle's argmax wherever no near tie could flip it.
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.sum() >= len(out) - 1
    assert (np.asarray(out) == want.argmax(-1))[clear].all()


def test_main_prints_one_line_per_prompt(run):
  model, prompts, tokens, _, printed = run
  assert printed.strip().splitlines() == [f"{p} -> {t}" for p, t in zip(prompts, tokens.tolist())]
