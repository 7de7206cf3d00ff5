"""End-to-end serving: jaxkv's jitted continuous-batching engine vs a padded dense cache.

A ~1B-parameter Llama-style model (Llama 3.2 1B shape: 16 layers, width 2048,
32 query / 8 KV heads of 64, MLP 8192, tied 128256 vocabulary) with random bf16
weights serves 64 requests whose prompts are drawn uniformly from 128..2048
tokens (seed 0), 256 greedy new tokens each.

- **jaxkv**: `jaxkv.serve.Engine` (chunked prefill mixed with decode in one
  `W`-wide step, the multi-step loop in one `jax.jit`; steps of at most 64
  tokens run the dense layers on 64 rows, `jaxkv.nnx.bucketed`), attention through
  `jaxkv.pure.attend` with `implementation=None` (the Mosaic GPU kernels on a
  Hopper GPU, else the reference; the script reports which).
- **padded baseline**: the same weights with a dense cache `[64, max_len, 8, 64]`
  per layer: one prefill of every prompt right-padded to the longest, then 256
  decode steps in one jitted `fori_loop`, attention by
  `jax.nn.dot_product_attention(implementation="cudnn")` with per-sequence
  lengths (falls back to "xla" where cuDNN is unavailable, and says so).

Reported: wall time (compilation excluded: each path is warmed up on the same
shapes first), generated tokens/s, ms per step, and the speed-up.

Usage: python benchmarks/e2e.py [--workload uniform|mixed|decode] [--small] [--out results.json]

Every run also measures the copy ceiling and the dense matmul rate and prints the
workload's roofline beside each measured row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxkv   # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv.models import Decoder, ModelConfig   # pylint: disable=wrong-import-position
from jaxkv import serve   # pylint: disable=wrong-import-position
from jaxkv.nnx import apply_rope, rope_inv_freq   # pylint: disable=wrong-import-position
import decode as decode_bench   # pylint: disable=g-import-not-at-top,wrong-import-position


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--requests", type=int, default=64)
  p.add_argument("--prompt-min", type=int, default=128)
  p.add_argument("--prompt-max", type=int, default=2048)
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--max-write", type=int, default=512, help="jaxkv step width W")
  p.add_argument("--implementation", default=None, help="jaxkv attention (default None)")
  p.add_argument("--gemm", default=None, choices=["xla", "mosaic_gpu"],
                 help="jaxkv's decode-width o/down GEMM (default None: mosaic_gpu on Hopper)")
  p.add_argument("--bucket", type=int, default=0,
                 help="jaxkv: steps of at most this many tokens run the dense layers on that "
                      "many rows inside a lax.cond (default 0 = off: the engine's narrow "
                      "compiled widths do this without a cond)")
  p.add_argument("--workload", choices=["uniform", "mixed", "decode"], default="uniform",
                 help="uniform: prompts uniform in --prompt-min..--prompt-max, --new-tokens each, "
                      "against the padded loop; mixed: 256 requests with lognormal prompt and "
                      "output lengths, 64 slots, against static batching; decode: 64 requests of "
                      "8..16-token prompts (decode-only steps) against the padded loop")
  p.add_argument("--slots", type=int, default=64, help="mixed: engine columns / static batch")
  p.add_argument("--data-parallel", type=int, default=0,
                 help="also serve with jaxkv.serve.DataParallelEngine over this many devices "
                      "and report its speed-up over one device (same process)")
  p.add_argument("--small", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--paged", type=int, default=0, metavar="PAGE_SIZE",
                 help="also serve jaxkv over paged storage of the same capacity (same weights)")
  p.add_argument("--paged-slots", type=int, default=0, metavar="SLOTS",
                 help="with --paged: also serve over pages holding the columns' K/V bytes "
                      "(`paged_cache_config`) with SLOTS columns: requests in flight for the same memory")
  p.add_argument("--paged-repeats", type=int, default=0, metavar="N",
                 help="with --paged: then time N more runs of each storage, alternating columns "
                      "and pages in this process, and report the mean, spread and ratio of means "
                      "(one run each differs by a few percent between processes)")
  p.add_argument("--also-compiler-options", default=None, metavar="JSON",
                 help="also run the baseline and jaxkv compiled with these XLA options (e.g. "
                      "'{\"xla_gpu_enable_triton_gemm\": false}'), beside XLA's defaults")
  p.add_argument("--also-widths", default=None, metavar="W,w,...",
                 help="also serve the workload with these compiled step widths (descending, the "
                      "first --max-write), in this process, and compare with the default widths")
  p.add_argument("--also-fcfs", action="store_true",
                 help="also serve jaxkv with first-come-first-served admission (Engine.run's "
                      "default admits the longest max_tokens first) in this process")
  p.add_argument("--also-sorted-static", action="store_true",
                 help="mixed: also time static batching over the queue sorted by output length "
                      "(batches of similar lengths: the strongest static schedule)")
  p.add_argument("--mixed-requests", type=int, default=256,
                 help="mixed: number of requests (more requests: a throughput-bound queue)")
  p.add_argument("--skip-baseline", action="store_true")
  p.add_argument("--skip-jaxkv", action="store_true")
  p.add_argument("--out", default=None, help="write the results as JSON here")
  args = p.parse_args(argv)
  if args.paged_slots and not args.paged:
    p.error("--paged-slots needs --paged PAGE_SIZE")
  if args.paged_repeats < 0 or (args.paged_repeats and not args.paged):
    p.error(f"--paged-repeats {args.paged_repeats}: needs --paged PAGE_SIZE and N >= 1")
  args.other_options = None
  if args.also_compiler_options is not None:
    try:
      args.other_options = json.loads(args.also_compiler_options)
    except json.JSONDecodeError as e:
      p.error(f"--also-compiler-options must be a JSON object: {e}")
    if not isinstance(args.other_options, dict):
      p.error("--also-compiler-options must be a JSON object of XLA option names to values")
  return args


def _model_config(small: bool) -> ModelConfig:
  if small:
    return ModelConfig.llama(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=True)
  return ModelConfig.llama(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                           rope_theta=500000.0, tie_embeddings=True)


def _attention_used(cfg: ModelConfig) -> str:
  """Which attention `implementation=None` runs for this model: probe the kernels once."""
  if jax.devices()[0].platform != "gpu":
    return "reference (no GPU)"
  layer = jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), cfg.num_kv_heads, cfg.head_dim)
  # Rows like the benchmark's (a multiple of the kernels' key block), one sequence.
  config = jaxkv.CacheConfig([layer], capacity=256, max_seqs=1, max_write=8,
                             kv_dtype=jnp.bfloat16, initial_capacity=256)
  state = jaxkv.init_state(config)
  state, _, _ = jaxkv.pure.seq_new(config, state)
  state, _ = jaxkv.pure.declare_step(config, state, jnp.zeros((8,), jnp.int32), jnp.int32(8),
                                     jnp.zeros((8, 2), jnp.int32))
  state, _ = jaxkv.pure.prepare_step(config, state)
  q = jnp.ones((8, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
  kv = jnp.ones((8, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
  try:
    jax.block_until_ready(jaxkv.pure.attend(config, state, 0, q, kv, kv,
                                            implementation="mosaic_gpu"))
    return "mosaic_gpu"
  except NotImplementedError as e:
    return f"reference (kernels refused: {str(e)[:120]})"


# ----------------------------------------------------------------------------- jaxkv


def _engine_and_requests(model, prompts, new_tokens, **engine_kwargs):
  """An `Engine` sized for the workload (`max_len` = its longest request) and its requests.

  `new_tokens`: one int for every request, or one per request.
  """
  news = [new_tokens] * len(prompts) if isinstance(new_tokens, int) else list(new_tokens)
  engine = serve.Engine(model, max_len=max(len(p) + n for p, n in zip(prompts, news)),
                        **engine_kwargs)
  requests = [serve.Request(tuple(p), serve.SamplingParams(max_tokens=n))
              for p, n in zip(prompts, news)]
  return engine, requests


def alternate_runs(models: dict, prompts, new_tokens, repeats: int) -> dict:
  """Times `repeats` runs of each model's engine, alternating between them, in one process.

  Each engine is built and warmed up first (compilation excluded); then every round
  runs each engine once, in the dict's order, so slow drifts of the machine (clocks,
  temperature) land on all of them. Returns `{name: {"seconds": [...], "mean", "min",
  "max"}}`; the tokens of every run must equal the engine's first run (raises if not).
  """
  runs, first = {}, {}   # name: (engine, its requests)
  for name, model in models.items():
    runs[name] = _engine_and_requests(model, prompts, new_tokens)
    first[name] = [c.tokens for c in runs[name][0].run(runs[name][1])]   # compile + warm-up
  seconds = {name: [] for name in models}
  for _ in range(repeats):
    for name, (engine, requests) in runs.items():
      start = time.perf_counter()
      tokens = [c.tokens for c in engine.run(requests)]
      seconds[name].append(time.perf_counter() - start)
      if tokens != first[name]:
        raise RuntimeError(f"alternate_runs: {name}'s tokens changed between runs")
  return {name: {"seconds": s, "mean": float(np.mean(s)), "min": min(s), "max": max(s)}
          for name, s in seconds.items()}


def run_jaxkv(model, prompts, new_tokens, widths=None, admission="longest_first",
              compiler_options=None):
  """`new_tokens`: one int for every request, or one per request; `widths`: the Engine's;
  `admission`: `Engine.run`'s admission order; `compiler_options`: the Engine's (None: XLA's
  defaults)."""
  engine, requests = _engine_and_requests(model, prompts, new_tokens, widths=widths,
                                          compiler_options=compiler_options)
  # Warm-up on the same shapes (the same queue: compiles the loop; queues pad to powers of two).
  engine.run(requests, admission=admission)
  start = time.perf_counter()
  results = engine.run(requests, admission=admission)
  seconds = time.perf_counter() - start
  stats = engine.stats
  return {
      "seconds": seconds, "steps": stats.steps, "ms_per_step": 1e3 * seconds / stats.steps,
      "generated": stats.generated, "tokens_per_s": stats.generated / seconds,
      "step_tokens": stats.step_tokens, "loop_entries": stats.loop_entries,
      "mean_occupancy": stats.occupancy / stats.steps, "preemptions": stats.preemptions,
      "width_steps": {str(k): v for k, v in stats.width_steps.items()},
      "setup_seconds": stats.setup_seconds, "loop_seconds": stats.loop_seconds,
  }, [r.tokens for r in results]


# ----------------------------------------------------------------------------- baseline


def _weights(model):
  """Plain arrays of the model's weights (the baseline shares them)."""
  layers = []
  for layer in model.layers:
    a, m = layer.attn, layer.mlp
    layers.append({
        "in_norm": layer.input_layernorm.weight[...], "post_norm": layer.post_attention_layernorm
        .weight[...], "q": a.q_proj.kernel[...], "k": a.k_proj.kernel[...],
        "v": a.v_proj.kernel[...], "o": a.o_proj.kernel[...], "gate": m.gate_proj.kernel[...],
        "up": m.up_proj.kernel[...], "down": m.down_proj.kernel[...]})
  return {"embed": model.embed.embedding[...], "norm": model.norm.weight[...], "layers": layers}


