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
- `compacted_merge`: the XLA epilogue's older form on narrow steps too (a copy of
  every token's first partial, the split tokens compacted, merged and scattered
  back) instead of merging every token over its splits (`DIRECT_MERGE`).
- `kernel_epilogue`: the attention epilogue as the Mosaic GPU kernel
  (`fused_combine=True`, `combine_sm90`) instead of XLA operations (the default).
- `unbounded_splits`: the epilogue merges `max_splits` (16) partials per token
  instead of the static bound the cache's rows allow
  (`varlen_plan.BOUND_SPLITS`).
- `mlp_apart`: narrow steps keep the MLP's gate and up matmuls apart too
  (`decoder._MERGE_ROWS = 0`), so XLA may fuse the activation into the down
  GEMM instead of running it as a kernel of its own.
- `no_refusal_selects`: every verb keeps its new control values without the
  select against the old ones that a refusal needs (`_verbs._select_control`);
  timing only (this workload refuses nothing): what folding those selects into
  their producers could save at most.

- `mgpu_o_down`, `mgpu_mlp_o`: at decode widths (64 or 128 rows) the output projection and
  the MLP's down projection (`mgpu_mlp_o`: also gate and up) multiply through
  `benchmarks/skinny_gemm_mgpu.py`'s Mosaic GPU GEMM instead of XLA's (the Linears'
  `dot_general` replaced); q/k/v stay XLA's merged GEMM. Tilings per `KxN` weight shape
  from `--mgpu-tilings` (JSON), else `MGPU_TILINGS`.

`--uniform` times e2e.py's uniform workload instead (64 prompts of 128..2,048
tokens, 256 new tokens, W = 2,048) and prints the whole run beside the padded loop.

Usage (GPU machine, repository root): PYTHONPATH=. python3 benchmarks/step_levers.py [--small]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
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
from pallas_kernels import varlen_plan   # pylint: disable=wrong-import-position
from pallas_kernels import varlen_epilogue   # pylint: disable=wrong-import-position


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

# `skinny_matmul_mgpu` tilings per weight shape `KxN` (e2e model: o 2048x2048, gate/up
# 2048x8192, down 8192x2048): 128-256 programs of 64 x 128 tiles until
# `gemm_options.py --mgpu` names better ones.
MGPU_TILINGS = {
    "2048x2048": dict(tile_n=64, tile_k=128, splits=4),
    "2048x8192": dict(tile_n=64, tile_k=128, splits=1),
    "8192x2048": dict(tile_n=64, tile_k=128, splits=8),
}
MGPU_MAX_ROWS = 128   # decode widths; wider steps keep XLA's GEMMs


def mgpu_dot_general(tilings, *, interpret=False):
  """A `dot_general` for `nnx.Linear` that sends `[M, K] @ [K, N]` with `M` a multiple of 64
  up to `MGPU_MAX_ROWS` and a tiling for `KxN` to `skinny_matmul_mgpu`; everything else
  (wider steps, other shapes or dtypes) to `lax.dot_general`."""
  from skinny_gemm_mgpu import skinny_matmul_mgpu   # pylint: disable=g-import-not-at-top

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                  **kwargs):
    (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
    tiling = tilings.get(f"{rhs.shape[0]}x{rhs.shape[-1]}") if rhs.ndim == 2 else None
    if (tiling is not None and lhs.ndim == 2 and tuple(contract_l) == (1,)
        and tuple(contract_r) == (0,) and not batch_l and not batch_r
        and lhs.shape[0] % 64 == 0 and lhs.shape[0] <= MGPU_MAX_ROWS
        and lhs.dtype == rhs.dtype and preferred_element_type in (None, lhs.dtype)):
      return skinny_matmul_mgpu(lhs, rhs, **tiling, interpret=interpret)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)
  return dot_general


def _mgpu_linears(model, with_gate_up):
  """The model's Linears a `mgpu_*` variant reroutes: every layer's o_proj and down_proj,
  and gate_proj and up_proj with `with_gate_up`."""
  for layer in model.layers:
    yield layer.attn.o_proj
    yield layer.mlp.down_proj
    if with_gate_up:
      yield layer.mlp.gate_proj
      yield layer.mlp.up_proj


def _variant(name, model=None, tilings=None):
  stack = contextlib.ExitStack()
  if name in ("mgpu_o_down", "mgpu_mlp_o"):
    fn = mgpu_dot_general(MGPU_TILINGS if tilings is None else tilings)
    for linear in _mgpu_linears(model, with_gate_up=name == "mgpu_mlp_o"):
      stack.enter_context(_patched(linear, "dot_general", fn))
  if name in ("sample_cond", "both"):
    stack.enter_context(_patched(engine_module, "plain_greedy", lambda params: False))
  if name in ("no_splits", "both"):
    stack.enter_context(_patched(kernel_config, "default_varlen_attention_config",
                                 _no_split_default))
  if name == "compacted_merge":
    stack.enter_context(_patched(varlen_epilogue, "DIRECT_MERGE", False))
  if name == "unbounded_splits":
    stack.enter_context(_patched(varlen_plan, "BOUND_SPLITS", False))
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
  p.add_argument("--mgpu-tilings", default=None,
                 help="JSON {\"KxN\": {tile_n, tile_k, splits[, stages, tma_add, lane]}} for the "
                 "mgpu_* variants (default: MGPU_TILINGS)")
  args = p.parse_args(argv)
  cfg = e2e._model_config(args.small)   # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  n_req = 64 if not args.small else 4
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
  print(f"device {jax.devices()[0].device_kind}; padded {base['attention']} loop: "
        f"{base['ms_per_decode_step']:.3f} ms per decode step, {base['seconds']:.3f} s in all")
  print("| variant | ms/step | steps | vs padded decode step | seconds | padded / this | "
        "tokens equal to base |")
  print("|---|---|---|---|---|---|---|")
  reference = None
  for name in args.variants.split(","):
    jax.clear_caches()   # every variant traces and compiles its own loop
    with _variant(name, model, json.loads(args.mgpu_tilings) if args.mgpu_tilings else None):
      result, tokens = e2e.run_jaxkv(model, prompts, new)
    reference = tokens if reference is None else reference
    same = sum(a == b for a, b in zip(tokens, reference))
    print(f"| {name} | {result['ms_per_step']:.3f} | {result['steps']} | "
          f"{result['ms_per_step'] / base['ms_per_decode_step']:.2f}x | {result['seconds']:.3f} | "
          f"{base['seconds'] / result['seconds']:.3f}x | {same}/{len(tokens)} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
