"""K/V bytes of column vs paged storage for issue 13's two memory cases (CPU; bytes are arithmetic).

Cases (8B-shaped model: 32 flat layers, 8 KV heads of 128, bfloat16):
  mix:     64 sequences, 1 x 8,192 + 63 x 256 tokens, capacity = those 24,320 tokens.
  samples: n = 8 samples of one 2,000-token prompt (prefilled once, then forked with
           seq_clone) + 256 new tokens each; capacity = the 8 x 2,256 positions the
           logical budget counts.

For each case and storage (page_size 64):
  allocated: the K/V leaves of `jaxkv.init_state(config)` under `jax.eval_shape`
    (nothing allocated). Columns need flat rows for the longest sequence, so that
    config's `initial_capacity` is the longest length.
  in use: pages the page tables hold (`page_refs > 0`) after running the verbs
    (seq_new, prefill steps, seq_clone, decode steps) on an analogue with the same
    token counts and page size but one KV head of dim 2 in one layer, scaled to
    the 8B shape per token; for columns, every written row of every column
    (`pos` of each sequence: a fork holds its own copy of the prompt).
  live: distinct tokens whose K/V the sequences need (a shared prompt once).

Usage: python benchmarks/paged_memory.py [--page-size 64] [--small]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jaxkv  # pylint: disable=wrong-import-position

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, jnp.bfloat16
TOKEN_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * np.dtype(DTYPE).itemsize   # K and V
GIB = 2**30


def model_config(*, capacity, max_seqs, max_write, page_size=None, rows=512, layers=LAYERS,
                 heads=KV_HEADS, dim=HEAD_DIM):
  layer = jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), heads, dim)
  return jaxkv.CacheConfig([layer] * layers, capacity=capacity, max_seqs=max_seqs,
                           max_write=max_write, kv_dtype=DTYPE, initial_capacity=rows,
                           page_size=page_size)


def allocated_bytes(config) -> int:
  """K/V bytes of a fresh state, from shapes only."""
  state = jax.eval_shape(lambda: jaxkv.init_state(config))
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in state.k + state.v)


class Analogue:
  """The case's verbs on a one-layer, one-head, dim-2 cache of the same token counts."""

  def __init__(self, *, capacity, max_seqs, max_write, page_size):
    self.config = model_config(capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                               page_size=page_size, rows=capacity, layers=1, heads=1, dim=2)
    self.cache = jaxkv.BatchedSequenceCache(self.config, implementation="reference")
    self.rng = np.random.default_rng(0)

  def step(self, ids):
    cache, n = self.cache, len(ids)
    assert cache.declare_step(ids), cache.last_status
    cache.prepare_step()
    q, k, v = (jnp.asarray(self.rng.standard_normal((n, 1, 2), dtype=np.float32))
               for _ in range(3))
    cache.attend(0, q, k, v)
    cache.commit_step()

  def prefill(self, seqs_and_lengths):
    """Packs the prompts into steps of at most `max_write` tokens."""
    pending = [[s] * n for s, n in seqs_and_lengths]
    tokens = [s for run in pending for s in run]
    width = self.config.max_write
    for i in range(0, len(tokens), width):
      self.step(tokens[i:i + width])

  def pages_in_use(self) -> int:
    return int(np.count_nonzero(np.asarray(self.cache.state.page_refs)))

  def rows_written(self) -> int:
    """Rows a column layout holds: every live sequence's own prefix."""
    state = self.cache.state
    return int(np.asarray(state.pos)[np.asarray(state.live) == 1].sum())


def case_mix(page_size: int, lengths=(8192,) + (256,) * 63):
  lengths = list(lengths)
  capacity, live = sum(lengths), sum(lengths)
  kw = dict(capacity=capacity, max_seqs=len(lengths), max_write=512)
  analogue = Analogue(page_size=page_size, **kw)
  analogue.prefill([(analogue.cache.seq_new(), n) for n in lengths])
  return dict(
      name=f"mix: 1 x {lengths[0]} + {len(lengths) - 1} x {lengths[1]}", live=live,
      columns_alloc=allocated_bytes(model_config(rows=max(lengths), **kw)),
      columns_use=analogue.rows_written() * TOKEN_BYTES,
      paged_alloc=allocated_bytes(model_config(page_size=page_size, **kw)),
      paged_use=analogue.pages_in_use() * page_size * TOKEN_BYTES)


def case_samples(page_size: int, n=8, prompt=2000, new=256):
  capacity, live = n * (prompt + new), prompt + n * new
  kw = dict(capacity=capacity, max_seqs=n, max_write=256)
  analogue = Analogue(page_size=page_size, **kw)
  first = analogue.cache.seq_new()
  analogue.prefill([(first, prompt)])
  samples = [first] + [analogue.cache.seq_clone(first) for _ in range(n - 1)]
  assert None not in samples, analogue.cache.last_status
  for _ in range(new):
    analogue.step(samples)
  return dict(
      name=f"samples: n = {n} x ({prompt} prompt + {new} new)", live=live,
      columns_alloc=allocated_bytes(model_config(rows=prompt + new, **kw)),
      columns_use=analogue.rows_written() * TOKEN_BYTES,
      paged_alloc=allocated_bytes(model_config(page_size=page_size, **kw)),
      paged_use=analogue.pages_in_use() * page_size * TOKEN_BYTES)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--page-size", type=int, default=64)
  parser.add_argument("--small", action="store_true",
                      help="both cases at a sixteenth of the tokens (a smoke test of the script; "
                      "the ratios differ from the full cases')")
  args = parser.parse_args(argv)
  print(f"8B-shaped K/V: {LAYERS} layers x 2 x {KV_HEADS} heads x {HEAD_DIM} x bf16 = "
        f"{TOKEN_BYTES:,} bytes per token; page_size {args.page_size}\n")
  print("| case | storage | allocated GiB | allocated / live | in use GiB | in use / live |")
  print("|---|---|---|---|---|---|")
  if args.small:
    cases = (case_mix(args.page_size, (512,) + (16,) * 15),
             case_samples(args.page_size, n=2, prompt=125, new=16))
  else:
    cases = (case_mix(args.page_size), case_samples(args.page_size))
  for case in cases:
    live = case["live"] * TOKEN_BYTES
    for storage in ("columns", "paged"):
      alloc, use = case[f"{storage}_alloc"], case[f"{storage}_use"]
      print(f"| {case['name']} (live {live / GIB:.2f} GiB) | {storage} | {alloc / GIB:.2f} | "
            f"{alloc / live:.2f}x | {use / GIB:.2f} | {use / live:.2f}x |")


if __name__ == "__main__":
  main()
