"""Device time of one attention call, kernel by kernel: jaxkv's varlen call against cuDNN.

`decode.py` times calls from the host (mean of back-to-back calls), which for
a ~0.1 ms call is mostly dispatch. This script traces `--calls` calls of each
case with `jax.profiler.trace` and prints, per call, the GPU busy time and each
kernel's time, so the attention kernel, its XLA glue (item table, q layout,
combine) and cuDNN are compared by what they cost on the GPU, as inside the
serving loop's command buffers. Cases: the e2e model's shapes (32/8 heads of
64): decode of 64 sequences at the uniform workload's contexts, one 2,048-token
causal prefill chunk, and the ANCHORS decode of 64 sequences at D128.

Usage (GPU machine, repository root): PYTHONPATH=. python3 benchmarks/kernel_trace.py
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import decode as bench_decode   # pylint: disable=g-import-not-at-top,wrong-import-position
import profile_step   # pylint: disable=g-import-not-at-top,wrong-import-position
import pallas_kernels   # pylint: disable=wrong-import-position

DTYPE = jnp.bfloat16


def trace_kernels(fn, args, calls):
  """`(busy_us_per_call, {kernel name: (us per call, launches per call)})`."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    events = profile_step.gpu_events(
        jax.profiler.ProfileData.from_file(profile_step.newest_trace(d)))
  time_ = collections.Counter()
  count = collections.Counter()
  for start, end, name in events:
    time_[name] += end - start
    count[name] += 1
  busy = sum(time_.values()) / 1e3 / calls
  return busy, {n: (t / 1e3 / calls, count[n] / calls) for n, t in time_.most_common()}


def _decode_case(num_seqs, head_dim, min_len, max_len, config=None, heads=(32, 8)):
  num_q, num_kv = heads
  lengths = bench_decode.decode_case(num_seqs, num_q, num_kv, head_dim, min_len, max_len)
  k, v = bench_decode.build_cache(jax.random.key(1), lengths, num_kv, head_dim)
  q = jax.random.normal(jax.random.key(2), (num_seqs, num_q, head_dim), DTYPE)
  seq_info, n = bench_decode.decode_plan(lengths)
  jaxkv = (jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None,
                                     scale=head_dim ** -0.5, config=config)),
           (q, k, v, seq_info, n))
  pad = int(k.shape[0])
  # Separate K and V arrays: with one array for both, V's tiles come from L2
  # (read just before as K), which made cuDNN look faster than HBM allows.
  kp = jax.random.normal(jax.random.key(3), (num_seqs, pad, num_kv, head_dim), DTYPE)
  vp = jax.random.normal(jax.random.key(4), (num_seqs, pad, num_kv, head_dim), DTYPE)
  return jaxkv, _cudnn_decode(q, kp, vp, jnp.asarray(lengths))


def _cudnn_decode(q, kp, vp, lengths):
  """cuDNN's decode call: one query per sequence over padded `[B, L, H, D]` K and V,
  reading `lengths` keys each."""
  return (jax.jit(lambda q_, k_, v_, l_: jax.nn.dot_product_attention(
      q_, k_, v_, key_value_seq_lengths=l_, implementation="cudnn")),
          (q[:, None], kp, vp, lengths))


def _ring_decode_case(num_seqs, head_dim, window, width, config=None, heads=(32, 8)):
  """Decode over ring layers of `window + width - 1` rows (a Gemma-style sliding layer):
  histories of 2-4 windows, each token reading its last `window` keys. cuDNN reads the
  same number of keys per sequence from padded `[B, window, H, D]` arrays."""
  num_q, num_kv = heads
  rng = np.random.default_rng(5)
  lengths = rng.integers(2 * window, 4 * window, num_seqs).astype(np.int32)
  rows = window + width - 1
  k, v = bench_decode.build_cache(jax.random.key(1), lengths, num_kv, head_dim, num_rows=rows)
  q = jax.random.normal(jax.random.key(2), (num_seqs, num_q, head_dim), DTYPE)
  seq_info, n = bench_decode.decode_plan(lengths)
  jaxkv = (jax.jit(functools.partial(pallas_kernels.varlen_attention, window=window,
                                     scale=head_dim ** -0.5, config=config)),
           (q, k, v, seq_info, n))
  kp = jax.random.normal(jax.random.key(3), (num_seqs, window, num_kv, head_dim), DTYPE)
  vp = jax.random.normal(jax.random.key(4), (num_seqs, window, num_kv, head_dim), DTYPE)
  return jaxkv, _cudnn_decode(q, kp, vp, jnp.full((num_seqs,), window, jnp.int32))


