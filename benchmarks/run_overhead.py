"""What one `Engine.run` costs besides its steps: building the loop state, entering the loop, reading back.

The device trace of `profile_step.py` shows the GPU idle between runs' eager set-up
operations (`init_loop_state` makes ~100 small arrays and the K/V zeros one by one).
This script times, on the e2e model (Llama-3.2-1B shape, bf16, 64 columns of 2,304
rows, W = 2048), `init_loop_state` alone (one compiled call per leaf group, and op
by op under `jax.disable_jit()`, as it was built before) and a whole `Engine.run` of
64 one-token requests (one prefill step), each the mean of back-to-back calls after
a warm-up.

Usage (GPU machine, repository root): PYTHONPATH=. python3 benchmarks/run_overhead.py
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e   # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import serve   # pylint: disable=wrong-import-position


def _mean_ms(fn, reps=5):
  fn()
  start = time.perf_counter()
  for _ in range(reps):
    fn()
  return 1e3 * (time.perf_counter() - start) / reps


def main() -> int:
  small = "--small" in sys.argv
  cfg = e2e._model_config(small)   # pylint: disable=protected-access
  rows, slots = (2304, 64) if not small else (64, 4)
  cache = cfg.cache_config(capacity=slots * rows, max_seqs=slots, max_write=2048 if not small else 32,
                           kv_dtype=jnp.bfloat16, initial_capacity=rows)
  model = e2e.Decoder(cfg, cache, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  engine = serve.Engine(model, max_len=rows)
  rng = np.random.default_rng(0)
  requests = [serve.Request(tuple(int(t) for t in rng.integers(0, cfg.vocab_size, 8)),
                            serve.SamplingParams(max_tokens=1)) for _ in range(slots)]
  queue = serve.pack_queue([r.prompt for r in requests], [r.params for r in requests],
                           max_len=engine.max_len, max_stop=engine.max_stop)

  def init():
    engine.state = None
    jax.block_until_ready(serve.init_loop_state(cache, queue, num_widths=len(engine.widths)))

  init_ms = _mean_ms(init)
  with jax.disable_jit():   # op by op, as init_loop_state made them before (one dispatch each)
    eager_ms = _mean_ms(init)
  run_ms = _mean_ms(lambda: engine.run(requests))
  steps = engine.stats.steps
  print(f"device {jax.devices()[0].device_kind}; K/V {2 * cfg.num_layers} arrays of "
        f"{rows} x {slots + 1} x {cfg.num_kv_heads} x {cfg.head_dim}")
  print(f"init_loop_state: {init_ms:.2f} ms (op by op: {eager_ms:.2f} ms); Engine.run of {slots} one-token requests: "
        f"{run_ms:.2f} ms ({steps} steps, {engine.stats.loop_entries} loop entries)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
