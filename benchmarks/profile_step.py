"""Where a serving step's time goes: device traces of the engine and the padded loop.

Runs the e2e model (Llama-3.2-1B shape, bf16, random weights) through
`jaxkv.serve.Engine` and through the padded cuDNN loop of `benchmarks/e2e.py`
on one GPU, under `jax.profiler.trace`, and summarises each trace from its
XSpace (`jax.profiler.ProfileData`): steps, wall time per step, GPU kernel time
per step (the sum of kernel durations), kernels launched per step, the idle
fraction of the GPU (wall minus busy: launch and host gaps), and the kernels
that take the most time, grouped by a coarse category of their name.

Usage (GPU machine, repository root):
  PYTHONPATH=. python3 benchmarks/profile_step.py [--out DIR] [--small]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import e2e   # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import serve   # pylint: disable=wrong-import-position
from jaxkv.serve.state import init_loop_state, pack_queue   # pylint: disable=wrong-import-position
from jaxkv.serve.admission import plain_greedy   # pylint: disable=wrong-import-position

# Kernel name fragments -> category (first match wins; names are XLA fusion / custom-call names).
_CATEGORIES = (
    ("attention (Mosaic GPU)", ("mosaic", "_attention_kernel", "attention_kernel")),
    ("kv_write (Mosaic GPU)", ("kv_write",)),
    ("cuDNN attention", ("cudnn", "fmha", "flash")),
    ("matmul (cuBLAS/triton gemm)", ("gemm", "cublas", "sm90_xmma", "nvjet", "cutlass", "triton_gemm",
                                     "dot")),
    ("sort / top-k", ("sort", "topk")),
    ("reduce", ("reduce", "argmax")),
    ("scatter / gather / dus", ("scatter", "gather", "dynamic_update_slice", "dynamic-update-slice",
                                "dynamic_slice")),
    ("copy / memset", ("copy", "memset", "memcpy")),
    ("other fusions", ("fusion",)),
)


def _category(name: str) -> str:
  low = name.lower()
  for cat, keys in _CATEGORIES:
    if any(k in low for k in keys):
      return cat
  return "other"


def newest_trace(trace_dir: str) -> str | None:
  """The newest `*.xplane.pb` under `trace_dir` (None if there is none)."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  return paths[-1] if paths else None


def gpu_events(data) -> list[tuple[int, int, str]]:
  """`(start_ns, end_ns, name)` of every event on a GPU stream line of a read trace
  (`jax.profiler.ProfileData`)."""
  return [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name)
          for plane in data.planes if plane.name.startswith("/device:GPU")
          for line in plane.lines if "stream" in line.name.lower()
          for ev in line.events]


def host_calls(data, steps: int) -> dict:
  """Where the host's time goes per step: CUDA API calls and XLA thunks (names, ms, count).

  Tells a host-bound loop (the executor launching kernels, graphs and copies one
  by one, slower than the GPU runs them) from a GPU-bound one. Events nest, so
  the rows overlap; compare each row with the step time. `data`: the trace, read
  (`jax.profiler.ProfileData`).
  """
  api, thunks = collections.Counter(), collections.Counter()
  api_n, thunk_n = collections.Counter(), collections.Counter()
  for plane in data.planes:
    if plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      for ev in line.events:
        name = ev.name
        if name.startswith("cu") and name[2:3].isupper():   # CUDA driver/runtime API
          api[name] += ev.duration_ns
          api_n[name] += 1
        elif "Thunk" in name:
          thunks[name[:60]] += ev.duration_ns
          thunk_n[name[:60]] += 1
  per = lambda c, n: [(k, t / 1e6 / max(steps, 1), n[k] / max(steps, 1))
                      for k, t in c.most_common(15)]
  return {"cuda_api": per(api, api_n), "thunks": per(thunks, thunk_n)}


