"""Decode, mixed-step, prefill and write timings of jaxkv's kernels against baselines.

Runs in one process on one GPU (H200 in docs/PERFORMANCE.md) and prints a table:
a device-to-device copy (the bandwidth ceiling), cuDNN `dot_product_attention` on
the padded equivalent, the deprecated Pallas `ops.gpu.paged_attention` (page 16),
and `pallas_kernels.varlen_attention` over the ANCHORS.md shapes, plus a mixed
step, a 16384-token causal prefill and a 64-token `kv_write` into a 1 GB cache.
Effective TB/s = live K/V bytes (real lengths x heads x dim x 2 bytes x 2) / time.

Usage: python benchmarks/decode.py [--quick | --e2e | --prefill | --small] [--out results.json]
`--small` runs tiny shapes once each (on a machine without a GPU the jaxkv rows run the kernels
under the Mosaic GPU interpreter and the cuDNN rows report that they cannot run): a smoke test
of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import config as kernel_config

DTYPE = jnp.bfloat16
# `--small` sets these: one call per timing, the kernels interpreted where there is no GPU.
SMALL = {"on": False, "interpret": False}


@dataclasses.dataclass
class Row:
  name: str
  variant: str
  ms: float | None
  tbps: float | None = None
  tflops: float | None = None
  note: str = ""


def bench(fn, *args, iters=20, reps=5):
  """Median over `reps` of the mean time of `iters` back-to-back calls, in ms."""
  if SMALL["on"]:
    iters, reps = 1, 1
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / iters)
  return 1e3 * float(np.median(times))


def torch_d2d_copy_ms(n: int) -> float | None:
  """Milliseconds of a device-to-device copy of `n` bf16 elements (torch's), or None without CUDA torch.

  The copy engine's rate is the bandwidth ceiling: a JAX elementwise pass moves the same bytes slower.
  """
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
  dst = torch.empty_like(src)
  for _ in range(3):
    dst.copy_(src)
  torch.cuda.synchronize()
  start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  for _ in range(20):
    dst.copy_(src)
  stop.record()
  torch.cuda.synchronize()
  ms = start.elapsed_time(stop) / 20
  del src, dst
  torch.cuda.empty_cache()
  return ms


def torch_d2d_copy_bytes_per_s(n: int) -> float | None:
  """Bytes read + written per second by torch's copy of `n` bf16 elements, or None without CUDA torch."""
  ms = torch_d2d_copy_ms(n)
  return None if ms is None else 2 * 2 * n / (ms * 1e-3)


def copy_ceiling(rows):
  n = 1 << 30   # 1 Gi bf16 elements = 2 GiB, far above L2
  ms = torch_d2d_copy_ms(n)
  if ms is not None:
    rows.append(Row("copy 2 GiB", "torch d2d", ms, 2 * 2 * n / ms / 1e9))
  x = jax.random.normal(jax.random.key(0), (n,), DTYPE)
  ms = bench(jax.jit(lambda a: a * 2), x)
  rows.append(Row("copy 2 GiB", "jax elementwise", ms, 2 * 2 * n / ms / 1e9))
  del x


def decode_case(num_seqs, num_q_heads, num_kv_heads, head_dim, min_len, max_len):
  rng = np.random.default_rng(0)
  lengths = rng.integers(min_len, max_len + 1, num_seqs).astype(np.int32)
  return lengths


def build_cache(key, lengths, num_kv_heads, head_dim, num_rows=None):
  num_rows = num_rows or int(-(-int(lengths.max()) // 64) * 64)
  shape = (num_rows, len(lengths) + 1, num_kv_heads, head_dim)
  k_key, v_key = jax.random.split(key)
  return (jax.random.normal(k_key, shape, DTYPE), jax.random.normal(v_key, shape, DTYPE))


def decode_plan(lengths):
  """One decode token per sequence; token i of sequence i at position len-1."""
  num_seqs = len(lengths)
  seq_info = np.zeros((num_seqs, 5), np.int32)
  seq_info[:, 0] = np.arange(num_seqs)
  seq_info[:, 1] = 1
  seq_info[:, 2] = np.arange(num_seqs)
  seq_info[:, 3] = lengths - 1
  return jnp.asarray(seq_info), jnp.int32(num_seqs)


def prefill_plan(num_seqs, length):
  """`num_seqs` causal prompts of `length` tokens from position 0, in step order."""
  tokens = num_seqs * length
  seq_info = np.zeros((tokens, 5), np.int32)
  seq_info[:] = [tokens, 0, num_seqs, 0, 0]
  for i in range(num_seqs):
    seq_info[i] = [i * length, length, i, 0, 0]
  return jnp.asarray(seq_info), jnp.int32(num_seqs)


def run_decode(rows, name, num_seqs, num_q_heads, num_kv_heads, head_dim, min_len, max_len,
               configs, check):
  lengths = decode_case(num_seqs, num_q_heads, num_kv_heads, head_dim, min_len, max_len)
  live = float(lengths.sum()) * num_kv_heads * head_dim * 2 * 2
  k_cache, v_cache = build_cache(jax.random.key(1), lengths, num_kv_heads, head_dim)
  q = jax.random.normal(jax.random.key(2), (num_seqs, num_q_heads, head_dim), DTYPE)
  seq_info, n_segments = decode_plan(lengths)
  scale = 1.0 / head_dim ** 0.5
  label = f"{name} ({live / 1e9:.2f} GB live)"
  for cname, cfg in configs.items():
    if cfg is not None and cfg.block_k == head_dim:   # square tiles are refused
      cfg = dataclasses.replace(cfg, block_k=128)
    fn = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None, scale=scale,
                                   config=cfg, interpret=SMALL["interpret"]))
    try:
      ms = bench(fn, q, k_cache, v_cache, seq_info, n_segments)
      note = ""
      if check:
        ref = jax.jit(functools.partial(pallas_kernels.varlen_attention_reference, window=None,
                                        scale=scale))(q, k_cache, v_cache, seq_info, n_segments)
        out = fn(q, k_cache, v_cache, seq_info, n_segments)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        note = f"max|err| vs reference {err:.2e}"
        del ref, out
      rows.append(Row(label, f"jaxkv {cname}", ms, live / ms / 1e9, note=note))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(Row(label, f"jaxkv {cname}", None, note=f"{type(e).__name__}: {e}"[:200]))
  max_len_pad = int(k_cache.shape[0])
  del k_cache, v_cache
  # cuDNN on the padded equivalent.
  k_pad = jax.random.normal(jax.random.key(3), (num_seqs, max_len_pad, num_kv_heads, head_dim),
                            DTYPE)
  v_pad = jax.random.normal(jax.random.key(4), k_pad.shape, DTYPE)
  q4 = q[:, None]
  lens = jnp.asarray(lengths)
  try:
    fn = jax.jit(lambda q_, k_, v_, l_: jax.nn.dot_product_attention(
        q_, k_, v_, key_value_seq_lengths=l_, implementation="cudnn"))
    ms = bench(fn, q4, k_pad, v_pad, lens)
    rows.append(Row(label, "cuDNN padded", ms, live / ms / 1e9))
  except Exception as e:  # pylint: disable=broad-except
    rows.append(Row(label, "cuDNN padded", None, note=f"{type(e).__name__}: {e}"[:200]))
  del k_pad, v_pad
  # Deprecated Pallas paged attention, page 16 (benchmarks only).
  try:
    from jax.experimental.pallas.ops.gpu import paged_attention  # pylint: disable=g-import-not-at-top
    page = 16
    pages_per_seq = max_len_pad // page
    total_pages = num_seqs * pages_per_seq
    k_pages = jax.random.normal(jax.random.key(5), (num_kv_heads, total_pages, page, head_dim),
                                DTYPE)
    v_pages = jax.random.normal(jax.random.key(6), k_pages.shape, DTYPE)
    tables = jnp.arange(total_pages, dtype=jnp.int32).reshape(num_seqs, pages_per_seq)
    fn = jax.jit(paged_attention.paged_attention)
    ms = bench(fn, q, k_pages, v_pages, tables, lens)
    rows.append(Row(label, "Pallas paged_attention p16", ms, live / ms / 1e9))
    del k_pages, v_pages
  except Exception as e:  # pylint: disable=broad-except
    rows.append(Row(label, "Pallas paged_attention p16", None,
                    note=f"{type(e).__name__}: {e}"[:200]))


def mixed_inputs():
  """ANCHORS' mixed step: 8 prefill spans of 512 tokens over 2048 history + 56 decode tokens.

  Returns `(q, k_cache, v_cache, seq_info, n_segments, dec_lengths, live_bytes, flops)`
  (32/8 heads of 128, bf16; decode histories 512..8192, seed 0; one 8,192-row cache).
  """
  rng = np.random.default_rng(0)
  num_kv_heads, num_q_heads, head_dim = 8, 32, 128
  dec_lengths = rng.integers(512, 8193, 56).astype(np.int32)
  segments, t = [], 0
  for s in range(8):
    segments.append([t, 512, s, 2048, 0])
    t += 512
  for i, length in enumerate(dec_lengths):
    segments.append([t, 1, 8 + i, int(length) - 1, 0])
    t += 1
  width = t
  seq_info = np.zeros((width, 5), np.int32)
  seq_info[:] = [width, 0, 64, 0, 0]
  seq_info[:len(segments)] = segments
  ends = np.array([s[3] + s[1] for s in segments])
  live = float(ends.sum()) * num_kv_heads * head_dim * 2 * 2
  flops = 0.0
  for q_start, q_len, _, pos0, _ in segments:
    keys = np.arange(pos0 + 1, pos0 + q_len + 1, dtype=np.float64)
    flops += 4.0 * num_q_heads * head_dim * keys.sum()
  k_cache, v_cache = build_cache(jax.random.key(7), np.array([8192] * 64), num_kv_heads,
                                 head_dim)
  q = jax.random.normal(jax.random.key(8), (width, num_q_heads, head_dim), DTYPE)
  return (q, k_cache, v_cache, jnp.asarray(seq_info), jnp.int32(len(segments)), dec_lengths,
          live, flops)


def run_mixed(rows, configs):
  """8 prefill spans of 512 tokens over 2048 history + 56 decode tokens."""
  q, k_cache, v_cache, seq_info, n_segments, _, live, flops = mixed_inputs()
  head_dim = q.shape[-1]
  label = f"mixed 8x512 prefill + 56 decode ({live / 1e9:.2f} GB, {flops / 1e9:.0f} GFLOP)"
  for cname, cfg in configs.items():
    fn = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None,
                                   scale=head_dim ** -0.5, config=cfg))
    try:
      ms = bench(fn, q, k_cache, v_cache, seq_info, n_segments, iters=10)
      rows.append(Row(label, f"jaxkv {cname}", ms, live / ms / 1e9, flops / ms / 1e9))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(Row(label, f"jaxkv {cname}", None, note=f"{type(e).__name__}: {e}"[:200]))