# Rows of the segment table the prefill and mixed cases pass: "tokens" (one per token, as a
# cache step's) or "segments" (the real rows only, which bounds the kernel's plan:
# `varlen_plan.item_capacity`); set by `--table-rows` before any case is built.
TABLE_ROWS = "tokens"


def _table(seq_info, n_segments):
  return (seq_info[:int(n_segments)] if TABLE_ROWS == "segments" else seq_info), n_segments


def _prefill_case(num_seqs, length, head_dim, config=None):
  k, v = bench_decode.build_cache(jax.random.key(9), np.array([length] * num_seqs), 8, head_dim)
  q = jax.random.normal(jax.random.key(10), (num_seqs * length, 32, head_dim), DTYPE)
  jaxkv = (jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None,
                                     scale=head_dim ** -0.5, config=config)),
           (q, k, v) + _table(*bench_decode.prefill_plan(num_seqs, length)))
  kk = jax.random.normal(jax.random.key(11), (num_seqs, length, 8, head_dim), DTYPE)
  vv = jax.random.normal(jax.random.key(12), (num_seqs, length, 8, head_dim), DTYPE)
  cudnn = (jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True,
                                                                implementation="cudnn")),
           (q.reshape(num_seqs, length, 32, head_dim), kk, vv))
  return jaxkv, cudnn


def _mixed_case(config=None):
  """ANCHORS' mixed step (`decode.mixed_inputs`): one jaxkv call against cuDNN run the way a
  careful user would, one prefill call and one decode call. cuDNN's causal mask is aligned
  top-left, so its prefill call attends each 512-token span to all 2,560 keys, non-causal
  (172 GFLOP where the step has 155: an upper bound, as in ANCHORS.md). Shapes come from
  `mixed_inputs`: its prefill segments lead the table, the decodes follow."""
  q, k, v, seq_info, n, dec_lengths, _, _ = bench_decode.mixed_inputs()
  _, num_q, head_dim = q.shape
  rows, _, num_kv, _ = k.shape
  jaxkv = (jax.jit(functools.partial(pallas_kernels.varlen_attention, window=None,
                                     scale=head_dim ** -0.5, config=config)),
           (q, k, v) + _table(seq_info, n))
  info = np.asarray(seq_info)[:int(n)]
  prefill = info[info[:, 1] > 1]                      # (q_start, q_len, col, pos0, kind)
  spans, span_len = len(prefill), int(prefill[0, 1])
  span_keys = int(prefill[0, 3]) + span_len
  num_dec = len(dec_lengths)
  qp = q[:spans * span_len].reshape(spans, span_len, num_q, head_dim)
  qd = q[spans * span_len:spans * span_len + num_dec][:, None]
  keys = jax.random.split(jax.random.key(13), 4)
  kp, vp = (jax.random.normal(key, (spans, span_keys, num_kv, head_dim), DTYPE)
            for key in keys[:2])
  kd, vd = (jax.random.normal(key, (num_dec, rows, num_kv, head_dim), DTYPE)
            for key in keys[2:])

  def two_calls(qp_, kp_, vp_, qd_, kd_, vd_, lengths):
    pre = jax.nn.dot_product_attention(qp_, kp_, vp_, implementation="cudnn")
    dec = jax.nn.dot_product_attention(qd_, kd_, vd_, key_value_seq_lengths=lengths,
                                       implementation="cudnn")
    return pre, dec

  cudnn = (jax.jit(two_calls), (qp, kp, vp, qd, kd, vd, jnp.asarray(dec_lengths)))
  return jaxkv, cudnn


