"""`python -m jaxkv.demo`: serve a batch of prompts through an example model on jaxkv.

Builds a Gemma-3-style (sliding-window ring layers + global flat layers) or
Llama-style decoder from `jaxkv.models` with random weights, or loads a
Hugging Face checkpoint directory (`--checkpoint`: config.json + safetensors,
and tokenizer.json for text), and serves `--requests` prompts with
`jaxkv.serve.Engine`: continuous batching with chunked prefill mixed into
decode steps, the whole multi-step loop inside one `jax.jit`. It prints every
request's tokens (text when a tokenizer exists) and a summary: which attention
implementation serves each layer and why, compile time apart from serving time
(a warm-up run of the queue's shape, 1-token prompts, compiles the serving loop
first, so the run is measured warm), tokens/s, per-request latency (queue, time
to first token, total, inter-token), steps, mean batch occupancy, and cache rows
and bytes in use.

On a Hopper GPU the attention uses the Pallas Mosaic GPU kernels
(`--implementation` default) and the demo defaults to what they serve:
bfloat16 and, for the random model, head_dim 64. Elsewhere it runs the
pure-jnp reference in float32 with head_dim 16.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import models, serve
from jaxkv._implementation import default_implementation
from jaxkv._memory import check_fits
from jaxkv.models import hf
from jaxkv.serve.report import gemm_line, implementation_lines
from jaxkv.serve.memory import bytes_in_use, check_engine_fits, storage_bytes

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "auto": "auto"}
_INT32_LIMIT = 2**31
_MAX_STOP = 8


def _parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m jaxkv.demo", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  m = p.add_argument_group("model")
  m.add_argument("--model", choices=["gemma3", "llama"], default="gemma3",
                 help="random-weights architecture when no --checkpoint (default gemma3)")
  m.add_argument("--checkpoint", default=None,
                 help="Hugging Face checkpoint directory (Llama or Gemma 3 text): config.json, "
                      "*.safetensors, optional tokenizer.json")
  m.add_argument("--layers", type=int, default=6, help="random model: layers (default 6)")
  m.add_argument("--hidden", type=int, default=64, help="random model: width (default 64)")
  m.add_argument("--vocab", type=int, default=512, help="random model: vocabulary (default 512)")
  m.add_argument("--window", type=int, default=16,
                 help="random gemma3: sliding window of the ring layers (default 16)")
  m.add_argument("--head-dim", type=int, default=None,
                 help="random model: head dimension (default: 64 where the Mosaic GPU kernels "
                      "serve, a Hopper GPU; else 16)")
  m.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                 help="parameters, activations and K/V storage (default: with --checkpoint "
                      "auto, the checkpoint's; a random model bfloat16 where the Mosaic GPU "
                      "kernels serve, a Hopper GPU, else float32)")
  c = p.add_argument_group("cache and engine")
  c.add_argument("--max-seqs", type=int, default=8, help="sequence columns (default 8)")
  c.add_argument("--max-write", type=int, default=32,
                 help="step width W: tokens per step, prefill chunks + decodes (default 32)")
  c.add_argument("--capacity", type=int, default=1024,
                 help="shared token budget of all live sequences (default 1024)")
  c.add_argument("--initial-capacity", type=int, default=None,
                 help="flat rows allocated up front (default: capacity; smaller values grow "
                      "on the host between loop entries)")
  c.add_argument("--implementation", choices=["reference", "mosaic_gpu", "interpret"],
                 default=None, help="attention implementation (default: Mosaic GPU kernels on a "
                                    "Hopper GPU, else the reference)")
  r = p.add_argument_group("requests and sampling")
  r.add_argument("--requests", type=int, default=16, help="requests to serve (default 16)")
  r.add_argument("--prompt", action="append", default=None,
                 help="a text prompt (needs a checkpoint tokenizer); repeat for several")
  r.add_argument("--prompt-min", type=int, default=4, help="random prompts: shortest (default 4)")
  r.add_argument("--prompt-max", type=int, default=64,
                 help="random prompts: longest (default 64)")
  r.add_argument("--max-tokens", type=int, default=24, help="new tokens per request (default 24)")
  r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
  r.add_argument("--top-k", type=int, default=0, help="top-k filter, 0 = off (default 0)")
  r.add_argument("--top-p", type=float, default=1.0, help="nucleus filter (default 1.0)")
  r.add_argument("--n", type=int, default=1,
                 help="parallel samples per request, forked from the prompt (default 1)")
  r.add_argument("--seed", type=int, default=0, help="seed of prompts, weights, sampling")
  o = p.add_argument_group("output")
  o.add_argument("--check", action="store_true",
                 help="re-decode the first 3 requests one by one (greedy) and compare")
  o.add_argument("--quiet", action="store_true", help="no per-request lines, no progress bar")
  args = p.parse_args(argv)
  # Sizes travel as int32 through the cache and the loop: beyond 2**31 - 1 they cannot.
  if args.checkpoint and args.head_dim is not None:
    p.error("--head-dim applies to the random model only (a checkpoint fixes its head_dim)")
  _device_defaults(args)
  for name, lo in (("layers", 1), ("hidden", 1), ("head_dim", 1), ("vocab", 1), ("window", 1),
                   ("max_seqs", 1),
                   ("max_write", 1), ("capacity", 1), ("initial_capacity", 1), ("requests", 1),
                   ("prompt_min", 1), ("prompt_max", 1), ("max_tokens", 1), ("n", 1),
                   ("top_k", 0), ("seed", 0)):
    value = getattr(args, name)
    if value is not None and not lo <= value < _INT32_LIMIT:
      p.error(f"--{name.replace('_', '-')}={value} must be in [{lo}, 2**31)")
  if not (math.isfinite(args.temperature) and args.temperature >= 0):
    p.error(f"--temperature={args.temperature} must be finite and >= 0")
  if not 0 < args.top_p <= 1:
    p.error(f"--top-p={args.top_p} must be in (0, 1]")
  if args.prompt_max < args.prompt_min:
    p.error(f"--prompt-max={args.prompt_max} must be >= --prompt-min={args.prompt_min}")
  if args.max_write > args.capacity:
    p.error(f"--max-write={args.max_write} must be <= --capacity={args.capacity} (a step "
            f"holds at most capacity tokens)")
  _check_host_fits(p, args)
  return p, args


def _max_stop(requests) -> int:
  """Stop-token slots: `_MAX_STOP`, or more when a request has more stop ids (none is dropped)."""
  return max([_MAX_STOP] + [len(r.params.stop_tokens) for r in requests])


def kernels_serve(implementation: str | None) -> bool:
  """Whether the Mosaic GPU kernels will serve: a Hopper GPU and no other choice made."""
  return implementation in (None, "mosaic_gpu") and default_implementation() == "mosaic_gpu"


def _device_defaults(args) -> None:
  """Fills `--dtype` and `--head-dim` left unset: a checkpoint's own dtype ("auto"); for a
  random model what the compiled kernels serve on a Hopper GPU (bfloat16, head_dim 64; float32
  storage and head_dim 16 would run the reference), today's small float32 model elsewhere."""
  kernels = kernels_serve(args.implementation)
  if args.dtype is None and args.checkpoint:
    args.dtype = "auto"   # resolved by the loader; `_build` records the result
  elif args.dtype in (None, "auto") and not args.checkpoint:
    args.dtype = "bfloat16" if kernels else "float32"
  if args.head_dim is None and not args.checkpoint:
    args.head_dim = 64 if kernels else 16