def run_prefill(rows, configs, length=16384, num_seqs=1, num_q_heads=32, num_kv_heads=8,
                head_dim=128, iters=3, fa3=()):
  """`num_seqs` causal prompts of `length` tokens from position 0, one varlen call.

  `fa3`: `(block_q, block_kv, stages)` settings of jax's warp-specialised Mosaic GPU
  attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`: two consumer
  warpgroups of `block_q` rows sharing each K/V tile, a TMA warpgroup, ping-pong
  schedule barriers) timed on the same dense causal problem, as the FA3 anchor.
  """
  flops = num_seqs * 4.0 * num_q_heads * head_dim * length * (length + 1) / 2
  label = (f"causal prefill {num_seqs}x{length} {num_q_heads}/{num_kv_heads} D{head_dim} "
           f"({flops / 1e12:.2f} TFLOP)")
  k_cache, v_cache = build_cache(jax.random.key(9), np.array([length] * num_seqs), num_kv_heads,
                                 head_dim)
  q = jax.random.normal(jax.random.key(10), (num_seqs * length, num_q_heads, head_dim), DTYPE)
  seq_info, n_segments = prefill_plan(num_seqs, length)
  default_out = None   # the default config's output, which other configs are compared with
  for cname, cfg in configs.items():
    fn = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None,
                                   scale=head_dim ** -0.5, config=cfg,
                                   interpret=SMALL["interpret"]))
    try:
      ms = bench(fn, q, k_cache, v_cache, seq_info, n_segments, iters=iters, reps=3)
      note = ""
      out = fn(q, k_cache, v_cache, seq_info, n_segments).astype(jnp.float32)
      if cfg is None:
        default_out = out
      elif default_out is not None:   # a non-default config: its largest difference
        note = f"max abs diff vs jaxkv default {float(jnp.max(jnp.abs(out - default_out))):.2e}"
      rows.append(Row(label, f"jaxkv {cname}", ms, tflops=flops / ms / 1e9, note=note))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(Row(label, f"jaxkv {cname}", None, note=f"{type(e).__name__}: {e}"[:200]))
  del k_cache, v_cache
  kq = q.reshape(num_seqs, length, num_q_heads, head_dim)
  kk = jax.random.normal(jax.random.key(11), (num_seqs, length, num_kv_heads, head_dim), DTYPE)
  vv = jax.random.normal(jax.random.key(12), kk.shape, DTYPE)   # not kk: V would come from L2
  try:
    fn = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True,
                                                              implementation="cudnn"))
    ms = bench(fn, kq, kk, vv, iters=iters, reps=3)
    rows.append(Row(label, "cuDNN causal", ms, tflops=flops / ms / 1e9))
  except Exception as e:  # pylint: disable=broad-except
    rows.append(Row(label, "cuDNN causal", None, note=f"{type(e).__name__}: {e}"[:200]))
  if fa3:
    # jax's kernel: its shared-memory buffers are float16 whatever the inputs, so it is
    # timed in float16; it applies no softmax scale, so q enters pre-scaled (cuDNN's
    # default is D ** -0.5). The same inputs and reference serve every setting.
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=g-import-not-at-top
    q16, k16, v16 = (x.astype(jnp.float16) for x in (kq, kk, vv))
    want = jax.nn.dot_product_attention(q16, k16, v16, is_causal=True,
                                        implementation="cudnn").astype(jnp.float32)
    q16 = (q16 * head_dim ** -0.5).astype(jnp.float16)
  for block_q, block_kv, stages in fa3:
    name = f"jax attention_mgpu (FA3) q{block_q} kv{block_kv} s{stages}"
    try:
      tuning = attention_mgpu.TuningConfig(block_q=block_q, block_kv=block_kv,
                                           max_concurrent_steps=stages, causal=True)
      fn = jax.jit(functools.partial(attention_mgpu.attention, config=tuning))
      out = fn(q16, k16, v16)
      err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)))
      ms = bench(fn, q16, k16, v16, iters=iters, reps=3)
      rows.append(Row(label, name, ms, tflops=flops / ms / 1e9,
                      note=f"float16; max abs err vs cuDNN {err:.2e}"))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(Row(label, name, None, note=f"{type(e).__name__}: {e}"[:200]))


