"""What a loop check costs a decode step of the e2e model: the same padded cuDNN decode step in four loop forms.

`jaxkv.serve`'s loop checks a traced predicate before every step (a `while_loop` whose
condition depends on the loop state); on a GPU XLA reads that predicate back to the host
and launches the next iteration's work only then, so the GPU waits for the read-back and
for the launch of the step's graph. A `fori_loop` with a static trip count needs no
read-back. `profile_step.py` saw the engine's decode step idle ~0.17 ms of 1.76 ms (GPU
busy 1.60) while the padded loop (a static `fori_loop`) idled none. This script runs e2e's
padded decode step (`e2e._dense_forward`, cuDNN attention, the e2e model's shape and
random weights, 64 sequences) `--steps` times in one process, each form after a warm-up:

- `static`: `fori_loop(0, steps)` (the padded baseline's form);
- `traced`: `while_loop(i < n)` with `n` a traced argument (the engine's form: one
  read-back per step);
- `chunks of K`: `while_loop(i < n)` whose body is a static `fori_loop` of K steps (one
  read-back per K steps);
- `unrolled x2`: `while_loop(i < n)` whose body runs two steps.

Usage (GPU machine): `PYTHONPATH=. python3 benchmarks/loop_sync.py [--steps 256] [--small]`
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e   # pylint: disable=g-import-not-at-top,wrong-import-position


def build(small: bool, seqs: int, context: int):
  cfg = e2e._model_config(small)   # pylint: disable=protected-access
  from flax import nnx   # pylint: disable=g-import-not-at-top
  cache = cfg.cache_config(capacity=256, max_seqs=1, max_write=8, kv_dtype=jnp.bfloat16,
                           initial_capacity=256)
  model = e2e.Decoder(cfg, cache, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                      rngs=nnx.Rngs(0))
  w = e2e._weights(model)   # pylint: disable=protected-access
  impl = "cudnn" if jax.devices()[0].platform == "gpu" else "xla"
  shape = (seqs, context, cfg.num_kv_heads, cfg.head_dim)
  caches = [jax.random.normal(jax.random.key(l), shape, jnp.bfloat16) * 0.1
            for l in range(cfg.num_layers)]
  return cfg, impl, w, caches


def step_fn(cfg, impl, w, lens):
  """One padded decode step: `(i, (tokens, k, v)) -> (tokens, k, v)`, position `lens + i`.

  `w` and `lens` are the traced arguments of the jitted form (never closed-over
  constants, which would embed the weights in the executable)."""
  b = lens.shape[0]

  def step(i, carry):
    tok, k_cache, v_cache = carry
    pos = lens + i
    h, k_cache, v_cache = e2e._dense_forward(   # pylint: disable=protected-access
        cfg, impl, w, tok[:, None], pos[:, None], k_cache, v_cache,
        jnp.ones((b,), jnp.int32), pos + 1, False)
    nxt = jnp.argmax((h[:, 0] @ w["embed"].T).astype(jnp.float32), axis=-1).astype(jnp.int32)
    return nxt, k_cache, v_cache

  return step


def forms(cfg, impl, steps: int):
  """`{name: jitted fn(w, lens, tok, k, v, n) -> (tok, k, v)}` running `steps` steps (n = steps, traced)."""
  def static(w, lens, tok, k, v, n):
    del n
    return jax.lax.fori_loop(0, steps, step_fn(cfg, impl, w, lens), (tok, k, v))

  def traced(w, lens, tok, k, v, n):
    step = step_fn(cfg, impl, w, lens)

    def body(c):
      i, carry = c
      return i + 1, step(i, carry)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), (tok, k, v)))[1]

  def chunks(size):
    def run(w, lens, tok, k, v, n):
      step = step_fn(cfg, impl, w, lens)

      def body(c):
        i, carry = c
        carry = jax.lax.fori_loop(0, size, lambda j, cc: step(i + j, cc), carry)
        return i + size, carry
      return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), (tok, k, v)))[1]
    return run

  def unrolled(w, lens, tok, k, v, n):
    step = step_fn(cfg, impl, w, lens)

    def body(c):
      i, carry = c
      return i + 2, step(i + 1, step(i, carry))
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), (tok, k, v)))[1]

  out = {"static": static, "traced": traced, "chunks of 8": chunks(8),
         "chunks of 4": chunks(4), "unrolled x2": unrolled}
  return {name: jax.jit(fn, donate_argnums=(3, 4)) for name, fn in out.items()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=256)
  p.add_argument("--seqs", type=int, default=64)
  p.add_argument("--context", type=int, default=512)
  p.add_argument("--small", action="store_true")
  args = p.parse_args(argv)
  if args.steps % 8:
    raise SystemExit(f"--steps={args.steps} must be a multiple of 8 (the largest chunk)")
  cfg, impl, w, caches = build(args.small, args.seqs, args.context)
  rng = np.random.default_rng(0)
  lens = jnp.asarray(rng.integers(8, args.context - args.steps, args.seqs), jnp.int32)
  fns = forms(cfg, impl, args.steps)
  print(f"device {jax.devices()[0].device_kind}; {cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}; {args.seqs} sequences; attention {impl}; {args.steps} steps per call")
  tok0 = jnp.zeros((args.seqs,), jnp.int32)
  n = jnp.int32(args.steps)
  results, outputs = {}, {}
  for rep in range(2):   # each form twice, interleaved, after its compile
    for name, fn in fns.items():
      k = [c.copy() for c in caches]
      v = [c.copy() for c in caches]
      if rep == 0:   # compile and warm up on a copy
        jax.block_until_ready(fn(w, lens, tok0, [c.copy() for c in caches],
                                 [c.copy() for c in caches], n))
      jax.block_until_ready((k, v))
      t0 = time.perf_counter()
      tok, k, v = fn(w, lens, tok0, k, v, n)
      tok.block_until_ready()
      results.setdefault(name, []).append(1e3 * (time.perf_counter() - t0) / args.steps)
      outputs[name] = np.asarray(tok)
  base = np.mean(results["static"])
  for name, ms in results.items():
    same = np.array_equal(outputs[name], outputs["static"])
    print(f"{name:>12}: {' / '.join(f'{x:.3f}' for x in ms)} ms/step "
          f"({np.mean(ms) - base:+.3f} vs static); last tokens equal to static: {same}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
