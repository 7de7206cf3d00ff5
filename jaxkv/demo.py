"""`python -m jaxkv.demo`: several sequences through prefill, decode, a fork and a rewind.

Random K/V go through `BatchedSequenceCache` on a flat + ring layer stack; every
step's outputs are checked against a per-sequence NumPy attention over that
sequence's own history (float64), and each sequence's position is printed.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv


def _parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="python -m jaxkv.demo", description=__doc__)
  parser.add_argument("--seqs", type=int, default=4, help="sequences to serve (default 4)")
  parser.add_argument("--prompt", type=int, default=12, help="longest prompt length")
  parser.add_argument("--decode", type=int, default=10, help="decode steps (default 10)")
  parser.add_argument("--window", type=int, default=6, help="ring layer window (default 6)")
  parser.add_argument("--max-write", type=int, default=8, help="step width W (default 8)")
  parser.add_argument("--implementation", default=None,
                      choices=["reference", "mosaic_gpu", "interpret"],
                      help="attention implementation (default: Mosaic GPU on Hopper, "
                           "else the reference)")
  parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
  return parser.parse_args(argv)


class _History:
  """One sequence's K/V per layer as the demo's independent check sees it."""

  def __init__(self, num_layers):
    self.k = [[] for _ in range(num_layers)]
    self.v = [[] for _ in range(num_layers)]

  def fork(self, upto):
    other = _History(len(self.k))
    other.k = [list(ks[:upto]) for ks in self.k]
    other.v = [list(vs[:upto]) for vs in self.v]
    return other

  def rewind(self, position):
    self.k = [ks[:position] for ks in self.k]
    self.v = [vs[:position] for vs in self.v]


def _expected(history, layer, q, window, dtype):
  """float64 causal (sliding-window) attention of `q` at the history's last positions."""
  keys = np.stack(history.k[layer]).astype(dtype).astype(np.float64)   # [S, K, D]
  values = np.stack(history.v[layer]).astype(dtype).astype(np.float64)
  num_keys, num_queries = keys.shape[0], q.shape[0]
  group = q.shape[1] // keys.shape[1]
  out = np.zeros(q.shape, np.float64)
  for i in range(num_queries):
    p = num_keys - num_queries + i
    lo = 0 if window is None else max(0, p - window + 1)
    for h in range(q.shape[1]):
      s = keys[lo:p + 1, h // group] @ q[i, h].astype(np.float64) / math.sqrt(q.shape[2])
      w = np.exp(s - s.max())
      out[i, h] = (w / w.sum()) @ values[lo:p + 1, h // group]
  return out


class _Demo:
  """Drives the cache and the check side by side."""

  def __init__(self, args):
    self.rng = np.random.default_rng(args.seed)
    self.windows = [None, args.window]
    layers = [jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), 2, 16),
              jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(args.window), 2, 16)]
    self.config = jaxkv.CacheConfig(layers, capacity=64 * args.seqs, max_seqs=args.seqs + 1,
                                    max_write=args.max_write, kv_dtype=jnp.float32,
                                    initial_capacity=16)
    self.cache = jaxkv.BatchedSequenceCache(self.config, implementation=args.implementation)
    self.histories = {}
    self.worst = 0.0

  def new(self):
    seq_id = self.cache.seq_new()
    self.histories[seq_id] = _History(len(self.windows))
    return seq_id

  def step(self, seq_ids):
    """One step: declare, prepare, write + attend every layer, check, commit."""
    assert self.cache.declare_step(seq_ids), f"declaration {seq_ids} refused"
    self.cache.prepare_step()
    n = len(seq_ids)
    for layer, window in enumerate(self.windows):
      q = self.rng.standard_normal((n, 4, 16)).astype(np.float32)
      k = self.rng.standard_normal((n, 2, 16)).astype(np.float32)
      v = self.rng.standard_normal((n, 2, 16)).astype(np.float32)
      out = np.asarray(self.cache.attend(layer, q, k, v))
      for seq_id in dict.fromkeys(seq_ids):
        rows = [i for i, s in enumerate(seq_ids) if s == seq_id]
        history = self.histories[seq_id]
        history.k[layer].extend(k[rows])
        history.v[layer].extend(v[rows])
        expected = _expected(history, layer, q[rows], window, np.float32)
        self.worst = max(self.worst, float(np.abs(out[rows] - expected).max()))
    self.cache.commit_step()

  def report(self, label):
    live = [s for s in self.histories if self.cache.is_live(s)]
    text = ", ".join(f"seq {s}: pos {self.cache.pos(s)}" for s in live)
    print(f"{label:<26} {text}")


def main(argv=None) -> int:
  args = _parse_args(argv)
  start = time.perf_counter()
  demo = _Demo(args)
  print(f"jaxkv demo on {jax.devices()[0].platform}: layers [flat, ring({args.window})], "
        f"W={args.max_write}, {args.seqs} sequences")
  seq_ids = [demo.new() for _ in range(args.seqs)]
  lengths = [max(1, args.prompt - 3 * i) for i in range(args.seqs)]
  pending = [s for s, n in zip(seq_ids, lengths) for _ in range(n)]
  while pending:   # chunked prefill, several sequences per step
    demo.step(pending[:args.max_write])
    pending = pending[args.max_write:]
  demo.report("after prefill")
  fork = demo.cache.seq_clone(seq_ids[0], lengths[0] - 2)
  demo.histories[fork] = demo.histories[seq_ids[0]].fork(lengths[0] - 2)
  demo.report(f"fork {fork} of seq {seq_ids[0]}")
  for i in range(args.decode):
    active = list(demo.histories)
    demo.step(active[:args.max_write])
    if i == args.decode // 2:
      target = demo.cache.pos(seq_ids[1]) - 1
      assert demo.cache.rewind(seq_ids[1], target), "rewind refused"
      demo.histories[seq_ids[1]].rewind(target)
      demo.report(f"rewind seq {seq_ids[1]} by 1")
  demo.report("after decode")
  ok = demo.worst < 1e-4
  print(f"max |jaxkv - numpy float64 attention| = {demo.worst:.2e}  "
        f"({'OK' if ok else 'MISMATCH'}); {time.perf_counter() - start:.1f} s")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
