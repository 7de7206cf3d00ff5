"""Prefix caching and paged admission, measured by counting (runs on CPU; issue 13).

Two measurements, both from `EngineStats`, neither a timing:

1. **Prefill tokens computed** for `--requests` requests sharing a
   `--system`-token system prompt, each with a unique tail of 8-40 tokens:
   paged storage with `prefix_cache=True` against the same engine without it.
   Target: <= system + the unique parts.
2. **Requests in flight for the same memory**: a mix of short and long
   requests, served by the column engine (every column holds `max_len` rows)
   and by a paged engine whose pool has the same K/V bytes
   (`jaxkv.serve.paged_cache_config`): the mean and peak number of sequences
   per step.

Usage: `python benchmarks/prefix_cache.py [--requests 256 --system 2000] [--small]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import jax
import numpy as np
from flax import nnx

import jaxkv
from jaxkv import serve
from jaxkv.serve.memory import ROW_MULTIPLE, storage_bytes
from jaxkv.models import Decoder, ModelConfig

MODEL = ModelConfig.llama(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)


def _model(cache: jaxkv.CacheConfig):
  return Decoder(MODEL, cache, rngs=nnx.Rngs(0))


def _prefill_tokens(engine, completions) -> int:
  """Tokens the steps computed for prompts: every step token but the fed generated ones."""
  decode = sum(max(len(c.tokens) - 1, 0) for c in completions)
  return engine.stats.step_tokens - decode


def prefix_case(args, rng) -> dict:
  system = tuple(int(t) for t in rng.integers(0, 256, args.system))
  requests = [serve.Request(system + tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(
      8, 41)))), serve.SamplingParams(max_tokens=4), request_id=i) for i in range(args.requests)]
  unique = sum(len(r.prompt) - args.system for r in requests)
  max_len = args.system + 48
  cache = dataclasses.replace(
      MODEL.cache_config(capacity=args.seqs * max_len, max_seqs=args.seqs, max_write=args.width),
      page_size=args.page)
  out = {"requests": args.requests, "system_tokens": args.system, "unique_tokens": unique,
         "target": args.system + unique}
  for prefix in (True, False):
    engine = serve.Engine(_model(cache), max_len=max_len, prefix_cache=prefix)
    started = time.perf_counter()
    done = engine.run(requests)
    key = "with_prefix_cache" if prefix else "without"
    out[key] = {"prefill_tokens": _prefill_tokens(engine, done),
                "cached_tokens": engine.stats.cached_tokens,
                "evictions": engine.stats.evictions, "preemptions": engine.stats.preemptions,
                "steps": engine.stats.steps, "seconds": round(time.perf_counter() - started, 1)}
    if not args.both:
      break
  return out


def in_flight_case(args, rng) -> dict:
  """Columns vs paged at equal K/V bytes, on 3/4 short (24-64 tokens) and 1/4 long requests."""
  # max_len a multiple of ROW_MULTIPLE: the column engine starts with (and keeps)
  # max_len flat rows, so its bytes are known before it runs.
  max_len, cols = -(-(args.long + 8) // ROW_MULTIPLE) * ROW_MULTIPLE, args.flight_columns
  lengths = [int(rng.integers(24, 65)) if i % 4 else args.long for i in range(args.flight)]
  requests = [serve.Request(tuple(int(t) for t in rng.integers(0, 256, n - 8)),
                            serve.SamplingParams(max_tokens=8), request_id=i)
              for i, n in enumerate(lengths)]
  column_cache = MODEL.cache_config(capacity=cols * max_len, max_seqs=cols, max_write=args.width,
                                    initial_capacity=max_len)
  column_bytes = storage_bytes(jax.eval_shape(lambda: jaxkv.init_state(column_cache)))
  paged_cache = serve.paged_cache_config(
      dataclasses.replace(column_cache, max_seqs=args.flight_paged_seqs), column_bytes,
      page_size=args.page)
  out = {"requests": args.flight, "kv_bytes": column_bytes}
  for name, cache in (("columns", column_cache), ("paged", paged_cache)):
    engine = serve.Engine(_model(cache), max_len=max_len, max_steps=16)
    peak = []
    engine.run(requests, on_progress=lambda s, _: peak.append(int(np.asarray(
        engine.state.cols.active).sum())))
    bytes_ = storage_bytes(engine.state.cache)   # as allocated (columns may grow)
    out[name] = {"max_seqs": cache.max_seqs, "capacity": cache.capacity, "kv_bytes": bytes_,
                 "mean_in_flight": round(engine.stats.occupancy / engine.stats.steps, 2),
                 "peak_in_flight_sampled": max(peak), "steps": engine.stats.steps,
                 "preemptions": engine.stats.preemptions}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--requests", type=int, default=256)
  parser.add_argument("--system", type=int, default=2000)
  parser.add_argument("--seqs", type=int, default=8, help="max_seqs of the prefix case")
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--page", type=int, default=16)
  parser.add_argument("--both", action="store_true",
                      help="also run the prefix case without prefix caching (slow on CPU)")
  parser.add_argument("--flight", type=int, default=64)
  parser.add_argument("--long", type=int, default=500)
  parser.add_argument("--flight-columns", type=int, default=4)
  parser.add_argument("--flight-paged-seqs", type=int, default=32)
  parser.add_argument("--skip-flight", action="store_true")
  parser.add_argument("--skip-prefix", action="store_true")
  parser.add_argument("--small", action="store_true",
                      help="4 requests over a 32-token system prompt and 8 in flight: a smoke "
                      "test of the script, not the measurement")
  args = parser.parse_args()
  if args.small:
    args.requests, args.system, args.seqs, args.width = 4, 32, 4, 64
    args.flight, args.long, args.flight_columns, args.flight_paged_seqs = 8, 64, 2, 4
  rng = np.random.default_rng(0)
  result = {"machine": platform.processor() or platform.machine(), "date": time.strftime(
      "%Y-%m-%d")}
  if not args.skip_prefix:
    result["prefix"] = prefix_case(args, rng)
  if not args.skip_flight:
    result["in_flight"] = in_flight_case(args, rng)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