def summarize(trace_dir: str, steps: int, label: str) -> dict:
  """GPU kernel statistics of the newest trace under `trace_dir`."""
  path = newest_trace(trace_dir)
  if path is None:
    return {"label": label, "error": "no xplane.pb written"}
  data = jax.profiler.ProfileData.from_file(path)   # read once: GPU and host events
  kernels = gpu_events(data)
  if not kernels:
    return {"label": label, "error": "no GPU events"}
  kernels.sort()
  wall = (kernels[-1][1] - kernels[0][0]) / 1e6
  # Busy time: the union of kernel intervals (streams may overlap).
  busy, cur_s, cur_e = 0, kernels[0][0], kernels[0][1]
  for s, e, _ in kernels[1:]:
    if s > cur_e:
      busy += cur_e - cur_s
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  busy += cur_e - cur_s
  # Idle GPU time, charged to the kernel the gap follows (and the one it precedes):
  # where the stream waits for the host (a predicate read back, a launch).
  gap_after, gap_pairs = collections.Counter(), collections.Counter()
  gaps = []   # every gap: (ns, previous kernel, next kernel)
  run_end = kernels[0][1]
  for (s, e, n), (_, _, prev) in zip(kernels[1:], kernels[:-1]):
    if s > run_end:
      gap_after[prev] += s - run_end
      gap_pairs[(prev[:40], n[:40])] += s - run_end
      gaps.append((s - run_end, prev[:40], n[:40]))
    run_end = max(run_end, e)
  # Gaps by size class: many short ones (launch latency inside a CUDA graph) tell a
  # different story from a few long ones (the GPU waiting for the host).
  classes = [(0, 2e3), (2e3, 10e3), (10e3, 100e3), (100e3, float("inf"))]
  gap_classes = [(f"{lo / 1e3:g}-{hi / 1e3:g} us", sum(1 for g, _, _ in gaps if lo <= g < hi) / max(steps, 1),
                  sum(g for g, _, _ in gaps if lo <= g < hi) / 1e6 / max(steps, 1))
                 for lo, hi in classes]
  by_name = collections.Counter()
  count = collections.Counter()
  by_cat = collections.Counter()
  for s, e, n in kernels:
    by_name[n] += e - s
    count[n] += 1
    by_cat[_category(n)] += e - s
  out = {
      "label": label, "steps": steps, "kernels": len(kernels),
      "kernels_per_step": len(kernels) / max(steps, 1),
      "gpu_span_ms": wall, "gpu_busy_ms": busy / 1e6,
      "busy_ms_per_step": busy / 1e6 / max(steps, 1),
      "span_ms_per_step": wall / max(steps, 1),
      "idle_fraction": 1 - busy / 1e6 / wall if wall else 0.0,
      "categories_ms_per_step": {c: t / 1e6 / max(steps, 1) for c, t in by_cat.most_common()},
      "idle_after": [(n[:90], t / 1e6 / max(steps, 1)) for n, t in gap_after.most_common(12)],
      "idle_pairs": [(f"{a} -> {b}", t / 1e6 / max(steps, 1))
                     for (a, b), t in gap_pairs.most_common(12)],
      "top": [(n[:90], t / 1e6 / max(steps, 1), count[n] / max(steps, 1))
              for n, t in by_name.most_common(25)],
      "all": [(n, t / 1e6 / max(steps, 1), count[n] / max(steps, 1))
              for n, t in by_name.most_common()],
      "host": host_calls(data, steps),
      "gap_classes": gap_classes,
      "largest_gaps": [(g / 1e3, a, b) for g, a, b in sorted(gaps, reverse=True)[:15]],
      # The 10-100 us gaps (the GPU waiting on something other than a launch), by neighbours.
      "mid_gaps": [(f"{a} -> {b}", k / max(steps, 1), t / 1e6 / max(steps, 1)) for (a, b), (k, t) in
                   sorted(_group_gaps(gaps, 10e3, 100e3).items(), key=lambda kv: -kv[1][1])[:12]],
  }
  return out


def _group_gaps(gaps, lo, hi) -> dict:
  """`{(previous, next): (count, total ns)}` of the gaps in `[lo, hi)` ns."""
  out = {}
  for g, a, b in gaps:
    if lo <= g < hi:
      k, t = out.get((a, b), (0, 0))
      out[(a, b)] = (k + 1, t + g)
  return out