CASES = {
    "mixed 8x512 over 2048 + 56 decodes 32/8 D128": _mixed_case,
    "decode 64 seqs 32/8 D64 128..2304": lambda config=None: _decode_case(64, 64, 128, 2304,
                                                                          config),
    "decode 64 seqs 32/8 D64 8..272": lambda config=None: _decode_case(64, 64, 8, 272, config),
    "decode 256 seqs 32/8 D64 128..2048": lambda config=None: _decode_case(256, 64, 128, 2048,
                                                                           config),
    "prefill 1x2048 32/8 D64": lambda config=None: _prefill_case(1, 2048, 64, config),
    "prefill 4x512 32/8 D64": lambda config=None: _prefill_case(4, 512, 64, config),
    # Issue 12's causal prefill rows.
    "prefill 1x16384 32/8 D128": lambda config=None: _prefill_case(1, 16384, 128, config),
    "prefill 4x4096 32/8 D128": lambda config=None: _prefill_case(4, 4096, 128, config),
    # Head dims in column parts (`varlen_kernel_sm90.column_parts`): 64 + 32 and 64 + 16.
    "prefill 4x4096 32/8 D96": lambda config=None: _prefill_case(4, 4096, 96, config),
    "prefill 4x4096 32/8 D80": lambda config=None: _prefill_case(4, 4096, 80, config),
    "decode 64 seqs 32/8 D128 512..8192": lambda config=None: _decode_case(64, 128, 512, 8192,
                                                                           config),
    # Issue 12's other two decode rows: many short histories, and few long multi-head ones.
    "decode 256 seqs 32/8 D128 128..2048": lambda config=None: _decode_case(
        256, 128, 128, 2048, config),
    "decode 16 seqs 16/16 D64 1024..32768": lambda config=None: _decode_case(
        16, 64, 1024, 32768, config, heads=(16, 16)),
    # Ring layers whose rows are not a multiple of 8 (window + W - 1), read in place
    # (`varlen_attention_sm90.reads_in_place`) or copied with zero rows (variant "padded copy").
    "decode 64 seqs 32/8 D128 ring 1024 rows 1087": lambda config=None: _ring_decode_case(
        64, 128, 1024, 64, config),
    "decode 64 seqs 32/8 D64 ring 512 rows 575": lambda config=None: _ring_decode_case(
        64, 64, 512, 64, config),
    "decode 64 seqs 16/8 D256 ring 1024 rows 1087": lambda config=None: _ring_decode_case(
        64, 256, 1024, 64, config, heads=(16, 8)),
}
# Issue 12's head layouts the compiled kernel serves since the head-layout round: GQA
# groups that do not divide the 64-row q tile (Qwen2.5-7B: 28/4 = 7; 40/8 = 5; 24/4 = 6;
# 12/4 = 3) and head dims 80 and 96 (32-/64-byte swizzles), against cuDNN. Name:
# (q heads, KV heads, head dim, shortest, longest history), 64 decode sequences each.
_LAYOUTS = {
    "decode 64 seqs 28/4 D128 512..8192 (G7)": (28, 4, 128, 512, 8192),
    "decode 64 seqs 40/8 D128 512..8192 (G5)": (40, 8, 128, 512, 8192),
    "decode 64 seqs 24/4 D128 512..8192 (G6)": (24, 4, 128, 512, 8192),
    "decode 64 seqs 12/4 D128 512..8192 (G3)": (12, 4, 128, 512, 8192),
    "decode 64 seqs 32/32 D80 512..4096": (32, 32, 80, 512, 4096),
    "decode 64 seqs 32/32 D96 512..4096": (32, 32, 96, 512, 4096),
    "decode 64 seqs 32/8 D96 512..8192": (32, 8, 96, 512, 8192),
    "decode 64 seqs 32/8 D80 512..8192": (32, 8, 80, 512, 8192),
    # Three column parts (64 + 32 + 16).
    "decode 64 seqs 32/8 D112 512..8192": (32, 8, 112, 512, 8192),
    # Gemma-2-9B's attention (16 q heads over 8 KV heads of 256): q in 128-column parts.
    "decode 64 seqs 16/8 D256 512..8192 (G2)": (16, 8, 256, 512, 8192),
}


