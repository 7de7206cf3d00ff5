"""Speculative decoding in the engine: throughput against acceptance, beside plain decoding.

Random weights make a real drafter's acceptance meaningless, so the main rows use an
*oracle* drafter (`SpeculativeConfig(method="custom")`): it knows each request's greedy
continuation, from a plain (non-speculative) run of the same queue in the same process,
and replaces each proposed token by a wrong one with probability `1 - a`: an exact,
controllable per-token acceptance `a` (the engine's own counters report the acceptance it
measured).

The oracle needs a greedy continuation that the verify step's other shapes cannot change:
on a GPU, a random model's near-tie argmax flips between a 1-row decode and a `k + 1`-row
verify (different GEMM shapes, different rounding), and after one flip the oracle proposes
another sequence's future. So the oracle rows run on `copy_model`: the same weights with
every layer's output projections scaled down, whose greedy next token is its input token
by a wide margin. Its shapes, kernels and costs are the random model's (no cost depends on
token values); its outputs must equal plain decoding's (the script raises otherwise).

Rows, for each sequence count (`--seqs`) and `k` (`--ks`): plain decoding, then the
oracle at each acceptance of `--accepts`, each timed by `Engine.run`'s wall clock
(compilation excluded: every engine runs the queue once first; rounds alternate the
engines, best of `--repeats`). Then, on the random model, the n-gram drafter (prompt
lookup) on a repetitive workload (prompts that repeat a random segment): its acceptance
is the real one for these weights, which tells nothing of a trained model's, and its
outputs unlike plain decoding's are counted, not refused (the flips above).

The model is e2e.py's (Llama-3.2-1B-shaped, bf16). `--workload decode` (default): prompts
of 64..128 tokens, `--new-tokens` each, one request per sequence; `--workload mixed`:
e2e.py's lognormal mix (prompt median 300, output median 150), four requests per sequence.

Usage: python benchmarks/speculative.py [--small] [--seqs 16,64] [--ks 4] [--accepts 0,0.8,1]
       [--workload decode|mixed] [--out spec.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxkv import serve   # pylint: disable=wrong-import-position
from jaxkv.models import Decoder   # pylint: disable=wrong-import-position
import e2e   # pylint: disable=g-import-not-at-top,wrong-import-position

KEY = 8   # prompt tokens that identify a request to the oracle (prompts are random)


class OracleDrafter:
  """Proposes each column's true greedy continuation, each token replaced by a wrong one
  with probability `1 - accept` of its request (drawn once, per position: exact rates).

  A device function of the loop's `(tokens, length, k)`: the column's first `KEY` prompt
  tokens find its request's row of `references` (full greedy sequences).
  """

  def __init__(self, references, accepts, vocab: int, seed: int = 0):
    rows, width = len(references), max(len(r) for r in references)
    self.ref = np.full((rows, width), -1, np.int32)
    for i, r in enumerate(references):
      self.ref[i, :len(r)] = r
    self.size = np.asarray([len(r) for r in references], np.int32)
    rng = np.random.default_rng(seed)
    self.ok = rng.random((rows, width)) < np.asarray(accepts, np.float64)[:, None]
    self.vocab = vocab
    keys = {tuple(r[:KEY]) for r in references}
    if len(keys) != rows:
      raise ValueError("OracleDrafter: two references share their first prompt tokens")

  __hash__ = object.__hash__   # the jit key: one compiled loop per drafter object

  def __eq__(self, other):
    return self is other

  def __call__(self, tokens, length, k):
    ref, ok, size = jnp.asarray(self.ref), jnp.asarray(self.ok), jnp.asarray(self.size)
    match = jnp.all(tokens[:, None, :KEY] == ref[None, :, :KEY], axis=2)   # [S, rows]
    row = jnp.argmax(match, axis=1)
    at = jnp.clip(length[:, None] + jnp.arange(k)[None, :], 0, ref.shape[1] - 1)
    truth = jnp.take_along_axis(ref[row], at, axis=1)
    draft = jnp.where(jnp.take_along_axis(ok[row], at, axis=1), truth, (truth + 1) % self.vocab)
    count = jnp.where(match.any(axis=1), jnp.clip(size[row] - length, 0, k), 0)
    return draft, count


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", default="16,64", help="sequence counts (engine columns)")
  p.add_argument("--ks", default="4", help="draft lengths k")
  p.add_argument("--accepts", default="0,0.8,1",
                 help="the oracle's per-token acceptance probabilities")
  p.add_argument("--max-pauses", default=str(serve.SpeculativeConfig().max_pause),
                 help="the oracle's SpeculativeConfig.max_pause values (0: never pause), "
                      "one engine each")
  p.add_argument("--workload", choices=["decode", "mixed"], default="decode")
  p.add_argument("--new-tokens", type=int, default=256, help="decode: tokens per request")
  p.add_argument("--max-write", type=int, default=512, help="step width W")
  p.add_argument("--repeats", type=int, default=3, help="timed rounds (engines alternate)")
  p.add_argument("--skip-ngram", action="store_true")
  p.add_argument("--small", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--out", default=None, help="write the results as JSON here")
  args = p.parse_args(argv)

  def ints(name, text, low):
    try:
      values = [int(v) for v in text.split(",")]
    except ValueError:
      p.error(f"--{name} {text!r}: a comma-separated list of integers")
    if not values or min(values) < low:
      p.error(f"--{name} {text!r}: each must be >= {low}")
    return values

  args.seqs = ints("seqs", args.seqs, 1)
  args.ks = ints("ks", args.ks, 1)
  args.max_pauses = ints("max-pauses", args.max_pauses, 0)
  try:
    args.accepts = [float(v) for v in args.accepts.split(",")]
  except ValueError:
    p.error(f"--accepts {args.accepts!r}: a comma-separated list of numbers in [0, 1]")
  if not all(0 <= a <= 1 for a in args.accepts):
    p.error(f"--accepts {args.accepts}: each must be in [0, 1]")
  if args.new_tokens < 1 or args.repeats < 1:
    p.error("--new-tokens and --repeats must be >= 1")
  if max(args.ks) >= args.max_write:
    p.error(f"--ks {max(args.ks)}: k + 1 must fit one step (--max-write {args.max_write})")
  if args.small:
    args.seqs, args.new_tokens, args.max_write = [min(s, 4) for s in args.seqs][:1], 12, 32
    args.ks, args.repeats = [min(k, 3) for k in args.ks][:1], 1
  return args


def _queue(args, rng, cfg, seqs: int, count: int):
  """`count` queues of prompts and new-token counts (one per acceptance level and the n-gram
  workload), all of the same lengths, so one engine (one `max_len`) serves them all."""
  if args.workload == "decode":
    n = seqs
    lens = rng.integers(8 if args.small else 64, (16 if args.small else 128) + 1, size=n)
    news = [args.new_tokens] * n
  else:
    n = 4 * seqs
    lens = e2e._lengths(rng, n, 12 if args.small else 300, 40 if args.small else 2048,   # pylint: disable=protected-access
                        floor=KEY)
    news = e2e._lengths(rng, n, 6 if args.small else 150, 12 if args.small else 768)   # pylint: disable=protected-access
  prompts = [e2e.random_prompts(rng, cfg, lens) for _ in range(count)]
  return prompts, news


def _repetitive(rng, cfg, lens):
  """Prompts that repeat a random segment of 16 tokens (8 under --small) to their length."""
  out = []
  for n in lens:
    segment = rng.integers(0, cfg.vocab_size, size=min(16, max(KEY, n // 4))).tolist()
    out.append((segment * (n // len(segment) + 1))[:n])
  return out


def _requests(prompts, news):
  return [serve.Request(tuple(p), serve.SamplingParams(max_tokens=n)) for p, n in zip(prompts, news)]


def _timed(engine, requests):
  start = time.perf_counter()
  out = engine.run(requests)
  seconds = time.perf_counter() - start
  stats = engine.stats
  return seconds, [r.tokens for r in out], {
      "steps": stats.steps, "generated": stats.generated, "drafted": stats.draft_tokens,
      "accepted": stats.accepted_tokens}


def copy_model(model):
  """`model` with every layer's output projections scaled by 1e-3, in place: the residual
  stream stays the input token's embedding, so the tied LM head's argmax is the input token
  by a wide margin. Same shapes and kernels as the random model (the costs are its), but a
  greedy continuation no floating-point difference of the step shapes can flip."""
  for layer in model.layers:
    for param in (layer.attn.o_proj.kernel, layer.mlp.down_proj.kernel):
      param[...] = param[...] * jnp.asarray(1e-3, param.dtype)
  return model


def _run_rows(engines, runs, refs, repeats, strict):
  """Times `runs` ((engine, queue index, row)) alternated over `repeats` rounds; a row's
  `differ` counts its outputs unequal to plain decoding's (`refs`); raises if `strict`."""
  rows = {row: {"seconds": []} for _, _, row in runs}
  for _ in range(repeats):
    for name, qi, row in runs:
      seconds, tokens, counts = _timed(engines[name], engines["queues"][qi])
      differ = sum(a != b for a, b in zip(tokens, refs[qi]))
      if differ and strict:
        raise RuntimeError(f"{row}: {differ} of {len(tokens)} outputs differ from plain decoding")
      rows[row]["seconds"].append(seconds)
      rows[row].update(counts, differ=differ)
  for r in rows.values():
    r["best"] = min(r["seconds"])
    r["tokens_per_s"] = r["generated"] / r["best"]
    r["ms_per_step"] = 1e3 * r["best"] / r["steps"]
    r["acceptance"] = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
  return rows


