"""Decode throughput of a KV-head-sharded cache on 1 and 2 GPUs (issue 5).

Decode step for 64 sequences, 64 query / 16 KV heads, head dim 128, bf16, lengths
drawn uniformly from 512..8192 (seed 0): one `jaxkv.pure.attend` (write + varlen
attention) per iteration, run `--iters` times inside one jitted `fori_loop` with
the state donated, on a 1-device mesh and on an N-device mesh of the same
process. Reports ms per step, effective TB/s (live K/V bytes / time) and the
speed-up. Checks the N-device output against the 1-device output first.

Usage: python benchmarks/sharded.py [--devices 2] [--iters 20] [--implementation mosaic_gpu]

`--model` instead serves the example Llama-style model (`jaxkv.models`, bf16
random weights, ~1.1B parameters by default: 16 layers, hidden 2048, 32 query /
8 KV heads of dim 64, MLP 8192, vocabulary 32000; see the `--model-*` flags)
with `jaxkv.serve.Engine` on a 1-device mesh and on an N-device mesh (heads and
MLP split over "tp"), and reports tokens/s of `--seqs` requests of
`--prompt-len` prompt tokens and `--new-tokens` greedy tokens each (compile
excluded: a warm-up run first).
CPU smoke test (tiny sizes, two forced host devices; `--small` runs both parts tiny):

  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
    python benchmarks/sharded.py --small
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxkv   # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_SEQS, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 64, 16, 128


def _config(lengths):
  layer = jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), KV_HEADS, HEAD_DIM)
  # Rows rounded up to a multiple of 128: the kernels' tiled TMA then reads the
  # cache in place (an unaligned row count costs a padded copy per call).
  max_len = -(-(int(lengths.max()) + 1) // 128) * 128
  return jaxkv.CacheConfig([layer], capacity=int(lengths.sum()) + NUM_SEQS,
                           max_seqs=NUM_SEQS, max_write=NUM_SEQS, kv_dtype=jnp.bfloat16,
                           initial_capacity=max_len)


def _filled_state(config, lengths, mesh):
  """A state whose sequences hold `lengths` random positions, with a decode step prepared."""
  state = jaxkv.init_state(config, mesh=mesh)
  kv_sharding = NamedSharding(mesh, P(None, None, "tp", None))
  shape = state.k[0].shape
  rand = jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16),
                 out_shardings=kv_sharding)
  replicated = lambda x: jax.device_put(jnp.asarray(x, jnp.int32), NamedSharding(mesh, P()))
  state = dataclasses.replace(
      state, k=(rand(jax.random.key(1)),), v=(rand(jax.random.key(2)),),
      live=replicated(np.ones(NUM_SEQS)), pos=replicated(lengths), hw=replicated(lengths),
      held=replicated(lengths.sum()))
  ids = replicated(np.arange(NUM_SEQS))
  blocks = replicated(np.zeros((NUM_SEQS, 2)))
  state, status = jax.jit(jaxkv.pure.declare_step, static_argnums=0, donate_argnums=1)(
      config, state, ids, replicated(NUM_SEQS), blocks)
  assert int(status) == jaxkv.Status.OK, jaxkv.Status(int(status))
  state, status = jax.jit(jaxkv.pure.prepare_step, static_argnums=0, donate_argnums=1)(
      config, state)
  assert int(status) == jaxkv.Status.OK, jaxkv.Status(int(status))
  return state


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("mesh", "implementation"),
                   donate_argnums=1)
def _steps(config, state, q, k, v, iters, *, mesh, implementation):
  def body(_, carry):
    state, checksum = carry
    state, out, _ = jaxkv.pure.attend(config, state, 0, q, k, v, mesh=mesh, kv_axis="tp",
                                      implementation=implementation)
    return state, checksum + out[:, :, 0].astype(jnp.float32).sum()
  state, checksum = jax.lax.fori_loop(0, iters, body, (state, jnp.zeros((), jnp.float32)))
  return state, checksum


def _one_step(config, state, q, k, v, *, mesh, implementation):
  return jax.jit(jaxkv.pure.attend, static_argnums=(0, 2), donate_argnums=1,
                 static_argnames=("mesh", "kv_axis", "implementation"))(
                     config, state, 0, q, k, v, mesh=mesh, kv_axis="tp",
                     implementation=implementation)


def _measure(config, lengths, devices, args):
  mesh = jax.make_mesh((len(devices),), ("tp",), devices=devices)
  state = _filled_state(config, lengths, mesh)
  key = jax.random.key(3)
  q = jax.random.normal(key, (NUM_SEQS, Q_HEADS, HEAD_DIM), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (NUM_SEQS, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (NUM_SEQS, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  state, out, _ = _one_step(config, state, q, k, v, mesh=mesh,
                            implementation=args.implementation)
  out = np.asarray(out, np.float32)
  state, _ = _steps(config, state, q, k, v, args.iters, mesh=mesh,
                    implementation=args.implementation)
  times = []
  for _ in range(args.reps):
    start = time.perf_counter()
    state, checksum = _steps(config, state, q, k, v, args.iters, mesh=mesh,
                             implementation=args.implementation)
    checksum.block_until_ready()
    times.append((time.perf_counter() - start) / args.iters)
  return out, 1e3 * float(np.median(times))


# --------------------------------------------------------------------------- --model

# (layers, hidden, heads, kv_heads, head_dim, intermediate, vocab)
_MODEL_SIZES = {"1b": (16, 2048, 32, 8, 64, 8192, 32000), "tiny": (2, 64, 4, 2, 16, 128, 256)}


def _model_config(args):
  from jaxkv.models import ModelConfig   # pylint: disable=g-import-not-at-top
  layers, hidden, heads, kv_heads, head_dim, inter, vocab = _MODEL_SIZES[
      "tiny" if args.tiny else "1b"]
  pick = lambda flag, default: default if flag is None else flag
  return ModelConfig.llama(
      num_layers=pick(args.model_layers, layers), hidden_size=pick(args.model_hidden, hidden),
      num_heads=pick(args.model_heads, heads), num_kv_heads=pick(args.model_kv_heads, kv_heads),
      head_dim=pick(args.model_head_dim, head_dim),
      intermediate_size=pick(args.model_intermediate, inter),
      vocab_size=pick(args.model_vocab, vocab))


def _serve(model_config, devices, requests, args, *, use_mesh=True):
  """`(completions, generated tokens/s, step tokens/s, steps/s)` on a mesh of `devices`
  (or, `use_mesh=False`, on the default device with no mesh at all)."""
  from jaxkv.models import build   # pylint: disable=g-import-not-at-top
  from jaxkv import serve   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.memory import ROW_MULTIPLE   # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((len(devices),), ("tp",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,)) if use_mesh else None
  per_seq = args.prompt_len + args.new_tokens
  # Flat rows are per column: one request's history, rounded up as the engine grows them.
  rows = -(-per_seq // ROW_MULTIPLE) * ROW_MULTIPLE
  cache_config = model_config.cache_config(
      capacity=args.seqs * per_seq, max_seqs=args.seqs, max_write=args.width,
      kv_dtype=jnp.bfloat16, initial_capacity=rows)
  model = build(model_config, cache_config, seed=0, dtype=jnp.bfloat16,
                param_dtype=jnp.bfloat16, implementation=args.implementation, mesh=mesh)
  engine = serve.Engine(model, max_len=per_seq)
  engine.run(requests)   # compiles
  completions = engine.run(requests)
  stats = engine.stats
  return (completions, stats.generated / stats.seconds, stats.step_tokens / stats.seconds,
          stats.steps / stats.seconds)


def model_main(args):
  from jaxkv import serve   # pylint: disable=g-import-not-at-top
  devices = jax.devices()
  model_config = _model_config(args)
  rng = np.random.default_rng(0)
  requests = [serve.Request(tuple(int(t) for t in rng.integers(0, model_config.vocab_size,
                                                                args.prompt_len)),
                            serve.SamplingParams(max_tokens=args.new_tokens))
              for _ in range(args.seqs)]
  rows = []
  for n in (1, args.devices):
    completions, *rates = _serve(model_config, devices[:n], requests, args)
    rows.append((n, [c.tokens for c in completions], *rates))
  if args.no_mesh_row:
    # The same model on one device without a mesh: what the mesh itself costs.
    completions, *rates = _serve(model_config, devices[:1], requests, args, use_mesh=False)
    rows.append(("1, no mesh", [c.tokens for c in completions], *rates))
  same = sum(a == b for ta, tb in zip(rows[0][1], rows[1][1]) for a, b in zip(ta, tb))
  total = sum(len(t) for t in rows[0][1])
  print(f"device: {devices[0].device_kind}; Llama-style {model_config.num_params / 1e6:.1f}M "
        f"params bf16 ({model_config.num_layers} layers, hidden {model_config.hidden_size}, "
        f"{model_config.num_heads}/{model_config.num_kv_heads} heads x "
        f"{model_config.head_dim}); {args.seqs} requests x ({args.prompt_len} prompt + "
        f"{args.new_tokens} new) tokens, W={args.width}")
  print(f"greedy tokens equal between 1 and {args.devices} devices: {same}/{total} "
        "(bf16: the all-reduce order may flip near-ties)")
  print("generated tokens/s: sampled tokens over the whole run (prefill included); "
        "step tokens/s: prompt + generated tokens through the model")
  print("| devices | generated tokens/s | step tokens/s | steps/s | speed-up |")
  print("|---|---|---|---|---|")
  for n, _, gen, step, steps in rows:
    print(f"| {n} | {gen:.1f} | {step:.1f} | {steps:.2f} | {gen / rows[0][2]:.2f} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--implementation", default=None)
  parser.add_argument("--max-len", type=int, default=8192,
                      help="longest history; lengths are drawn from max_len/16..max_len")
  model = parser.add_argument_group("--model: serve the example Llama-style model")
  model.add_argument("--model", action="store_true", help="run the model benchmark")
  model.add_argument("--tiny", action="store_true", help="tiny model sizes (CPU smoke test)")
  parser.add_argument("--small", action="store_true",
                      help="the decode step over histories of at most 128 tokens, then the tiny "
                      "model (--model --tiny): a smoke test, not a measurement; on CPU give it "
                      "devices with XLA_FLAGS=--xla_force_host_platform_device_count=2")
  model.add_argument("--no-mesh-row", action="store_true",
                     help="also serve on one device without a mesh")
  model.add_argument("--seqs", type=int, default=None, help="requests (64; 4 with --tiny)")
  model.add_argument("--prompt-len", type=int, default=None, help="512; 8 with --tiny")
  model.add_argument("--new-tokens", type=int, default=None, help="128; 8 with --tiny")
  model.add_argument("--width", type=int, default=None,
                     help="step width W = max_write (512; 16 with --tiny)")
  for name in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
    model.add_argument(f"--model-{name}", type=int, default=None)
  args = parser.parse_args()
  if args.small:
    args.max_len, args.iters, args.reps, args.tiny = 128, 1, 1, True
    decode_main(args)
  if args.model or args.small:
    defaults = dict(seqs=(4, 64), prompt_len=(8, 512), new_tokens=(8, 128), width=(16, 512))
    for name, (tiny, full) in defaults.items():
      if getattr(args, name) is None:
        setattr(args, name, tiny if args.tiny else full)
    if len(jax.devices()) < args.devices:
      raise SystemExit(f"--devices={args.devices} but only {len(jax.devices())} devices")
    model_main(args)
    return
  decode_main(args)


def decode_main(args):
  """One decode step of 64 sequences on 1 and `args.devices` devices."""
  devices = jax.devices()
  if len(devices) < args.devices:
    raise SystemExit(f"--devices={args.devices} but only {len(devices)} devices")
  lengths = np.random.default_rng(0).integers(
      args.max_len // 16, args.max_len + 1, NUM_SEQS).astype(np.int32)
  config = _config(lengths)
  live_bytes = int(lengths.sum() + NUM_SEQS) * KV_HEADS * HEAD_DIM * 2 * 2
  out1, ms1 = _measure(config, lengths, devices[:1], args)
  outn, msn = _measure(config, lengths, devices[:args.devices], args)
  err = float(np.abs(outn - out1).max())
  print(f"device: {devices[0].device_kind}; live K/V {live_bytes / 1e9:.2f} GB; "
        f"max |{args.devices}-GPU - 1-GPU| = {err:.2e}")
  print(f"| GPUs | ms/step | effective TB/s | speed-up |")
  print(f"|---|---|---|---|")
  print(f"| 1 | {ms1:.3f} | {live_bytes / ms1 / 1e9:.2f} | 1.00 |")
  print(f"| {args.devices} | {msn:.3f} | {live_bytes / msn / 1e9:.2f} | {ms1 / msn:.2f} |")


if __name__ == "__main__":
  main()