def _check_host_fits(p, args) -> None:
  """Refuses, before building anything, random models and prompts the machine cannot hold.

  Building a model of 2**31 - 1 layers would spend its time creating layer
  configs before any allocation failed, so the weight bytes are bounded first,
  from `ModelConfig.num_params` of one and two layers (it is affine in layers).
  """
  try:
    if not args.checkpoint:
      one, two = (_model_config(args, layers).num_params for layers in (1, 2))
      params = one + (args.layers - 1) * (two - one)
      item = np.dtype(_DTYPES[args.dtype]).itemsize
      check_fits(params * item, what=f"--layers={args.layers} --hidden={args.hidden} "
                                     f"--head-dim={args.head_dim} "
                                     f"--vocab={args.vocab} weights",
                 formula=f"{params:,} parameters x {item} bytes")
    # A random prompt token in a tuple costs at least its 8-byte pointer.
    tokens = (len(args.prompt) if args.prompt else args.requests) * (
        args.prompt_max + args.max_tokens * args.n)
    check_fits(8 * tokens, what=f"--requests={args.requests} prompts on the host",
               formula=f"8 bytes x {args.requests} requests x (--prompt-max={args.prompt_max} "
                       f"+ --max-tokens={args.max_tokens} x --n={args.n})")
  except ValueError as e:
    p.error(str(e))


