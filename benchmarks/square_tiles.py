"""Why square K/V tiles (`block_k == head_dim`) miscompute: a minimal reproduction (issue 12).

`varlen_attention_sm90.static_check` refused `block_k == head_dim` because such tiles gave
wrong results on the H200 (jax 0.11.2) until the kernel reloaded q per tile for them
(`varlen_kernel_sm90._stream_tiles`, the cause this script found). It calls the jitted
`_varlen_attention` directly on small inputs: one segment in one column, one KV
head shared by `G` query heads, `block_q` 64, no key splits, and compares the kernel's
rows with float64 oracles, each written here in numpy:

- `right`: softmax(q k^T) v, causal by position;
- `k_untransposed`: the score matrix read with K's rows and columns swapped
  (s = q @ K for the `[keys, dim]` tile taken as `[dim, keys]`), which is what a wgmma
  B-operand descriptor that dropped the `transpose((1, 0))` of the K tile would compute;
- `v_transposed`: P v^T (the converse mistake on the P @ V matmul);
- both mistakes together.

The swapped readings are defined for one tile only (keys = block_k). Over several tiles
three more oracles ask what the loop lost: the first tile alone, the last tile alone, the
tiles' partial sums added without rescaling to a common maximum. `SQUARE_MULTI_ONLY=1`
runs the multi-tile square cases alone (`square_repro.py` reproduces the miscompute with q
held in registers, outside jaxkv). A case matches an oracle when its largest error is
below 2e-2 (bf16 inputs). Non-square tiles (block_k 128 at head_dim 64, 64 at 128) are the
controls. Usage (GPU machine):
`PYTHONPATH=. python3 benchmarks/square_tiles.py`
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import indexing
from pallas_kernels import varlen_attention_sm90 as sm90
from pallas_kernels.config import VarlenAttentionConfig


def _oracles(q, k, v, pos0, block_k=None):
  """`{name: [T, G, D]}` float64 outputs of one causal segment (one KV head, G query heads)."""
  t, g, d = q.shape
  keys = k.shape[0]
  qpos = pos0 + np.arange(t)
  mask = np.arange(keys)[None, :] <= qpos[:, None]
  scale = 1.0 / math.sqrt(d)

  def attend(kk, vv):
    out = np.zeros((t, g, d))
    for h in range(g):
      s = np.where(mask, (q[:, h] @ kk) * scale, -np.inf)
      p = np.exp(s - s.max(axis=1, keepdims=True))
      p /= p.sum(axis=1, keepdims=True)
      out[:, h] = p @ vv
    return out

  out = {"right": attend(k.T, v)}
  if block_k and keys > block_k:
    # Several tiles: the results of a loop that lost what earlier tiles carried (the
    # last tile alone), of one that read only the first tile, and of one that added
    # the tiles' partial sums without rescaling them to a common maximum.
    first, last = slice(0, block_k), slice(keys - block_k, keys)
    def only(sl):
      res = np.zeros((t, g, d))
      for h in range(g):
        s = np.where(mask[:, sl], (q[:, h] @ k[sl].T) * scale, -np.inf)
        s = np.where(np.isfinite(s).any(axis=1, keepdims=True), s, 0.0)
        p = np.exp(s - s.max(axis=1, keepdims=True)) * mask[:, sl]
        res[:, h] = (p @ v[sl]) / np.maximum(p.sum(axis=1, keepdims=True), 1e-30)
      return res
    def no_rescale():
      res = np.zeros((t, g, d))
      for h in range(g):
        acc, l = np.zeros((t, d)), np.zeros((t, 1))
        for start in range(0, keys, block_k):
          sl = slice(start, start + block_k)
          s = np.where(mask[:, sl], (q[:, h] @ k[sl].T) * scale, -np.inf)
          m = np.where(np.isfinite(s).any(axis=1, keepdims=True), s.max(axis=1, keepdims=True), 0.0)
          p = np.exp(s - m) * mask[:, sl]
          acc += p @ v[sl]
          l += p.sum(axis=1, keepdims=True)
        res[:, h] = acc / l
      return res
    out.update(first_tile_only=only(first), last_tile_only=only(last), no_rescale=no_rescale())
  if keys == d:   # the swapped readings exist only for one square tile
    out["k_untransposed"] = attend(k, v)
    out["v_transposed"] = attend(k.T, v.T)
    out["both"] = attend(k, v.T)
  return out


def run_case(head_dim, block_k, tokens, keys, group=1, stages=2, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((tokens, group, head_dim)).astype(np.float32)
  k = rng.standard_normal((keys, 1, 1, head_dim)).astype(np.float32)
  v = rng.standard_normal((keys, 1, 1, head_dim)).astype(np.float32)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  # Oracles on the bf16-rounded values.
  qn, kn, vn = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  pos0 = keys - tokens
  seq_info = np.zeros((tokens, 5), np.int32)
  seq_info[0] = (0, tokens, 0, pos0, indexing.KIND_CAUSAL)
  config = VarlenAttentionConfig(block_q=64, block_k=block_k, num_stages=stages, split_len=1 << 20,
                                 split_budget=0, max_splits=1)
  got = sm90._varlen_attention(q, k, v, jnp.asarray(seq_info), jnp.int32(1), window=None,
                               scale=1.0 / math.sqrt(head_dim), config=config, interpret=None)
  got = np.asarray(got.astype(jnp.float32), np.float64)
  oracles = _oracles(qn, kn[:, 0, 0], vn[:, 0, 0], pos0, block_k)
  errors = {name: float(np.max(np.abs(got - want))) for name, want in oracles.items()}
  # Which query rows are wrong (a row = one token of one head), against the right oracle.
  bad = np.max(np.abs(got - oracles["right"]), axis=-1) > 2e-2
  return errors, [(int(a), int(b)) for a, b in zip(*np.nonzero(bad))]


def main() -> int:
  print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}")
  cases = [
      # (head_dim, block_k, tokens, keys, group): squares, then non-square controls
      (64, 64, 1, 64, 1), (64, 64, 64, 64, 1), (64, 64, 8, 64, 1),
      (128, 128, 1, 128, 1), (128, 128, 64, 128, 1),
      (64, 64, 1, 64, 4), (64, 64, 16, 64, 4), (64, 64, 4, 64, 4), (64, 64, 16, 64, 2),
      (64, 64, 1, 128, 1), (64, 64, 16, 128, 4), (64, 64, 64, 192, 1), (64, 64, 16, 192, 4),
      (128, 128, 16, 128, 4), (128, 128, 1, 256, 4),
      (64, 128, 1, 128, 1), (64, 128, 64, 128, 1), (64, 128, 16, 128, 4), (128, 64, 16, 64, 4),
      (64, 128, 16, 384, 4), (128, 64, 16, 256, 4),
  ]
  # Several tiles per item (the failing square cases above) with one K/V stage, so every
  # tile lands in stage 0, and with three: which stage a tile uses, not its index.
  if os.environ.get("SQUARE_MULTI_ONLY"):   # the multi-tile square cases alone
    cases = [c for c in cases if c[0] == c[1] and c[3] > c[1]]
  cases = [c + (2,) for c in cases] + [
      (64, 64, 1, 128, 1, 1), (64, 64, 16, 192, 4, 1), (128, 128, 1, 256, 4, 1),
      (64, 64, 1, 128, 1, 3), (64, 64, 16, 192, 4, 3)]
  print(f"{'head_dim':>8} {'block_k':>7} {'tokens':>6} {'keys':>5} {'G':>2} {'st':>2}  "
        "max |kernel - oracle| per oracle; wrong (token, head) rows")
  for head_dim, block_k, tokens, keys, group, stages in cases:
    head = f"{head_dim:>8} {block_k:>7} {tokens:>6} {keys:>5} {group:>2} {stages:>2}"
    try:
      errors, bad = run_case(head_dim, block_k, tokens, keys, group, stages)
    except Exception as e:   # pylint: disable=broad-except
      print(f"{head}  failed: {type(e).__name__}: {str(e)[:200]}")
      continue
    best = min(errors, key=errors.get)
    text = ", ".join(f"{n} {e:.3g}" for n, e in errors.items())
    verdict = best if errors[best] < 2e-2 else "none"
    rows = "" if not bad else f"; {len(bad)} wrong rows, first {bad[:6]}"
    print(f"{head}  {text}  -> matches: {verdict}{rows}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
