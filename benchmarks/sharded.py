"""Decode throughput of a KV-head-sharded cache on 1 and 2 GPUs (issue 5).

Decode step for 64 sequences, 64 query / 16 KV heads, head dim 128, bf16, lengths
drawn uniformly from 512..8192 (seed 0): one `jaxkv.pure.attend` (write + varlen
attention) per iteration, run `--iters` times inside one jitted `fori_loop` with
the state donated, on a 1-device mesh and on an N-device mesh of the same
process. Reports ms per step, effective TB/s (live K/V bytes / time) and the
speed-up. Checks the N-device output against the 1-device output first.

Usage: python benchmarks/sharded.py [--devices 2] [--iters 20] [--implementation mosaic_gpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxkv

NUM_SEQS, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 64, 16, 128


def _config(lengths):
  layer = jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), KV_HEADS, HEAD_DIM)
  max_len = int(lengths.max()) + 1
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


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--implementation", default=None)
  parser.add_argument("--max-len", type=int, default=8192,
                      help="longest history; lengths are drawn from max_len/16..max_len")
  args = parser.parse_args()
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