def _rms(x, w, eps):
  xf = x.astype(jnp.float32)
  normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w.astype(x.dtype) * normed.astype(x.dtype)


def _dense_forward(cfg, impl, w, tokens, positions, k_cache, v_cache, q_lens, kv_lens, is_prefill):
  """One forward of `[B, T]` tokens over padded caches `[L][B, S, K, D]` (written in place)."""
  b, t = tokens.shape
  inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
  x = w["embed"][tokens]
  new_k, new_v = [], []
  for l, lw in enumerate(w["layers"]):
    h = _rms(x, lw["in_norm"], cfg.rms_eps)
    q = (h @ lw["q"]).reshape(b * t, cfg.num_heads, cfg.head_dim)
    k = (h @ lw["k"]).reshape(b * t, cfg.num_kv_heads, cfg.head_dim)
    v = (h @ lw["v"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    flat_pos = positions.reshape(b * t)
    q = apply_rope(q, flat_pos, inv).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = apply_rope(k, flat_pos, inv).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if is_prefill:
      kc = jax.lax.dynamic_update_slice(k_cache[l], k.astype(k_cache[l].dtype), (0, 0, 0, 0))
      vc = jax.lax.dynamic_update_slice(v_cache[l], v.astype(v_cache[l].dtype), (0, 0, 0, 0))
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_lens,
                                         key_value_seq_lengths=q_lens, implementation=impl)
    else:
      rows = jnp.arange(b)
      kc = k_cache[l].at[rows, positions[:, 0]].set(k[:, 0].astype(k_cache[l].dtype))
      vc = v_cache[l].at[rows, positions[:, 0]].set(v[:, 0].astype(v_cache[l].dtype))
      out = jax.nn.dot_product_attention(q, kc, vc, query_seq_lengths=q_lens,
                                         key_value_seq_lengths=kv_lens, implementation=impl)
    new_k.append(kc)
    new_v.append(vc)
    x = x + out.reshape(b, t, cfg.num_heads * cfg.head_dim) @ lw["o"]
    h = _rms(x, lw["post_norm"], cfg.rms_eps)
    x = x + (jax.nn.silu(h @ lw["gate"]) * (h @ lw["up"])) @ lw["down"]
  return _rms(x, w["norm"], cfg.rms_eps), new_k, new_v


def _baseline_fns(cfg, impl, new_tokens, compiler_options=None):
  def prefill(w, tokens, lens, k_cache, v_cache):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    h, k_cache, v_cache = _dense_forward(cfg, impl, w, tokens, positions, k_cache, v_cache,
                                         lens, lens, True)
    last = h[jnp.arange(b), lens - 1]
    first = jnp.argmax((last @ w["embed"].T).astype(jnp.float32), axis=-1).astype(jnp.int32)
    return first, k_cache, v_cache

  def decode(w, first, lens, k_cache, v_cache):
    b = first.shape[0]
    out = jnp.zeros((b, new_tokens), jnp.int32).at[:, 0].set(first)

    def body(i, carry):
      out, k_cache, v_cache = carry
      pos = lens + i - 1   # the token sampled at step i - 1 sits at lens + i - 1
      h, k_cache, v_cache = _dense_forward(
          cfg, impl, w, out[:, i - 1][:, None], pos[:, None], k_cache, v_cache,
          jnp.ones((b,), jnp.int32), pos + 1, False)
      nxt = jnp.argmax((h[:, 0] @ w["embed"].T).astype(jnp.float32), axis=-1).astype(jnp.int32)
      return out.at[:, i].set(nxt), k_cache, v_cache

    return jax.lax.fori_loop(1, new_tokens, body, (out, k_cache, v_cache))

  jit = functools.partial(jax.jit, donate_argnums=(3, 4), compiler_options=compiler_options or None)
  return jit(prefill), jit(decode)


def run_baseline(cfg, model, prompts, new_tokens, compiler_options=None):
  """The padded loop; `compiler_options`: XLA options for its two jits (None: XLA's defaults,
  what a plain `jax.jit` loop gets)."""
  impl = "cudnn"
  if jax.devices()[0].platform != "gpu":
    impl = "xla"
  w = _weights(model)
  b = len(prompts)
  longest = max(len(p) for p in prompts)
  max_len = longest + new_tokens
  tokens = np.zeros((b, longest), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
  shape = (b, max_len, cfg.num_kv_heads, cfg.head_dim)
  caches = lambda: [jnp.zeros(shape, jnp.bfloat16) for _ in range(cfg.num_layers)]

  fns = {}

  def once(impl):
    if impl not in fns:
      fns[impl] = _baseline_fns(cfg, impl, new_tokens, compiler_options)
    prefill, decode = fns[impl]
    k_cache, v_cache = caches(), caches()
    t0 = time.perf_counter()
    first, k_cache, v_cache = prefill(w, jnp.asarray(tokens), lens, k_cache, v_cache)
    first.block_until_ready()
    t1 = time.perf_counter()
    out, k_cache, v_cache = decode(w, first, lens, k_cache, v_cache)
    out.block_until_ready()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, np.asarray(out)

  try:
    once(impl)   # compile + warm-up
  except Exception as e:   # pylint: disable=broad-except  (cuDNN refusal: report and fall back)
    print(f"baseline: implementation={impl!r} failed ({type(e).__name__}: {str(e)[:200]}); "
          "using 'xla'")
    impl = "xla"
    once(impl)
  prefill_s, decode_s, out = once(impl)
  seconds = prefill_s + decode_s
  steps = 1 + (new_tokens - 1)
  return {
      "attention": impl, "seconds": seconds, "prefill_seconds": prefill_s,
      "decode_seconds": decode_s, "steps": steps, "ms_per_step": 1e3 * seconds / steps,
      "ms_per_decode_step": 1e3 * decode_s / max(new_tokens - 1, 1),
      "generated": b * new_tokens, "tokens_per_s": b * new_tokens / seconds,
      "padded_prefill_tokens": b * longest, "real_prefill_tokens": int(lens.sum()),
  }, [row.tolist() for row in out]


def measure_ceilings(small: bool) -> dict:
  """The copy ceiling (bytes read + written per second) and the dense bf16 matmul rate, measured now.

  The copy ceiling is a device-to-device copy where torch has CUDA (`copy_source` says which),
  else a JAX elementwise pass (a lower bound of it).
  """
  n = (1 << 28) if not small else (1 << 16)   # 512 MiB of bf16 (tiny under --small)
  d2d = None if small else decode_bench.torch_d2d_copy_bytes_per_s(1 << 30)   # 2 GiB, far above L2
  x = jnp.ones((n,), jnp.bfloat16)
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))
  size = 8192 if not small else 256
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
  mm = jax.jit(lambda a, b: a @ b)

  def timed(fn, *args, reps=20):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps

  t_copy = timed(copy, x)
  t_mm = timed(mm, a, a)
  jax_copy = 2 * x.nbytes / t_copy
  return {"copy_bytes_per_s": jax_copy if d2d is None else d2d,
          "copy_source": "jax elementwise" if d2d is None else "torch d2d",
          "jax_elementwise_bytes_per_s": jax_copy, "matmul_flops_per_s": 2 * size**3 / t_mm}


