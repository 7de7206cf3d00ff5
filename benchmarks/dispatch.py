"""The host's cost of one jitted call, by how many arrays it takes and returns.

The stepping driver (`jaxkv serve`) calls one jitted step per engine step with the
model's parameters (one array each) and the loop state (donated, and returned); on
a GPU the call returns before the device runs the step, so what it costs the host is
dispatch alone: per-argument checks, the runtime's per-buffer bookkeeping, and the
interpreter lock taken back afterwards. This measures that cost on synthetic
arguments of the engine's shape (`--params` small read-only arrays and `--state`
donated ones, or the state packed into `--packed` arrays), alone and with
`--busy-threads` Python threads competing for the interpreter lock at the serving
switch interval, so a serving trace's "in step calls" can be split into the call
itself and the wait for the lock.

    PYTHONPATH=. python benchmarks/dispatch.py --small
    PYTHONPATH=. python3 benchmarks/dispatch.py --params 147 --state 118 --packed 8
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--params", type=int, default=147, help="read-only array arguments")
  p.add_argument("--state", type=int, default=118, help="donated array arguments (returned)")
  p.add_argument("--packed", type=int, default=8,
                 help="the state's arrays packed into this many (a row also times that)")
  p.add_argument("--calls", type=int, default=400, help="calls per timing")
  p.add_argument("--busy-threads", type=int, default=1,
                 help="Python threads spinning beside the caller in the contended rows")
  p.add_argument("--switch-us", type=float, default=100.0, help="sys.setswitchinterval, us")
  p.add_argument("--small", action="store_true", help="a few calls (a smoke test)")
  p.add_argument("--out", help="write the rows as JSON here")
  return p.parse_args(argv)


def _time_calls(fn, params, state, calls) -> float:
  """Host seconds per call of `fn(params, state)` (the state donated and threaded through)."""
  import jax   # pylint: disable=g-import-not-at-top
  state = fn(params, state)
  jax.block_until_ready(state)
  best = float("inf")
  for _ in range(3):
    spent = 0.0
    for _ in range(calls):
      t = time.perf_counter()
      state = fn(params, state)
      spent += time.perf_counter() - t
    jax.block_until_ready(state)   # never timed: the device's share is not the host's cost
    best = min(best, spent / calls)
  return best


def main(argv=None) -> int:
  args = _args(argv)
  if args.small:
    args.calls = 20
  import jax   # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp   # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  params = [jax.device_put(np.full((256,), i, np.float32), device) for i in range(args.params)]

  def step(params, state):   # touches every argument, as a step reads every parameter
    total = sum(jnp.sum(p[:1]) for p in params) if params else 0.0
    return [s + total.astype(s.dtype) for s in state]

  fn = jax.jit(step, donate_argnums=1)
  rows = []
  sys.setswitchinterval(args.switch_us * 1e-6)
  for label, n_state in (("state as separate arrays", args.state),
                         (f"state packed into {args.packed}", args.packed)):
    state = [jax.device_put(np.zeros((64,), np.int32), device) for _ in range(n_state)]
    for busy in (0, args.busy_threads):
      stop = threading.Event()

      def spin():
        x = 0
        while not stop.is_set():
          x += 1

      threads = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
      for t in threads:
        t.start()
      try:
        seconds = _time_calls(fn, params, state, args.calls)
      finally:
        stop.set()
        for t in threads:
          t.join()
      state = [jax.device_put(np.zeros((64,), np.int32), device) for _ in range(n_state)]
      rows.append({"case": label, "params": args.params, "state": n_state,
                   "busy_threads": busy, "us_per_call": 1e6 * seconds})
      print(f"{label:<28} params {args.params:4d} state {n_state:4d} busy threads {busy}: "
            f"{1e6 * seconds:8.1f} us per call", flush=True)
  print(f"device {device.device_kind}; switch interval {args.switch_us:g} us", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"device": device.device_kind, "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