def run_write(rows, steps=100, num_rows=8192, num_seqs=64, num_kv_heads=8, head_dim=128,
              tokens=64):
  """`steps` writes of `tokens` tokens inside one donated jit (the decode-loop setting)."""
  shape = (num_rows, num_seqs + 1, num_kv_heads, head_dim)
  nbytes = 2 * np.prod(shape) * 2
  cache_type = f"bf16[{','.join(map(str, shape))}]"
  rng = np.random.default_rng(0)
  cols = jnp.asarray(rng.permutation(num_seqs)[:tokens].astype(np.int32))
  rows_ = jnp.asarray(rng.integers(0, num_rows - steps, tokens).astype(np.int32))
  k_new, v_new = jax.random.normal(jax.random.key(12), (2, tokens, num_kv_heads, head_dim),
                                   DTYPE)
  label = (f"kv_write {tokens} tokens into 2 x [{num_rows},{num_seqs + 1},{num_kv_heads},"
           f"{head_dim}] bf16 ({nbytes / 1e9:.1f} GB, donated)")
  kernel = functools.partial(pallas_kernels.kv_write, interpret=SMALL["interpret"])
  for variant, op in (("jaxkv kv_write", kernel),
                      ("XLA scatter (reference)", pallas_kernels.kv_write_reference)):
    def loop(k_cache, v_cache, k_new, v_new, cols, rows, op=op):
      def body(i, caches):
        return op(*caches, k_new, v_new, cols, rows + i, jnp.int32(tokens))
      return jax.lax.fori_loop(0, steps, body, (k_cache, v_cache))
    fn = jax.jit(loop, donate_argnums=(0, 1))
    caches = (jnp.zeros(shape, DTYPE), jnp.zeros(shape, DTYPE))
    compiled = fn.lower(*caches, k_new, v_new, cols, rows_).compile()
    copies = sum(1 for line in compiled.as_text().splitlines()
                 if " copy(" in line and cache_type in line)
    aliased = compiled.memory_analysis().alias_size_in_bytes
    caches = compiled(*caches, k_new, v_new, cols, rows_)
    jax.block_until_ready(caches)
    times = []
    for _ in range(1 if SMALL["on"] else 5):
      start = time.perf_counter()
      caches = compiled(*caches, k_new, v_new, cols, rows_)
      jax.block_until_ready(caches)
      times.append((time.perf_counter() - start) / steps)
    got = np.asarray(caches[0][rows_ + steps - 1, cols], np.float32)
    ok = np.array_equal(got, np.asarray(k_new, np.float32))
    rows.append(Row(label, variant, 1e3 * float(np.median(times)),
                    note=f"cache-sized copies: {copies}; aliased {aliased / 1e9:.2f} GB; "
                    f"rows correct: {ok}"))
    del caches