def roofline(cfg: ModelConfig, prompts, news, ceilings, slots=None) -> dict:
  """The physical floor of serving `prompts` with `news` new tokens each on this machine.

  Prefill: `2 * params * prompt tokens` plus causal attention FLOPs at the matmul
  rate. Decode: every step reads the weights once plus the live K/V of the
  sequences in it, at the copy ceiling; with `slots`, at most `slots`
  sequences decode at once (steps = the schedule of a perfect continuous batcher:
  total decode tokens / slots, never fewer than the longest request).
  """
  params_bytes = 2 * cfg.num_params
  kv_per_token = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim   # K+V bf16
  attn = lambda p: 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * p * (p + 1) / 2
  prefill_flops = sum(2 * cfg.num_params * len(p) + attn(len(p)) for p in prompts)
  # Live K/V summed over every decode token: token t of request i reads len(p_i) + t positions.
  kv_reads = sum(kv_per_token * (n - 1) * (len(p) + (n - 1) / 2) for p, n in zip(prompts, news))
  decode_tokens = sum(n - 1 for n in news)
  steps = max(max(news) - 1, decode_tokens / (slots or len(prompts)))
  prefill_s = prefill_flops / ceilings["matmul_flops_per_s"]
  decode_s = (steps * params_bytes + kv_reads) / ceilings["copy_bytes_per_s"]
  mean_kv = kv_reads / max(decode_tokens, 1) * (decode_tokens / max(steps, 1))
  return {"seconds": prefill_s + decode_s, "prefill_seconds": prefill_s,
          "decode_seconds": decode_s, "decode_steps": steps,
          "decode_step_ms": 1e3 * (params_bytes + mean_kv) / ceilings["copy_bytes_per_s"],
          "generated": sum(news)}


