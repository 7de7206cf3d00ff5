"""The decode kernel through page tables against the column layout, on the same shapes.

Issue 13's target: the paged decode kernel within 5% of the column one. One process on
one GPU (H200 in docs/PERFORMANCE.md): 64 sequences of 32 query heads over 8 KV heads of
128 (bf16), one decode token each, every sequence at 512 .. 8192 tokens or at mixed
lengths. The column layout is a `[8192, 65, 8, 128]` cache; the paged layouts are pools of
64- and 128-row pages (`--page-sizes`: pages of 16 or 32 rows make each 64-row K/V tile
several pages, one TMA and one page-table lookup per page) holding the same logical
contents, with each sequence's pages in table order ("in order") or a random permutation
of the pool ("scattered", what a long-running server's pool looks like). Every variant
attends over one buffer shape, so each compiles once. A row is the mean of back-to-back
calls after a warm-up (the median of 5 such means); `paged/cols` is the paged time over
the column time, and `max|diff|` checks the paged output against the column one (the
same kernel body over the same logical contents: 0 expected). A 64-token K/V write
(column `kv_write` against `paged_kv_write`) closes the table.

Usage: PYTHONPATH=. python3 benchmarks/paged_decode.py [--iters N] [--out results.json]
       [--page-sizes 16,32,64,128]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import paged_sm90

DTYPE = jnp.bfloat16
NUM_SEQS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 64, 32, 8, 128
CAPACITY = 8192
LENGTHS = [512, 1024, 2048, 4096, 8192]
PAGE_SIZES = [64, 128]   # the default; --page-sizes 16,32,64,128 adds pages smaller than a tile
SCALE = 1.0 / HEAD_DIM ** 0.5
INTERPRET = False   # `--small` without a GPU: the kernels under the Mosaic GPU interpreter
REPS = 5


def use_small_shapes():
  """`--small`: 4 sequences of 2/1 heads of 64 over 256 rows, one timed call per row."""
  global NUM_SEQS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, CAPACITY, LENGTHS, SCALE, INTERPRET, REPS
  NUM_SEQS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, CAPACITY = 4, 2, 1, 64, 256
  LENGTHS, SCALE, REPS = [64, 256], 1.0 / 64 ** 0.5, 1
  INTERPRET = jax.default_backend() != "gpu"


def mean_ms(fn, *args, iters):
  """Median over `REPS` repetitions of the mean time of `iters` back-to-back calls, in ms."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  means = []
  for _ in range(REPS):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    means.append((time.perf_counter() - start) / iters)
  return 1e3 * float(np.median(means))


def page_table(page_size, *, scattered, rng):
  """`[NUM_SEQS + 1, M]`: sequence `s` holds pages for all CAPACITY rows; row 64 is scratch."""
  pages_per_col = CAPACITY // page_size
  num_pages = NUM_SEQS * pages_per_col + 1
  order = rng.permutation(num_pages - 1) if scattered else np.arange(num_pages - 1)
  table = np.full((NUM_SEQS + 1, pages_per_col), num_pages - 1, np.int32)
  table[:NUM_SEQS] = order.reshape(NUM_SEQS, pages_per_col)
  return jnp.asarray(table), num_pages


@functools.partial(jax.jit, static_argnames=("num_pages",))
def to_pool(cols, table, *, num_pages):
  """The pool holding column storage `[CAPACITY, 65, K, D]` through `table` (setup only)."""
  page_size = CAPACITY // table.shape[1]
  per_seq = cols[:, :NUM_SEQS].reshape(table.shape[1], page_size, NUM_SEQS, NUM_KV_HEADS,
                                       HEAD_DIM)
  pages = per_seq.transpose(2, 0, 1, 3, 4).reshape(-1, page_size, NUM_KV_HEADS, HEAD_DIM)
  pool = jnp.zeros((num_pages, page_size, NUM_KV_HEADS, HEAD_DIM), cols.dtype)
  return pool.at[table[:NUM_SEQS].reshape(-1)].set(pages)