def run_small(rows):
  """Tiny shapes, one call each: the script's every path, in seconds (a smoke test)."""
  default = {"default": None}
  run_decode(rows, "decode 4 seqs 8/2 D64 16..120", 4, 8, 2, 64, 16, 120, default, check=True)
  run_prefill(rows, default, length=64, num_seqs=2, num_q_heads=8, num_kv_heads=2, head_dim=64,
              iters=1)
  run_write(rows, steps=2, num_rows=64, num_seqs=4, num_kv_heads=2, head_dim=64, tokens=4)


def run_e2e_shapes(rows):
  """The e2e model's attention (Llama-3.2-1B shape: 32/8 heads of 64), one layer per call.

  Decode of 64 sequences at the uniform workload's contexts (prompts 128..2048
  plus up to 256 new tokens) and at the decode workload's (8..16 + 256), one
  2,048-token prefill chunk, and the issue's 4 x 4096 causal prefill at D128,
  each with cuDNN in the same process.
  """
  copy_ceiling(rows)
  default = {"default": None}
  run_decode(rows, "decode 64 seqs 32/8 D64 128..2304 (uniform)", 64, 32, 8, 64, 128, 2304,
             default, check=True)
  run_decode(rows, "decode 64 seqs 32/8 D64 8..272 (decode workload)", 64, 32, 8, 64, 8, 272,
             default, check=True)
  run_decode(rows, "decode 256 seqs 32/8 D64 128..2048", 256, 32, 8, 64, 128, 2048,
             default, check=True)
  run_prefill(rows, default, length=2048, num_seqs=1, head_dim=64, iters=20)
  run_prefill(rows, default, length=512, num_seqs=4, head_dim=64, iters=20)
  run_prefill(rows, default, length=4096, num_seqs=4, head_dim=128, iters=5)