def _lengths(rng, n, median, cap, sigma=0.8, floor=1):
  return [int(min(cap, max(floor, round(x)))) for x in rng.lognormal(np.log(median), sigma, n)]


def run_static(cfg, model, prompts, news, slots, compiler_options=None):
  """Static batching: batches of `slots` in order, each padded to its longest prompt and decoding
  until its longest request ends (compilation excluded: each batch shape is warmed up first)."""
  total, outs = 0.0, []
  for b in range(0, len(prompts), slots):
    batch, new = prompts[b:b + slots], max(news[b:b + slots])
    r, out = run_baseline(cfg, model, batch, new, compiler_options)
    total += r["seconds"]
    outs += [o[:n] for o, n in zip(out, news[b:b + slots])]
  gen = sum(news)
  return {"seconds": total, "generated": gen, "tokens_per_s": gen / total,
          "attention": r["attention"]}, outs


def random_prompts(rng, cfg: ModelConfig, lens) -> list[list[int]]:
  """One prompt of uniformly random token ids per length in `lens`."""
  return [rng.integers(0, cfg.vocab_size, size=int(n)).astype(np.int32).tolist() for n in lens]


def workload_cache(cfg: ModelConfig, prompts, news, *, slots: int, max_write: int):
  """The cache a workload is served with: flat rows for its longest sequence (rounded up
  to the kernels' row multiple, 128), which is also every sequence's cap (`max_seq_len`,
  so paged storage gets a page table of that many rows, not of `capacity`), and capacity
  for all of its sequences (at most `slots` columns of those rows)."""
  longest = max(len(p) + n for p, n in zip(prompts, news))
  capacity = sum(len(p) + n for p, n in zip(prompts, news))
  rows = -(-longest // 128) * 128
  return cfg.cache_config(capacity=max(min(capacity, slots * rows), rows), max_seqs=slots,
                          max_write=max_write, kv_dtype=jnp.bfloat16, initial_capacity=rows,
                          max_seq_len=rows)


def main(argv=None) -> int:
  args = _args(argv)
  if args.small:
    args.requests, args.prompt_min, args.prompt_max = 6, 4, 40
    args.new_tokens, args.max_write = min(args.new_tokens, 8), min(args.max_write, 32)
    args.slots = min(args.slots, 4)
  cfg = _model_config(args.small)
  rng = np.random.default_rng(0)
  slots = args.requests
  if args.workload == "uniform":
    lens = rng.integers(args.prompt_min, args.prompt_max + 1, size=args.requests)
    news = [args.new_tokens] * args.requests
  elif args.workload == "decode":
    lens = rng.integers(8, 17, size=args.requests)
    news = [args.new_tokens] * args.requests
  else:
    count = args.mixed_requests if not args.small else 12
    cap_p, cap_o = (2048, 768) if not args.small else (40, 8)
    lens = _lengths(rng, count, 300 if not args.small else 12, cap_p, floor=4)
    news = _lengths(rng, count, 150 if not args.small else 4, cap_o)
    slots = args.slots
  prompts = random_prompts(rng, cfg, lens)
  cache = workload_cache(cfg, prompts, news, slots=slots, max_write=args.max_write)
  from flax import nnx   # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  bucket = args.bucket or None
  # The same weights (same seed and shapes) over every cache this run serves.
  build = lambda c: Decoder(cfg, c, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                            implementation=args.implementation, bucket=bucket, gemm=args.gemm,
                            rngs=nnx.Rngs(0))
  model = build(cache)
  ceilings = measure_ceilings(args.small)
  floor = roofline(cfg, prompts, news, ceilings, slots=slots)
  print(f"device {jax.devices()[0].device_kind}; model {cfg.num_params / 1e9:.2f}B params "
        f"(built in {time.perf_counter() - t0:.1f} s); workload {args.workload}: {len(prompts)} "
        f"requests, prompts {min(lens)}..{max(lens)} (sum {sum(lens)}), new tokens "
        f"{min(news)}..{max(news)} (sum {sum(news)}); {slots} slots; W={args.max_write}")
  print(f"ceilings (measured now): copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s "
        f"({ceilings['copy_source']}), bf16 matmul "
        f"{ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; roofline {floor['seconds']:.3f} s "
        f"(prefill {floor['prefill_seconds']:.3f} s, decode {floor['decode_seconds']:.3f} s, "
        f"{floor['decode_step_ms']:.3f} ms per decode step), {floor['generated'] / floor['seconds']:.0f} "
        "tokens/s")
  results = {"device": jax.devices()[0].device_kind, "params": cfg.num_params,
             "workload": args.workload, "requests": len(prompts), "slots": slots,
             "prompt_tokens": int(sum(lens)), "generated": int(sum(news)),
             "max_write": args.max_write, "bucket": bucket, "gemm": model.gemm,
             "ceilings": ceilings, "roofline": floor}
  outputs = {}
  base_name = "static" if args.workload == "mixed" else "baseline"
  if not args.skip_baseline:
    runs = [(base_name, None)]
    if args.other_options is not None:
      runs.append((base_name + "_other_options", args.other_options))
    for name, options in runs:
      t0 = time.perf_counter()
      if args.workload == "mixed":
        results[name], outputs[name] = run_static(cfg, model, prompts, news, slots, options)
      else:
        results[name], outputs[name] = run_baseline(cfg, model, prompts, news[0], options)
      r = results[name]
      r["compiler_options"] = options or {}
      decode = (f", {r['ms_per_decode_step']:.3f} ms per decode step"
                if "ms_per_decode_step" in r else "")
      print(f"{name} ({r['attention']}, compiler options {options or {}}): {r['seconds']:.3f} s, "
            f"{r['tokens_per_s']:.0f} tokens/s ({floor['seconds'] / r['seconds']:.2f} of the "
            f"roofline{decode}; with warm-up {time.perf_counter() - t0:.0f} s)")
    if args.workload == "mixed" and args.also_sorted_static:
      t0 = time.perf_counter()
      by_len = sorted(range(len(prompts)), key=lambda i: -news[i])
      rs, out_s = run_static(cfg, model, [prompts[i] for i in by_len], [news[i] for i in by_len],
                             slots)
      results["static_sorted"] = rs
      print(f"static, batches sorted by output length: {rs['seconds']:.3f} s, "
            f"{rs['tokens_per_s']:.0f} tokens/s ({floor['seconds'] / rs['seconds']:.2f} of the "
            f"roofline; with warm-up {time.perf_counter() - t0:.0f} s)")
    _save(args.out, results)
  if not args.skip_jaxkv:
    results["jaxkv_attention"] = (args.implementation if args.implementation
                                  else _attention_used(cfg))
    t0 = time.perf_counter()
    results["jaxkv"], outputs["jaxkv"] = run_jaxkv(model, prompts, news)
    r = results["jaxkv"]
    print(f"jaxkv ({results['jaxkv_attention']}, gemm {model.gemm}): {r['seconds']:.3f} s, {r['tokens_per_s']:.0f} "
          f"tokens/s ({floor['seconds'] / r['seconds']:.2f} of the roofline), {r['steps']} steps, "
          f"{r['ms_per_step']:.3f} ms/step, steps per width {r['width_steps']}, mean occupancy "
          f"{r['mean_occupancy']:.1f}, {r['loop_entries']} loop entries (with warm-up "
          f"{time.perf_counter() - t0:.0f} s)")
    print(f"jaxkv run: host set-up {1e3 * r['setup_seconds']:.1f} ms, in the loop "
          f"{1e3 * r['loop_seconds']:.1f} ms, outputs and the rest "
          f"{1e3 * (r['seconds'] - r['setup_seconds'] - r['loop_seconds']):.1f} ms")
    if args.data_parallel:
      devices = jax.devices()[:args.data_parallel]
      dp = serve.DataParallelEngine(model, devices=devices, max_len=max(
          len(p) + n for p, n in zip(prompts, news)))
      dp_requests = [serve.Request(tuple(p), serve.SamplingParams(max_tokens=n))
                     for p, n in zip(prompts, news)]
      dp.run(dp_requests)   # warm-up: compiles each device's loop
      t1 = time.perf_counter()
      dp_out = dp.run(dp_requests)
      dp_s = time.perf_counter() - t1
      same = sum(a.tokens == b for a, b in zip(dp_out, outputs["jaxkv"]))
      results["data_parallel"] = {"devices": len(devices), "seconds": dp_s,
                                  "tokens_per_s": dp.stats.generated / dp_s,
                                  "speedup_vs_one_device": r["seconds"] / dp_s,
                                  "same_tokens": same}
      print(f"jaxkv data-parallel over {len(devices)} devices: {dp_s:.3f} s, "
            f"{dp.stats.generated / dp_s:.0f} tokens/s = {r['seconds'] / dp_s:.2f}x one device; "
            f"{same}/{len(prompts)} outputs identical to one device")
    if args.other_options is not None:
      options = args.other_options
      t1 = time.perf_counter()
      ro, out_o = run_jaxkv(model, prompts, news, compiler_options=options)
      same = sum(a == b for a, b in zip(out_o, outputs["jaxkv"]))
      ro.update(compiler_options=options, default_vs_these=ro["seconds"] / r["seconds"],
                same_tokens_as_default=same)
      results["jaxkv_other_options"] = ro
      print(f"jaxkv with compiler options {options}: {ro['seconds']:.3f} s, {ro['steps']} steps, "
            f"{ro['ms_per_step']:.3f} ms/step; XLA's defaults are "
            f"{ro['default_vs_these']:.2f}x faster; {same}/{len(prompts)} outputs identical "
            f"(with warm-up {time.perf_counter() - t1:.0f} s)")
    if args.also_fcfs:
      t1 = time.perf_counter()
      rf, out_f = run_jaxkv(model, prompts, news, admission="fcfs")
      same = sum(a == b for a, b in zip(out_f, outputs["jaxkv"]))
      rf.update(longest_first_vs_fcfs=rf["seconds"] / r["seconds"], same_tokens_as_default=same)
      results["jaxkv_fcfs"] = rf
      print(f"jaxkv, first come first served: {rf['seconds']:.3f} s, {rf['steps']} steps, "
            f"{rf['ms_per_step']:.3f} ms/step; longest first is {rf['longest_first_vs_fcfs']:.2f}x "
            f"faster; {same}/{len(prompts)} outputs identical (with warm-up "
            f"{time.perf_counter() - t1:.0f} s)")
    if args.also_widths:
      widths = tuple(int(w) for w in args.also_widths.split(","))
      t1 = time.perf_counter()
      rw, out_w = run_jaxkv(model, prompts, news, widths=widths)
      same = sum(a == b for a, b in zip(out_w, outputs["jaxkv"]))
      rw.update(widths=list(widths), default_vs_these=rw["seconds"] / r["seconds"],
                same_tokens_as_default=same)
      results["jaxkv_widths"] = rw
      print(f"jaxkv with widths {widths}: {rw['seconds']:.3f} s, {rw['steps']} steps, "
            f"{rw['ms_per_step']:.3f} ms/step, steps per width {rw['width_steps']}; the default "
            f"widths are {rw['default_vs_these']:.2f}x faster; {same}/{len(prompts)} outputs "
            f"identical (with warm-up {time.perf_counter() - t1:.0f} s)")
    if args.paged:
      # The same weights (same seed and shapes) over paged storage of the same capacity.
      paged_cache = dataclasses.replace(cache, page_size=args.paged)
      paged_model = build(paged_cache)
      kv_bytes = lambda c: sum(
          2 * int(np.prod(c.layer_shape(l, c.initial_flat_rows))) * jnp.dtype(c.kv_dtype).itemsize
          for l in range(c.num_layers))
      t1 = time.perf_counter()
      results["jaxkv_paged"], outputs["jaxkv_paged"] = run_jaxkv(paged_model, prompts, news)
      rp = results["jaxkv_paged"]
      same = sum(a == b for a, b in zip(outputs["jaxkv_paged"], outputs["jaxkv"]))
      rp.update(page_size=args.paged, kv_bytes=kv_bytes(paged_cache),
                columns_kv_bytes=kv_bytes(cache), speedup_vs_columns=r["seconds"] / rp["seconds"],
                same_tokens_as_columns=same)
      print(f"jaxkv paged (page_size {args.paged}): {rp['seconds']:.3f} s, {rp['steps']} steps, "
            f"{rp['ms_per_step']:.3f} ms/step, mean occupancy {rp['mean_occupancy']:.1f} = "
            f"{rp['speedup_vs_columns']:.2f}x the columns; K/V allocated {rp['kv_bytes'] / 1e9:.2f} GB "
            f"vs {rp['columns_kv_bytes'] / 1e9:.2f} GB; {same}/{len(prompts)} outputs identical to "
            f"the columns' (with warm-up {time.perf_counter() - t1:.0f} s)")
      if args.paged_repeats:
        results["paged_repeats"] = alternate_runs(
            {"columns": model, "pages": paged_model}, prompts, news, args.paged_repeats)
        rr = results["paged_repeats"]
        print(f"alternating runs ({args.paged_repeats} each): columns {rr['columns']['mean']:.3f} s "
              f"(min {rr['columns']['min']:.3f}, max {rr['columns']['max']:.3f}), pages "
              f"{rr['pages']['mean']:.3f} s (min {rr['pages']['min']:.3f}, max "
              f"{rr['pages']['max']:.3f}): pages {rr['columns']['mean'] / rr['pages']['mean']:.3f}x "
              f"the columns (ratio of means)")
      del paged_model
      if args.paged_slots:
        # The columns' K/V bytes again, as a page pool behind `paged_slots` columns.
        budget = kv_bytes(cache)
        eq_cache = serve.paged_cache_config(
            dataclasses.replace(cache, max_seqs=args.paged_slots), budget, page_size=args.paged)
        eq_model = build(eq_cache)
        t1 = time.perf_counter()
        re_, out_e = run_jaxkv(eq_model, prompts, news)
        same = sum(a == b for a, b in zip(out_e, outputs["jaxkv"]))
        re_.update(page_size=args.paged, slots=args.paged_slots, capacity=eq_cache.capacity,
                   kv_bytes=kv_bytes(eq_cache), columns_kv_bytes=budget,
                   speedup_vs_columns=r["seconds"] / re_["seconds"], same_tokens_as_columns=same)
        results["jaxkv_paged_same_memory"] = re_
        print(f"jaxkv paged (page_size {args.paged}) in the columns' K/V bytes, {args.paged_slots} "
              f"slots, capacity {eq_cache.capacity}: {re_['seconds']:.3f} s, {re_['steps']} steps, "
              f"{re_['ms_per_step']:.3f} ms/step, mean occupancy {re_['mean_occupancy']:.1f} (columns "
              f"{r['mean_occupancy']:.1f}), {re_['preemptions']} preemptions = "
              f"{re_['speedup_vs_columns']:.2f}x the columns; K/V {re_['kv_bytes'] / 1e9:.2f} GB vs "
              f"{budget / 1e9:.2f} GB; {same}/{len(prompts)} outputs identical to the columns' (with "
              f"warm-up {time.perf_counter() - t1:.0f} s)")
        del eq_model
    if args.workload == "decode":
      print(f"decode step: {r['ms_per_step']:.3f} ms vs roofline {floor['decode_step_ms']:.3f} ms "
            f"= {r['ms_per_step'] / floor['decode_step_ms']:.2f}x")
    _save(args.out, results)
  if "jaxkv_other_options" in results and base_name + "_other_options" in results:
    results["speedup_other_options"] = (results[base_name + "_other_options"]["seconds"]
                                        / results["jaxkv_other_options"]["seconds"])
    print(f"speed-up jaxkv / {base_name}, both compiled with the other options: "
          f"{results['speedup_other_options']:.2f}x")
  if "jaxkv" in results and base_name in results:
    results["speedup"] = results[base_name]["seconds"] / results["jaxkv"]["seconds"]
    pairs = list(zip(outputs["jaxkv"], outputs[base_name]))
    first_equal = sum(a[:1] == b[:1] for a, b in pairs)
    all_equal = sum(a == b for a, b in pairs)
    results["first_token_agreement"] = first_equal / len(prompts)
    results["full_agreement"] = all_equal / len(prompts)
    print(f"speed-up jaxkv / {base_name}: {results['speedup']:.2f}x; first tokens agree for "
          f"{first_equal}/{len(prompts)} requests, all tokens for {all_equal} (bf16 near-ties "
          "may differ)")
    if "static_sorted" in results:
      results["speedup_vs_sorted_static"] = (results["static_sorted"]["seconds"]
                                             / results["jaxkv"]["seconds"])
      print(f"speed-up jaxkv / static batching sorted by length: "
            f"{results['speedup_vs_sorted_static']:.2f}x")
  _save(args.out, results)
  return 0


def _save(path, results):
  """Writes the results so far (the baseline runs first: a cut-off run keeps it)."""
  if path:
    with open(path, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  raise SystemExit(main())