def decode_plan(lengths):
  """One decode token per sequence: token i reads sequence i's positions `[0, len)`."""
  seq_info = np.zeros((NUM_SEQS, 5), np.int32)
  seq_info[:, 0] = seq_info[:, 2] = np.arange(NUM_SEQS)
  seq_info[:, 1] = 1
  seq_info[:, 3] = lengths - 1
  return jnp.asarray(seq_info), jnp.int32(NUM_SEQS)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=100, help="back-to-back calls per mean")
  parser.add_argument("--out", default=None, help="write the rows as JSON here")
  parser.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)),
                      help="comma-separated page sizes; pages of 8, 16 or 32 rows make each "
                      "64-row K/V tile several pages, one TMA per page")
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes, one call per row (interpreted without a GPU): a smoke "
                      "test, not a measurement")
  args = parser.parse_args()
  if args.small:
    use_small_shapes()
    args.iters = 1
  page_sizes = [int(p) for p in args.page_sizes.split(",")]
  rng = np.random.default_rng(0)
  shape = (CAPACITY, NUM_SEQS + 1, NUM_KV_HEADS, HEAD_DIM)
  k_cols = jax.random.normal(jax.random.key(1), shape, DTYPE)
  v_cols = jax.random.normal(jax.random.key(2), shape, DTYPE)
  q = jax.random.normal(jax.random.key(3), (NUM_SEQS, NUM_Q_HEADS, HEAD_DIM), DTYPE)
  columns = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None, scale=SCALE,
                                      interpret=INTERPRET))
  paged = jax.jit(functools.partial(pallas_kernels.paged_varlen_attention, window=None,
                                    scale=SCALE, interpret=INTERPRET))
  layouts = {}
  for page_size in page_sizes:
    # Compiled or refused, never the reference: the paged entry point has no fallback.
    config = paged_sm90.check_request(
        q, jax.ShapeDtypeStruct((1, page_size, NUM_KV_HEADS, HEAD_DIM), DTYPE),
        interpret=INTERPRET)
    print(f"page {page_size}: K/V tiles of {config.block_k} rows, "
          f"{paged_sm90.tile_pages(page_size, config.block_k)} page(s) and TMA(s) per tile "
          "for K and for V")
    for scattered in (False, True):
      table, num_pages = page_table(page_size, scattered=scattered, rng=rng)
      name = f"page {page_size} {'scattered' if scattered else 'in order'}"
      layouts[name] = (to_pool(k_cols, table, num_pages=num_pages),
                       to_pool(v_cols, table, num_pages=num_pages), table)
  cases = [(f"all {n}", np.full(NUM_SEQS, n, np.int32)) for n in LENGTHS]
  cases.append((f"mixed {LENGTHS[0]}..{CAPACITY}",
                rng.integers(LENGTHS[0], CAPACITY + 1, NUM_SEQS).astype(np.int32)))
  rows = []
  print(f"decode: {NUM_SEQS} seqs, {NUM_Q_HEADS}/{NUM_KV_HEADS} heads of {HEAD_DIM}, bf16, "
        f"{jax.devices()[0].device_kind}; mean of {args.iters} back-to-back calls")
  print(f"{'case':<17} {'layout':<22} {'ms':>8} {'TB/s':>6} {'paged/cols':>10} {'max|diff|':>9}")
  for case, lengths in cases:
    seq_info, n = decode_plan(lengths)
    live = float(lengths.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * 2
    base_ms = mean_ms(columns, q, k_cols, v_cols, seq_info, n, iters=args.iters)
    base = columns(q, k_cols, v_cols, seq_info, n).astype(jnp.float32)
    results = [("columns", base_ms, None, 0.0)]
    for name, (k_pool, v_pool, table) in layouts.items():
      ms = mean_ms(paged, q, k_pool, v_pool, table, seq_info, n, iters=args.iters)
      out = paged(q, k_pool, v_pool, table, seq_info, n).astype(jnp.float32)
      results.append((name, ms, ms / base_ms, float(jnp.max(jnp.abs(out - base)))))
    for name, ms, ratio, diff in results:
      ratio_text = "" if ratio is None else f"{ratio:.3f}"
      print(f"{case:<17} {name:<22} {ms:8.4f} {live / ms / 1e9:6.2f} {ratio_text:>10} "
            f"{diff:9.2e}")
      rows.append(dict(case=case, layout=name, ms=ms, tbps=live / ms / 1e9, ratio=ratio,
                       max_diff=diff))
  rows += write_rows(k_cols, v_cols, layouts, rng, iters=args.iters)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


def write_rows(k_cols, v_cols, layouts, rng, *, iters):
  """One new token per sequence written into the columns and into each pool, donated."""
  positions = jnp.asarray(rng.integers(0, CAPACITY, NUM_SEQS).astype(np.int32))
  cols = jnp.arange(NUM_SEQS, dtype=jnp.int32)
  new = jax.random.normal(jax.random.key(4), (NUM_SEQS, NUM_KV_HEADS, HEAD_DIM), DTYPE)
  n = jnp.int32(NUM_SEQS)
  write = jax.jit(functools.partial(pallas_kernels.kv_write, interpret=INTERPRET),
                  donate_argnums=(0, 1))
  paged_write = jax.jit(functools.partial(pallas_kernels.paged_kv_write, interpret=INTERPRET),
                        donate_argnums=(0, 1))
  rows, stores = [], {"columns": (k_cols, v_cols, None)} | layouts
  print(f"\nwrite: {NUM_SEQS} tokens, donated stores; mean of {iters} back-to-back calls")
  for name, (k, v, table) in stores.items():
    state = [k, v]

    def step():
      if table is None:
        state[:] = write(*state, new, new, cols, positions, n)
      else:
        state[:] = paged_write(*state, new, new, cols, positions, n, table)
      return state[0]

    ms = mean_ms(step, iters=iters)
    case = f"write {NUM_SEQS} tokens"
    print(f"{case:<17} {name:<22} {ms:8.4f}")
    rows.append(dict(case=case, layout=name, ms=ms))
  return rows


if __name__ == "__main__":
  main()
