"""What each candidate lever is worth before it is built: the decode step with parts switched off.

An experiment, not a product path: each variant replaces one part of the serving
step for the duration of its run (by patching module attributes in this process
only) and times the e2e decode workload (64 requests, 8-16-token prompts, greedy)
through `jaxkv.serve.Engine`, beside the padded cuDNN loop on the same weights.
Compilation is excluded (each engine serves the queue once first); timing is the
mean step time of one timed run.

Variants:
- `base`: the engine as shipped.
- `sample_cond`: the engine serves the greedy queue with its general loop (the
  sampler behind a `lax.cond`, as for a queue with any sampling request) instead
  of its greedy loop: measures the cond's host synchronisation on GPU.
- `no_splits`: the attention kernels never split a segment (`max_splits=1`), so
  the split merge (three XLA kernels per layer) is compiled out: measures the
  merge's cost on a workload that never splits.
- `both`: `sample_cond` and `no_splits`.
- `kernel_epilogue`: the attention epilogue as the Mosaic GPU kernel
  (`fused_combine=True`, `combine_sm90`) instead of XLA operations (the default).
- `mlp_apart`: narrow steps keep the MLP's gate and up matmuls apart too
  (`decoder._MERGE_ROWS = 0`), so XLA may fuse the activation into the down
  GEMM instead of running it as a kernel of its own.
- `no_refusal_selects`: every verb keeps its new control values without the
  select against the old ones that a refusal needs (`_verbs._select_control`);
  timing only (this workload refuses nothing): what folding those selects into
  their producers could save at most.

- `xla_gemm`: every layer's output and down projections keep XLA's GEMM at decode widths
  instead of `pallas_kernels.skinny_gemm` (the model's default `gemm` on a Hopper GPU); the
  Linears' `dot_general` is replaced by `jax.lax.dot_general`.
- `rows64` / `rows128`: `skinny_gemm.MAX_ROWS` set to 64 / 128 for the run, so decode steps
  of 65-128 rows (`--requests 128`) keep XLA's GEMMs / take the kernel's 128-row blocks.

`--uniform` times e2e.py's uniform workload instead (64 prompts of 128..2,048
tokens, 256 new tokens, W = 2,048) and prints the whole run beside the padded loop.

Usage (GPU machine, repository root): PYTHONPATH=. python3 benchmarks/step_levers.py [--small]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import e2e   # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import _verbs as verbs_module   # pylint: disable=wrong-import-position
from jaxkv import serve   # pylint: disable=wrong-import-position
from jaxkv.models import decoder as decoder_module   # pylint: disable=wrong-import-position
from jaxkv.serve import engine as engine_module   # pylint: disable=wrong-import-position
from pallas_kernels import config as kernel_config   # pylint: disable=wrong-import-position
from pallas_kernels import skinny_gemm   # pylint: disable=wrong-import-position


@contextlib.contextmanager
def _patched(obj, name, value):
  old = getattr(obj, name)
  setattr(obj, name, value)
  try:
    yield
  finally:
    setattr(obj, name, old)


def _no_split_default(*args, **kwargs):
  config = _DEFAULT(*args, **kwargs)
  return dataclasses.replace(config, max_splits=1, split_budget=0)


def _kernel_epilogue_default(*args, **kwargs):
  return dataclasses.replace(_DEFAULT(*args, **kwargs), fused_combine=True)


_DEFAULT = kernel_config.default_varlen_attention_config

def _variant(name, model=None):
  stack = contextlib.ExitStack()
  if name in ("rows64", "rows128"):
    stack.enter_context(_patched(skinny_gemm, "MAX_ROWS", int(name[4:])))
  if name == "xla_gemm":
    for layer in model.layers:
      for linear in (layer.attn.o_proj, layer.mlp.down_proj):
        stack.enter_context(_patched(linear, "dot_general", jax.lax.dot_general))
  if name in ("sample_cond", "both"):
    stack.enter_context(_patched(engine_module, "plain_greedy", lambda params: False))
  if name in ("no_splits", "both"):
    stack.enter_context(_patched(kernel_config, "default_varlen_attention_config",
                                 _no_split_default))
  if name == "mlp_apart":
    stack.enter_context(_patched(decoder_module, "_MERGE_ROWS", 0))
  if name == "no_refusal_selects":
    stack.enter_context(_patched(verbs_module, "_select_control", lambda ok, new, old: new))
  if name == "kernel_epilogue":
    stack.enter_context(_patched(kernel_config, "default_varlen_attention_config",
                                 _kernel_epilogue_default))
  return stack


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true")
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--variants", default="base,sample_cond,no_splits,both")
  p.add_argument("--uniform", action="store_true", help="e2e.py's uniform workload instead")
  p.add_argument("--requests", type=int, default=64,
                 help="requests, one slot each (a decode step's rows); default 64")
  args = p.parse_args(argv)
  if args.requests < 1:
    p.error(f"--requests must be at least 1, got {args.requests}")
  cfg = e2e._model_config(args.small)   # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  n_req = args.requests if not args.small else 4
  new = args.new_tokens if not args.small else 4
  if args.uniform:   # as e2e.py --workload uniform --max-write 2048 draws and sizes it
    lo, hi, width = (128, 2048, 2048) if not args.small else (4, 40, 32)
    lens = rng.integers(lo, hi + 1, size=n_req)
  else:
    lens, width = rng.integers(8, 17, size=n_req), 512 if not args.small else 16
  prompts = e2e.random_prompts(rng, cfg, lens)
  cache = e2e.workload_cache(cfg, prompts, [new] * n_req, slots=n_req, max_write=width)
  from flax import nnx   # pylint: disable=g-import-not-at-top
  model = e2e.Decoder(cfg, cache, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  base, _ = e2e.run_baseline(cfg, model, prompts, new)
  print(f"device {jax.devices()[0].device_kind}; model gemm={model.gemm!r}; padded "
        f"{base['attention']} loop: "
        f"{base['ms_per_decode_step']:.3f} ms per decode step, {base['seconds']:.3f} s in all")
  print("| variant | ms/step | steps | vs padded decode step | seconds | padded / this | "
        "tokens equal to base |")
  print("|---|---|---|---|---|---|---|")
  reference = None
  for name in args.variants.split(","):
    jax.clear_caches()   # every variant traces and compiles its own loop
    with _variant(name, model):
      result, tokens = e2e.run_jaxkv(model, prompts, new)
    reference = tokens if reference is None else reference
    same = sum(a == b for a, b in zip(tokens, reference))
    print(f"| {name} | {result['ms_per_step']:.3f} | {result['steps']} | "
          f"{result['ms_per_step'] / base['ms_per_decode_step']:.2f}x | {result['seconds']:.3f} | "
          f"{base['seconds'] / result['seconds']:.3f}x | {same}/{len(tokens)} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