def _layout_case(q_heads, kv_heads, head_dim, lo, hi):
  return lambda config=None: _decode_case(64, head_dim, lo, hi, config, heads=(q_heads, kv_heads))


CASES.update({name: _layout_case(*shape) for name, shape in _LAYOUTS.items()})
LAYOUT_CASES = list(_LAYOUTS)


def sweep(calls):
  """GPU time of the decode kernel under other tile, stage, split and grid settings."""
  from pallas_kernels import config as kc   # pylint: disable=g-import-not-at-top
  import dataclasses   # pylint: disable=g-import-not-at-top
  for name, (seqs, d, lo, hi) in {"D64 64 seqs 128..2304": (64, 64, 128, 2304),
                                  "D128 64 seqs 512..8192": (64, 128, 512, 8192),
                                  "D64 256 seqs 128..2048": (256, 64, 128, 2048)}.items():
    base = kc.default_varlen_attention_config(group=4, head_dim=d, interpret=False)
    variants = {"default": base,
                "stages 3": dataclasses.replace(base, num_stages=3),
                "stages 4": dataclasses.replace(base, num_stages=4),
                "no splits": dataclasses.replace(base, max_splits=1),
                "split_len 1024": dataclasses.replace(base, split_len=1024),
                "programs 528": dataclasses.replace(base, max_programs=528),
                "programs 2112": dataclasses.replace(base, max_programs=2112)}
    if d == 64:
      variants["block_k 256"] = dataclasses.replace(base, block_k=256)
      variants["block_k 256 stages 3"] = dataclasses.replace(base, block_k=256, num_stages=3)
    for vname, cfg in variants.items():
      try:
        (fn, fargs), _ = _decode_case(seqs, d, lo, hi, config=cfg)
        busy, kernels = trace_kernels(fn, fargs, calls)
        mosaic = sum(us for k, (us, _) in kernels.items() if "mosaic" in k)
        print(f"sweep {name} | {vname}: busy {busy:.1f} us, kernel {mosaic:.1f} us")
      except Exception as e:  # pylint: disable=broad-except
        print(f"sweep {name} | {vname}: {type(e).__name__}: {str(e)[:150]}")


# Config variants of the kernel: changes to the case's default `VarlenAttentionConfig`.
VARIANTS = {
    "defaults": {},
    # Tiles that need no mask in a loop of their own, or one loop choosing per tile, at
    # every head dim (`full_tile_loop`; the default picks by head dim).
    "one tile loop": dict(full_tile_loop=False),
    "three tile loops": dict(full_tile_loop=True),
    # 128-row K/V tiles (the D64 default) for head dims whose default is 64 rows, with two
    # or three stages.
    "128-key tiles": dict(block_k=128),
    "128-key tiles 3 stages": dict(block_k=128, num_stages=3),
}