def _model_config(args, layers: int):
  """The random model's `ModelConfig` with `layers` layers."""
  heads = max(1, args.hidden // 16)
  common = dict(vocab_size=args.vocab, hidden_size=args.hidden,
                intermediate_size=2 * args.hidden, num_layers=layers, num_heads=heads,
                num_kv_heads=1 if heads == 1 else heads // 2, head_dim=args.head_dim)
  if args.model == "gemma3":
    types = tuple("full" if (i + 1) % 3 == 0 else "sliding" for i in range(layers))
    return models.ModelConfig.gemma3(sliding_window=args.window, layer_types=types,
                                     query_pre_attn_scalar=16.0, **common)
  return models.ModelConfig.llama(**common)


def _build(args):
  """`(model, model_config, tokenizer)` from the flags."""
  dtype = _DTYPES[args.dtype]
  cache = dict(capacity=args.capacity, max_seqs=args.max_seqs, max_write=args.max_write,
               kv_dtype=dtype, initial_capacity=args.initial_capacity)
  if args.checkpoint:
    model, config, _ = hf.load_model(args.checkpoint, dtype=dtype,
                                     implementation=args.implementation, **cache)
    args.dtype = np.dtype(model.dtype).name   # "auto" resolved, for the report
    return model, config, hf.load_tokenizer(args.checkpoint)
  config = _model_config(args, args.layers)
  model = models.build(config, config.cache_config(**cache), seed=args.seed, dtype=dtype,
                       param_dtype=dtype, implementation=args.implementation)
  return model, config, None


def _stop_ids(args, config) -> tuple[int, ...]:
  """The stop ids: generation_config.json's when the checkpoint names them (as `transformers`'
  `generate` does), else config.json's `eos_token_id`."""
  if args.checkpoint:
    from jaxkv.tokenizer import generation_eos_ids   # pylint: disable=g-import-not-at-top
    ids = generation_eos_ids(args.checkpoint)
    if ids:
      bad = [t for t in ids if t >= config.vocab_size]
      if bad:
        raise ValueError(f"{args.checkpoint}/generation_config.json: eos_token_id {bad[0]} must "
                         f"be < vocab_size={config.vocab_size}")
      return ids
  return config.eos_token_ids


def _requests(args, config, tokenizer):
  params = serve.SamplingParams(
      max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
      top_p=args.top_p, seed=args.seed, n=args.n, stop_tokens=_stop_ids(args, config))
  if args.prompt:
    if tokenizer is None:
      raise SystemExit("--prompt needs a --checkpoint with tokenizer.json (and `tokenizers`)")
    prompts = [tuple(tokenizer.encode(text).ids) for text in args.prompt]
  else:
    rng = np.random.default_rng(args.seed)
    prompts = [tuple(int(t) for t in rng.integers(0, config.vocab_size, size=int(
        rng.integers(args.prompt_min, args.prompt_max + 1)))) for _ in range(args.requests)]
  # Each request gets its own seed, (--seed + index) mod 2**31: seeds are int32, so
  # --seed 2**31 - 1 wraps for the second request instead of failing.
  return [serve.Request(prompt, dataclasses.replace(params, seed=(params.seed + i) % _INT32_LIMIT))
          for i, prompt in enumerate(prompts)]


def _show(tokens, tokenizer):
  if tokenizer is not None:
    return repr(tokenizer.decode(list(tokens)))
  text = " ".join(str(t) for t in tokens)
  return text if len(text) < 100 else text[:97] + "..."


def _warm_up_queue(requests):
  """The queue with every prompt cut to its first token and one new token: the same shape
  class (queue, output rows, token buffers, stop slots), so the same compiled loop, at
  almost no serving cost."""
  return [serve.Request(r.prompt[:1], dataclasses.replace(r.params, max_tokens=1), r.request_id)
          for r in requests]


def _latency_line(results) -> str:
  """Mean and largest per-sample latencies of a run (`Completion.timing`), in milliseconds."""
  def figures(name, values):
    values = [1e3 * v for v in values if v is not None]
    return f"{name} {np.mean(values):.1f}/{max(values):.1f}" if values else f"{name} -"
  t = [c.timing for c in results]
  return ("latency per sample, mean/max ms (device step counts x the mean step time): "
          + ", ".join([figures("queue", [x.queue_seconds for x in t]),
                       figures("first token", [x.first_token_seconds for x in t]),
                       figures("total", [x.total_seconds for x in t]),
                       figures("inter-token", [x.inter_token_seconds for x in t])]))


def _check(model, results) -> bool:
  """Greedy re-decode of the first 3 completions, one sequence at a time."""
  from jaxkv.serve.decoding import greedy_generate   # pylint: disable=g-import-not-at-top
  ok = True
  for c in [c for c in results if c.index == 0][:3]:
    want = greedy_generate(serve.ModelRunner(model), [list(c.prompt)], len(c.tokens))[0]
    same = want == c.tokens
    ok &= same
    print(f"check request {c.request_id}: {'OK' if same else 'MISMATCH'}")
  return ok


def _prepare(p, args):
  """`(model, config, tokenizer, requests, max_len)`, or an argparse error.

  Flags are checked against the model before anything large is allocated: a
  ValueError here (a config field out of range, a size the device cannot hold
  with its formula, a request that can never fit) is about the flags.
  """
  try:
    model, config, tokenizer = _build(args)
    cache = model.cache_config
    requests = _requests(args, config, tokenizer)
    max_len = max(len(r.prompt) for r in requests) + args.max_tokens
    for r in requests:
      serve.check_request(r, vocab_size=config.vocab_size, max_len=max_len,
                          max_seqs=cache.max_seqs, capacity=cache.capacity,
                          max_stop_tokens=_max_stop(requests))
    check_engine_fits(cache, max_len, _max_stop(requests))
  except ValueError as e:
    p.error(str(e))
  return model, config, tokenizer, requests, max_len


def main(argv=None) -> int:
  p, args = _parse_args(argv)
  started = time.perf_counter()
  model, config, tokenizer, requests, longest = _prepare(p, args)
  cache = model.cache_config
  # The loop returns to the host every 16 steps so the progress bar moves (a whole queue
  # would otherwise be served in one loop entry); `--quiet` serves it in one.
  engine = serve.Engine(model, max_len=longest, max_stop_tokens=_max_stop(requests),
                        max_steps=1 << 20 if args.quiet else 16)
  rings = sum(layer.policy.is_ring for layer in cache.layers)
  device = jax.devices()[0]
  print(f"jaxkv demo on {device.platform} ({device.device_kind}): {config.arch} "
        f"({'checkpoint' if args.checkpoint else 'random weights'}, {config.num_layers} layers: "
        f"{cache.num_layers - rings} flat, {rings} ring, {config.num_params / 1e6:.2f}M params, "
        f"{config.num_heads}/{config.num_kv_heads} heads of dim {config.head_dim}, {args.dtype}), "
        f"{len(requests)} requests x n={args.n}, W={cache.step_width}, "
        f"max_seqs={cache.max_seqs}, capacity={cache.capacity}")
  for line in implementation_lines(engine.implementations):
    print(line)
  print(gemm_line(engine.gemm))
  # A warm-up run of the same queue shape compiles the serving loop (and pays every first
  # call's dispatch cost, which is not compilation), so the run below is measured warm.
  engine.run(_warm_up_queue(requests))
  warm_compile = engine.stats.compile_seconds
  print(f"compile: {warm_compile:.2f} s (a warm-up run of the queue's shape, 1-token prompts and "
        f"1 new token each, compiled the serving loop)", flush=True)

  bar = None
  if not args.quiet:
    try:
      from tqdm import tqdm   # pylint: disable=g-import-not-at-top
      bar = tqdm(total=len(requests) * args.n, unit="req", file=sys.stdout, leave=False)
    except ImportError:
      bar = None

  def on_progress(stats, finished):
    if bar is not None:
      bar.update(len(finished))
      bar.set_postfix(steps=stats.steps, tokens=stats.step_tokens)

  results = engine.run(requests, on_progress=on_progress)
  if bar is not None:
    bar.close()
  stats = engine.stats
  if not args.quiet:
    for c in results:
      label = f"request {c.request_id}" + (f".{c.index}" if args.n > 1 else "")
      print(f"{label:>12} [{len(c.prompt):3d} prompt] {_show(c.tokens, tokenizer)}"
            f"  ({c.finish_reason})")
  rows = stats.peak_rows
  in_use = bytes_in_use(cache, [rows])
  allocated = storage_bytes(engine.state.cache)
  serve_s = stats.serve_seconds
  print(f"generated {stats.generated} tokens in {stats.seconds:.2f} s: compile "
        f"{stats.compile_seconds:.2f} s more (the warm-up compiled the loop), serving "
        f"{serve_s:.2f} s")
  if serve_s > 0:
    print(f"serving, compilation excluded: {stats.tokens_per_second:.1f} tokens/s, "
          f"{stats.step_tokens / serve_s:.1f} step tokens/s, {1e3 * stats.step_seconds:.2f} "
          f"ms/step")
  print(_latency_line(results))
  print(f"steps {stats.steps}, loop entries {stats.loop_entries}, mean batch occupancy "
        f"{stats.occupancy / max(stats.steps, 1):.2f} sequences "
        f"({stats.step_tokens / max(stats.steps, 1):.1f}/{cache.step_width} tokens per step)")
  print(f"cache: peak {rows} rows in use ({in_use / 2**20:.2f} MiB of K/V), "
        f"{allocated / 2**20:.2f} MiB allocated; total {time.perf_counter() - started:.1f} s")
  if args.check:
    if args.temperature > 0:
      print("check skipped: it compares greedy decoding (--temperature 0)")
      return 0
    return 0 if _check(model, results) else 1
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