def _print(summary: dict) -> None:
  print(f"\n=== {summary['label']}")
  if "error" in summary:
    print("  ", summary["error"])
    return
  print(f"  steps {summary['steps']}, kernels/step {summary['kernels_per_step']:.0f}, GPU span "
        f"{summary['span_ms_per_step']:.3f} ms/step, busy {summary['busy_ms_per_step']:.3f} ms/step, "
        f"idle {100 * summary['idle_fraction']:.0f}%")
  for c, t in summary["categories_ms_per_step"].items():
    print(f"    {c:32s} {t:8.3f} ms/step")
  print("  top kernels (ms/step, launches/step):")
  for n, t, k in summary["top"][:18]:
    print(f"    {t:7.3f} {k:6.1f}  {n}")
  print("  GPU idle after (ms/step):")
  for n, t in summary.get("idle_after", []):
    print(f"    {t:7.3f}  {n}")
  print("  GPU idle between (ms/step):")
  for n, t in summary.get("idle_pairs", []):
    print(f"    {t:7.3f}  {n}")
  print("  GPU gaps by size (per step: count, ms):")
  for label, k, t in summary.get("gap_classes", []):
    print(f"    {label:16s} {k:8.1f} {t:8.3f}")
  print("  10-100 us gaps by neighbours (per step: count, ms):")
  for pair, k, t in summary.get("mid_gaps", []):
    print(f"    {k:6.2f} {t:7.3f}  {pair}")
  print("  largest single gaps (us, after -> before):")
  for g, a, b in summary.get("largest_gaps", []):
    print(f"    {g:9.1f}  {a} -> {b}")
  for kind in ("cuda_api", "thunks"):
    print(f"  host {kind} (ms/step, calls/step; nested events overlap):")
    for n, t, k in summary.get("host", {}).get(kind, []):
      print(f"    {t:7.3f} {k:7.1f}  {n}")


def _time_and_trace(engine, requests, trace_dir: str, label: str):
  """Times a warm run of `requests` (untraced), then traces one more; `(timing, summary)`."""
  engine.run(requests)   # compile and warm up
  t0 = time.perf_counter()
  engine.run(requests)
  dt = time.perf_counter() - t0
  st = engine.stats
  print(f"{label}: {dt:.3f} s, {st.steps} steps, {1e3 * dt / st.steps:.3f} ms/step, "
        f"{st.step_tokens / dt:.0f} step tokens/s, {st.loop_entries} loop entries")
  with jax.profiler.trace(trace_dir):
    engine.run(requests)
  timing = {"seconds": dt, "steps": st.steps, "ms_per_step": 1e3 * dt / st.steps}
  return timing, summarize(trace_dir, engine.stats.steps, label)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="/tmp/jaxkv_profile")
  p.add_argument("--small", action="store_true")
  p.add_argument("--widths", default="512", help="engine W values to time, comma-separated")
  p.add_argument("--decode-only", action="store_true", help="skip the prefill and padded traces")
  p.add_argument("--prefill-only", action="store_true",
                 help="trace only the prefill-heavy workload (no decode or padded traces)")
  p.add_argument("--uniform", action="store_true",
                 help="trace e2e.py's uniform workload instead (64 prompts 128..2048, W = "
                 "--uniform-width): its prefill phase alone (max_tokens 1), the whole run, "
                 "and the padded loop's prefill")
  p.add_argument("--uniform-width", type=int, default=2048,
                 help="with --uniform: the engine's W (e2e.py --max-write)")
  p.add_argument("--describe", default=None, metavar="KERNELS_TXT",
                 help="with --uniform: only compile the loop and describe the fusions named in "
                 "this kernel list (a kernels_*.txt of an earlier --dump-hlo run)")
  p.add_argument("--page-size", type=int, default=0,
                 help="also trace each width over paged storage of this page size (same weights)")
  p.add_argument("--padded", action="store_true",
                 help="with --decode-only: trace the padded loop on the decode-heavy workload too")
  p.add_argument("--requests", type=int, default=64,
                 help="decode-heavy workload: requests (and slots, so a decode step's rows)")
  p.add_argument("--dump-hlo", action="store_true", help="write the loop's optimized HLO and "
                 "every kernel's launches and time per step under --out")
  args = p.parse_args(argv)
  if args.requests < 1:
    p.error(f"--requests must be at least 1, got {args.requests}")
  cfg = e2e._model_config(args.small)   # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  n_req, new = (args.requests, 128) if not args.small else (6, 8)
  short = [rng.integers(0, cfg.vocab_size, size=int(n)).astype(np.int32).tolist()
           for n in rng.integers(8, 17, size=n_req)]
  long_ = [rng.integers(0, cfg.vocab_size, size=2000 if not args.small else 40)
           .astype(np.int32).tolist() for _ in range(16 if not args.small else 2)]
  results = {}

  def trace(engine, reqs, tag, label):
    """Times and traces one workload on `engine`; prints it and keeps its kernel list."""
    results[tag], summary = _time_and_trace(engine, reqs, os.path.join(args.out, tag), label)
    results[summary["label"]] = summary
    _print(summary)
    if args.dump_hlo:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, f"kernels_{tag}.txt"), "w") as f:
        for name, t, k in summary.get("all", []):
          f.write(f"{k:8.2f} {t:8.4f} {name}\n")

  if args.uniform:
    _trace_uniform(cfg, args, trace)
  else:
    _trace_serving(cfg, args, trace, results, short, long_, n_req, new)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "profile.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  return 0