def variants(names, calls, cases):
  """GPU time of the attention call per config variant, cuDNN beside each case; every
  variant's output is compared with the first's."""
  import dataclasses   # pylint: disable=g-import-not-at-top
  from pallas_kernels import config as kc   # pylint: disable=g-import-not-at-top
  unknown = [name for name in names if name not in VARIANTS]
  if unknown:
    raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
  for name in cases:
    (_, _), (cfn, cargs) = CASES[name]()
    busy, _ = trace_kernels(cfn, cargs, calls)
    print(f"variant {name} | cuDNN: busy {busy:.1f} us")
    first = None   # the first variant's output, which every other variant's is compared with
    for vname in names:
      changes = VARIANTS[vname]
      try:
        config = None
        if changes:
          d = int(re.search(r" D(\d+)", name).group(1))
          config = dataclasses.replace(
              kc.default_varlen_attention_config(group=4, head_dim=d, interpret=False),
              **changes)
        (fn, fargs), _ = CASES[name](config=config)
        busy, kernels = trace_kernels(fn, fargs, calls)
        mosaic = sum(us for k, (us, _) in kernels.items() if "mosaic" in k)
        out = np.asarray(fn(*fargs).astype(jnp.float32))
        first = out if first is None else first
        print(f"variant {name} | {vname}: busy {busy:.1f} us, kernel {mosaic:.1f} us, "
              f"{len(kernels)} kernel names, max |output - first variant's| "
              f"{float(np.max(np.abs(out - first))):.3g}")
      except Exception as e:  # pylint: disable=broad-except
        print(f"variant {name} | {vname}: {type(e).__name__}: {str(e)[:150]}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--cases", default=",".join(CASES),
                 help="comma-separated case names, or 'layouts' for issue 12's head layouts")
  p.add_argument("--top", type=int, default=8)
  p.add_argument("--sweep", action="store_true", help="decode kernel settings only")
  p.add_argument("--variants", default=None,
                 help=f"comma-separated config variants of {list(VARIANTS)}")
  p.add_argument("--table-rows", choices=("tokens", "segments"), default="tokens",
                 help="segment table rows of the prefill and mixed cases: one per token (as "
                      "a cache step's) or the real segments only")
  args = p.parse_args(argv)
  global TABLE_ROWS   # pylint: disable=global-statement
  TABLE_ROWS = args.table_rows
  if args.variants:
    variants(args.variants.split(","), args.calls, args.cases.split(","))
    return 0
  if args.sweep:
    sweep(args.calls)
    return 0
  names = LAYOUT_CASES if args.cases == "layouts" else args.cases.split(",")
  summary = []
  for name in names:
    (jfn, jargs), (cfn, cargs) = CASES[name]()
    # K and V bytes a decode call must read: every sequence's history, all KV heads.
    kv_bytes = None
    if name.startswith("decode"):
      lengths = np.asarray(cargs[3])
      kv_bytes = 2 * int(lengths.sum()) * cargs[1].shape[2] * cargs[1].shape[3] * 2
    row = {}
    for label, fn, fargs in (("jaxkv", jfn, jargs), ("cuDNN", cfn, cargs)):
      try:
        busy, kernels = trace_kernels(fn, fargs, args.calls)
      except Exception as e:  # pylint: disable=broad-except
        print(f"\n{name} | {label}: {type(e).__name__}: {str(e)[:200]}")
        continue
      main_kernel = sum(us for k, (us, _) in kernels.items()
                        if ("mosaic" in k if label == "jaxkv" else "sdpa" in k or "fmha" in k))
      row[label] = (busy, main_kernel)
      print(f"\n{name} | {label}: GPU busy {busy:.1f} us/call, "
            f"{sum(c for _, c in kernels.values()):.0f} kernels/call")
      for kname, (us, c) in list(kernels.items())[:args.top]:
        print(f"   {us:8.1f} us  x{c:4.1f}  {kname[:100]}")
    summary.append((name, row, kv_bytes))
  print("\nsummary (GPU time per call; TB/s = K/V bytes / attention kernel time)")
  for name, row, kv_bytes in summary:
    parts = []
    for label, (busy, kernel) in row.items():
      rate = f", {kv_bytes / kernel / 1e6:.2f} TB/s" if kv_bytes and kernel else ""
      parts.append(f"{label} kernel {kernel:.1f} us (call {busy:.1f}){rate}")
    print(f"  {name}: " + "; ".join(parts))
  return 0


if __name__ == "__main__":
  sys.exit(main())