def run_prefill_anchors(rows):
  """The issue's causal prefill rows with the FA3 anchor beside jaxkv and cuDNN."""
  fa3 = ((64, 128, 2), (64, 64, 3), (64, 128, 3))
  # Square 128-key tiles at head dim 128 (served since q is reloaded per tile): FA3's
  # tile size, which the defaults do not pick.
  default = kernel_config.default_varlen_attention_config(group=4, head_dim=128, interpret=False)
  # One stage keeps a square-tile program at ~80 KB of shared memory (two per SM), as the
  # default's two stages of 64-key tiles do.
  d128 = {"default": None, "block_k 128 (square)": dataclasses.replace(default, block_k=128),
          "block_k 128 (square) 1 stage": dataclasses.replace(default, block_k=128,
                                                               num_stages=1)}
  run_prefill(rows, d128, length=16384, num_seqs=1, head_dim=128, iters=5, fa3=fa3)
  run_prefill(rows, d128, length=4096, num_seqs=4, head_dim=128, iters=5, fa3=fa3)
  run_prefill(rows, {"default": None}, length=2048, num_seqs=1, head_dim=64, iters=20,
              fa3=((64, 128, 2), (64, 64, 3)))


def print_table(rows):
  print("\n| case | implementation | ms | TB/s | TFLOP/s | note |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    fmt = lambda x, f: "–" if x is None else f.format(x)
    print(f"| {r.name} | {r.variant} | {fmt(r.ms, '{:.3f}')} | {fmt(r.tbps, '{:.2f}')} | "
          f"{fmt(r.tflops, '{:.0f}')} | {r.note} |")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="decode shapes and write only")
  parser.add_argument("--out", default=None, help="write the rows as JSON here")
  parser.add_argument("--e2e", action="store_true",
                      help="only the e2e model's shapes (32/8 heads of 64) and 4x4096 prefill")
  parser.add_argument("--prefill", action="store_true",
                      help="only the causal prefill rows, with jax's FA3-structured kernel")
  parser.add_argument("--small", action="store_true",
                      help="tiny shapes, one call each (interpreted without a GPU): a smoke test")
  args = parser.parse_args()
  print(jax.devices(), jax.__version__)
  rows = []
  if args.small:
    SMALL["on"] = True
    SMALL["interpret"] = jax.default_backend() != "gpu"
    run_small(rows)
    print_table(rows)
    return
  if args.prefill:
    run_prefill_anchors(rows)
    print_table(rows)
    return
  if args.e2e:
    run_e2e_shapes(rows)
    print_table(rows)
    if args.out:
      with open(args.out, "w") as f:
        json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return
  default = kernel_config.default_varlen_attention_config(group=4, head_dim=128,
                                                          interpret=False)
  configs = {
      "default": None,
      "programs 528": dataclasses.replace(default, max_programs=528),
      "programs 2112": dataclasses.replace(default, max_programs=2112),
      "one program per item": dataclasses.replace(default, max_programs=1 << 30),
  }
  copy_ceiling(rows)
  run_decode(rows, "decode 64 seqs 32/8 D128 512..8192", 64, 32, 8, 128, 512, 8192, configs,
             check=True)
  run_decode(rows, "decode 256 seqs 32/8 D128 128..2048", 256, 32, 8, 128, 128, 2048, configs,
             check=True)
  run_decode(rows, "decode 16 seqs MHA 16/16 D64 1k..32k", 16, 16, 16, 64, 1024, 32768,
             configs, check=True)
  run_write(rows)
  if not args.quick:
    run_mixed(rows, {"default": None})
    run_prefill(rows, {"default": None})
  print_table(rows)
  if args.out:
    with open(args.out, "w") as f:
      json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
  main()