def _measure(args, cfg, seqs: int, rng) -> dict:
  """Every row of one sequence count: {name: result}.

  The oracle rows run on `copy_model` (its greedy tokens are exact across step shapes, so
  the oracle's acceptance is exactly the one asked for, and outputs must equal plain
  decoding's); the n-gram rows on the random model, where a verify step's other shapes may
  flip a near-tie argmax (`differ` counts those outputs, as the GPU's numerics give them).
  """
  levels = args.accepts
  prompts, news = _queue(args, rng, cfg, seqs, len(levels) + 1)
  prompts[-1] = _repetitive(rng, cfg, [len(p) for p in prompts[-1]])
  cache = e2e.workload_cache(cfg, prompts[0], news, slots=seqs, max_write=args.max_write)
  from flax import nnx   # pylint: disable=g-import-not-at-top
  build = lambda: Decoder(cfg, cache, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                          rngs=nnx.Rngs(0))
  max_len = max(len(p) + n for p, n in zip(prompts[0], news))
  queues = [_requests(p, news) for p in prompts]
  results = {}
  for target in ("copy", "random"):
    model = copy_model(build()) if target == "copy" else build()
    t0 = time.perf_counter()
    engines = {"queues": queues, "plain": serve.Engine(model, max_len=max_len)}
    engines["plain"].run(queues[0])   # compiles
    mine = range(len(levels)) if target == "copy" else [len(queues) - 1]
    refs = {i: _timed(engines["plain"], queues[i])[1] for i in mine}
    print(f"  {target} model: plain engine compiled and ran {len(mine)} queues in "
          f"{time.perf_counter() - t0:.0f} s")
    if target == "copy":
      references = [list(p) + list(t) for i in mine for p, t in zip(prompts[i], refs[i])]
      accepts = [a for a in levels for _ in prompts[0]]
      runs = [("plain", 0, "plain (copy model)")]
      for k in args.ks:
        drafter = OracleDrafter(references, accepts, cfg.vocab_size, seed=k)
        for pause in args.max_pauses:
          name = f"oracle k={k}" + (f" max_pause {pause}" if len(args.max_pauses) > 1 else "")
          spec = serve.SpeculativeConfig(method="custom", k=k, drafter=drafter, max_pause=pause)
          engines[name] = serve.Engine(model, max_len=max_len, speculative=spec)
          runs += [(name, i, f"{name} accept {a:g}") for i, a in enumerate(levels)]
    else:
      if args.skip_ngram:
        break
      k = max(args.ks)
      spec = serve.SpeculativeConfig(method="ngram", k=k, ngram_min=1, ngram_max=3)
      engines[f"ngram k={k}"] = serve.Engine(model, max_len=max_len, speculative=spec)
      runs = [("plain", len(queues) - 1, "plain (random model), repetitive prompts"),
              (f"ngram k={k}", len(queues) - 1, f"ngram k={k} (random model), repetitive prompts")]
    for name, engine in engines.items():
      if name not in ("queues", "plain"):
        t0 = time.perf_counter()
        engine.run(queues[0])
        print(f"  {target} model, {name}: compiled and warmed up in {time.perf_counter() - t0:.0f} s")
    rows = _run_rows(engines, runs, refs, args.repeats, strict=target == "copy")
    base = rows[runs[0][2]]
    for r in rows.values():
      r["speedup"] = base["best"] / r["best"]
    results.update(rows)
    del engines, model
  return results