def _trace_serving(cfg, args, trace, results, short, long_, n_req, new):
  """The decode-heavy and prefill-heavy workloads at each `--widths` (and over pages
  with `--page-size`), then the padded loop on the decode-heavy one."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  decode_reqs = [serve.Request(tuple(q), serve.SamplingParams(max_tokens=new)) for q in short]
  prefill_reqs = [serve.Request(tuple(q), serve.SamplingParams(max_tokens=4)) for q in long_]
  for width in [int(w) for w in args.widths.split(",")]:
    rows = 2048 + 256
    # Every sequence is capped at the columns' rows, so pages get the same split bound.
    cache = cfg.cache_config(capacity=max(64, n_req) * (2048 + 256), max_seqs=n_req,
                             max_write=width,
                             kv_dtype=jnp.bfloat16, initial_capacity=rows, max_seq_len=rows)
    storages = [("engine", "", cache)]
    if args.page_size:
      storages.append((f"paged{args.page_size}", f" over pages of {args.page_size}",
                       dataclasses.replace(cache, page_size=args.page_size)))
    for prefix, what, storage in storages:
      model = e2e.Decoder(cfg, storage, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                          rngs=nnx.Rngs(0))
      engine = serve.Engine(model, max_len=2048 + 256)
      if not args.prefill_only:
        trace(engine, decode_reqs, f"{prefix}_W{width}_decode",
              f"engine W={width}{what}, decode-heavy ({n_req} x 8..16 + {new})")
        if args.dump_hlo:   # loop_W{width}.hlo.txt for the columns, loop_paged{P}_W... for pages
          name = f"loop_W{width}.hlo.txt" if not what else f"loop_{prefix}_W{width}.hlo.txt"
          with open(os.path.join(args.out, name), "w") as f:
            f.write(_compiled_loop(engine, storage, short, decode_reqs))
      if width >= 512 and not args.decode_only:
        trace(engine, prefill_reqs, f"{prefix}_W{width}_prefill",
              f"engine W={width}{what}, prefill-heavy (16 x 2000 + 4)")
      del engine, model
  if args.padded or not (args.decode_only or args.prefill_only):
    _trace_padded(cfg, short, new, args.out, results)


def _trace_uniform(cfg, args, trace):
  """e2e.py's uniform workload (same seed, prompts and cache) on a W = `--uniform-width`
  engine, traced twice: the prefill phase alone (every request asks for one token, so every
  step is a prompt step) and the whole run (256 new tokens); then the padded loop's
  prefill, timed and traced, for the same prompts."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  n, new = (64, 256) if not args.small else (6, 8)
  lo, hi = (128, 2048) if not args.small else (4, 40)
  lens = rng.integers(lo, hi + 1, size=n)
  prompts = e2e.random_prompts(rng, cfg, lens)
  width = args.uniform_width if not args.small else 32
  cache = e2e.workload_cache(cfg, prompts, [new] * n, slots=n, max_write=width)
  model = e2e.Decoder(cfg, cache, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  engine = serve.Engine(model, max_len=int(max(lens)) + new)
  if args.describe:
    reqs = [serve.Request(tuple(p), serve.SamplingParams(max_tokens=new)) for p in prompts]
    _describe_loop(engine, cache, prompts, reqs, os.path.dirname(args.describe) or ".",
                   os.path.basename(args.describe))
    return
  for tokens, tag in ((1, "prefill"), (new, "full")):
    reqs = [serve.Request(tuple(p), serve.SamplingParams(max_tokens=tokens)) for p in prompts]
    trace(engine, reqs, f"uniform_W{width}_{tag}",
          f"engine W={width}, uniform {tag} ({n} prompts {lo}..{hi}, max_tokens {tokens})")
    if args.dump_hlo and tag == "full":
      _describe_loop(engine, cache, prompts, reqs, args.out, f"kernels_uniform_W{width}_{tag}.txt")
  tdir = os.path.join(args.out, "padded_full")
  with jax.profiler.trace(tdir):
    e2e.run_baseline(cfg, model, prompts, new)
  _print(summarize(tdir, 2 * new, f"padded loop, uniform prompts + {new} tokens (warm-up + timed "
                   "run traced; prefill kernels included)"))
  r, _ = e2e.run_baseline(cfg, model, prompts, 1)
  print(f"padded prefill of the same prompts: {r['prefill_seconds']:.3f} s "
        f"({r['padded_prefill_tokens']} padded tokens, {r['attention']})")
  tdir = os.path.join(args.out, "padded_prefill")
  with jax.profiler.trace(tdir):
    e2e.run_baseline(cfg, model, prompts, 1)
  s = summarize(tdir, 2, "padded loop, prefill of the uniform prompts (warm-up + timed run traced; "
                "'per step' = per run)")
  _print(s)


def _compiled_loop(engine, cache, prompts, reqs) -> str:
  """The optimized HLO text of the loop `Engine.run` picks for `reqs` (greedy ones: the
  loop without the sampler's cond), compiled for a queue of `prompts`."""
  queue = pack_queue([tuple(p) for p in prompts], [r.params for r in reqs],
                     max_len=engine.max_len, max_stop=engine.max_stop)
  ls = init_loop_state(cache, queue, num_widths=len(engine.widths))
  greedy = all(plain_greedy(r.params) for r in reqs)
  return engine.lower(ls, 1, greedy=greedy).compile().as_text()


def _describe_loop(engine, cache, prompts, reqs, out, kernel_file, top=40):
  """Prints what each of the traced loop's busiest XLA fusions computes (from the
  compiled loop's HLO): its shape and the ops of its fused computation."""
  import re   # pylint: disable=g-import-not-at-top
  text = _compiled_loop(engine, cache, prompts, reqs)
  comps = {}
  for block in re.split(r"\n(?=\S)", text):
    head = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
    if head:
      comps[head.group(1)] = block
  with open(os.path.join(out, kernel_file)) as f:
    names = [line.split(None, 2)[2].strip() for line in f][:top]
  print("\n=== what the busiest kernels compute (compiled loop HLO)")
  for name in names:
    # Trace names are HLO names with the numeric suffix's "." written as "_".
    hlo_name = re.sub(r"_(\d+)$", r".\1", name)
    m = re.search(r"%?" + re.escape(hlo_name) + r" = (.*?) fusion\((.*?)\), kind=(\w+), "
                  r"calls=%?([\w.\-]+)", text) or re.search(
                      r"%?" + re.escape(name) + r" = (.*?) fusion\((.*?)\), kind=(\w+), "
                      r"calls=%?([\w.\-]+)", text)
    if not m:
      continue
    body = comps.get(m.group(4), "")
    ops = re.findall(r"= (\S+) ([a-z][\w\-]*)\(", body)
    print(f"  {name}: {m.group(1)[:80]} ({m.group(3)}) <- "
          + ", ".join(f"{op}:{shape[:28]}" for shape, op in ops
                      if op not in ("parameter", "constant"))[:600])


def _trace_padded(cfg, short, new, out, results):
  """The padded loop on the decode-heavy workload: timed, then traced."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  cache = cfg.cache_config(capacity=max(64, len(short)) * 512, max_seqs=len(short),
                           max_write=max(64, len(short)),
                           kv_dtype=jnp.bfloat16, initial_capacity=512)
  model = e2e.Decoder(cfg, cache, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  r, _ = e2e.run_baseline(cfg, model, short, new)
  print(f"padded decode-heavy: {r['ms_per_decode_step']:.3f} ms/decode step ({r['attention']})")
  tdir = os.path.join(out, "padded_decode")
  with jax.profiler.trace(tdir):
    e2e.run_baseline(cfg, model, short, new)
  s = summarize(tdir, 2 * new, "padded loop, decode-heavy (warm-up + timed run traced)")
  results[s["label"]] = s
  _print(s)


if __name__ == "__main__":
  raise SystemExit(main())
