"""A float64 NumPy forward pass of a Hugging Face Llama checkpoint: the oracle for scores.

It shares no code with `jaxkv` (it reads the safetensors file itself and restates
Llama's layer from the Hugging Face definition: RMSNorm, rotate-half RoPE with the
default frequencies, grouped-query causal attention, SiLU-gated MLP), so a test can
hold the server's logprobs against it. Only what the test fixtures use is covered.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def load(path: str) -> tuple[dict, dict]:
  """`(config.json, {tensor name: float64 array})` of the checkpoint folder `path`."""
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(path, "model.safetensors"), "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    data = f.read()
  weights = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    start, end = info["data_offsets"]
    array = np.frombuffer(data[start:end], _DTYPES[info["dtype"]]).reshape(info["shape"])
    weights[name] = array.astype(np.float64)
  return config, weights


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):
  """`x` `[T, heads, d]` rotated by its position (the first and second halves pair up)."""
  t, _, d = x.shape
  inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  angles = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]
  cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]
  sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
  half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
  return x * cos + half * sin


def log_probs(config: dict, w: dict, tokens) -> np.ndarray:
  """`float64[T, vocab]`: position t's log-distribution of token t + 1."""
  tokens = np.asarray(tokens)
  heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
  d = config.get("head_dim") or config["hidden_size"] // heads
  eps = config["rms_norm_eps"]
  theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
  t = len(tokens)
  x = w["model.embed_tokens.weight"][tokens]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    q = _rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, heads, d), theta)
    k = _rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv_heads, d), theta)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv_heads, d)
    k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.where(causal[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * d)
    x = x + attn @ w[p + "self_attn.o_proj.weight"].T
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  logits = _rms(x, w["model.norm.weight"], eps) @ head.T
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