def main(argv=None) -> int:
  args = _args(argv)
  cfg = e2e._model_config(args.small)   # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  results = {"device": jax.devices()[0].device_kind, "params": cfg.num_params,
             "workload": args.workload, "new_tokens": args.new_tokens,
             "max_write": args.max_write, "repeats": args.repeats, "by_seqs": {}}
  print(f"device {results['device']}; model {cfg.num_params / 1e9:.2f}B params; workload "
        f"{args.workload}; ks {args.ks}; oracle acceptances {args.accepts}; best of "
        f"{args.repeats} rounds")
  for seqs in args.seqs:
    print(f"{seqs} sequences:")
    rows = _measure(args, cfg, seqs, rng)
    results["by_seqs"][str(seqs)] = rows
    print(f"| {seqs} seqs | s (best) | tok/s | x plain | steps | ms/step | drafted | accepted | "
          "acceptance | outputs unlike plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row, r in rows.items():
      print(f"| {row} | {r['best']:.3f} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
            f"{r['steps']} | {r['ms_per_step']:.2f} | {r['drafted']} | {r['accepted']} | "
            f"{r['acceptance']:.3f} | {r['differ']}/{seqs if args.workload == 'decode' else 4 * seqs} |")
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
  print("the oracle rows' tokens equal plain decoding's (copy model)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
