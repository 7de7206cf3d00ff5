"""What an engine reports about itself: the attention implementation of each layer, in words.

`layer_implementations` answers, for a served model, which implementation
each cache layer's attention runs and why. It reads the model's
`jaxkv.nnx.CachedAttention` layers (their query heads and `implementation=`
argument): an explicit choice is what runs; `implementation=None` is decided
by `jaxkv.implementation_plan`, the same decision `jaxkv.pure.attend` takes
when it traces the layer. `implementation_lines` prints the result one line
per distinct (implementation, reason), the form the demo and `jaxkv serve` show.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv import CacheConfig, LayerImplementation, implementation_plan
from pallas_kernels import skinny_gemm

UNKNOWN = "unknown"

_EXPLICIT = {
    "reference": "implementation='reference' was chosen for this layer (the pure-jnp reference)",
    "mosaic_gpu": "implementation='mosaic_gpu' was chosen for this layer (the Mosaic GPU kernels)",
    "interpret": "implementation='interpret' was chosen for this layer (the Mosaic GPU kernels "
                 "under the interpreter, for tests)",
}


def _attention_layers(model) -> dict:
  """`layer -> CachedAttention` of the model's NNX graph (the first one found per layer)."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from jaxkv.nnx import CachedAttention   # pylint: disable=g-import-not-at-top
  found = {}
  try:
    nodes = [node for _, node in nnx.iter_graph(model)]
  except Exception:   # pylint: disable=broad-except  (not an NNX graph: nothing to read)
    return found
  for node in nodes:
    if isinstance(node, CachedAttention):
      found.setdefault(node.layer, node)
  return found


def layer_implementations(model, config: CacheConfig) -> tuple[LayerImplementation, ...]:
  """Which attention implementation serves each of `config`'s layers in `model`, and why.

  Args:
    model: a step model (`jaxkv.serve.StepModel`).
    config: its `CacheConfig`.

  Returns:
    One `LayerImplementation(layer, implementation, reason)` per layer, in
    order: `"mosaic_gpu"`, `"reference"` or `"interpret"`, or `"unknown"` for a
    layer no `CachedAttention` of the model serves (a model that calls
    `jaxkv.pure.attend` itself; its arguments are not visible from outside).
  """
  layers = _attention_layers(model)
  # `implementation_plan` needs query heads for every layer; a layer without a
  # CachedAttention gets its KV heads (a valid count) and its row is replaced below.
  heads = [layers[l].num_heads if l in layers else cfg.n_kv_heads
           for l, cfg in enumerate(config.layers)]
  plan = implementation_plan(config, heads)
  out = []
  for row in plan:
    attn = layers.get(row.layer)
    if attn is None:
      out.append(LayerImplementation(row.layer, UNKNOWN, "no jaxkv.nnx.CachedAttention of the "
                                     "model serves this layer (it calls jaxkv.pure.attend itself)"))
    elif attn.implementation is not None:
      out.append(LayerImplementation(row.layer, attn.implementation,
                                     _EXPLICIT[attn.implementation]))
    else:
      out.append(row)
  return tuple(out)


def _layer_list(layers: Sequence[int]) -> str:
  """`"layers 0-2, 5"` / `"layer 3"`: sorted layer ids with runs collapsed."""
  runs = []
  for l in sorted(layers):
    if runs and l == runs[-1][1] + 1:
      runs[-1][1] = l
    else:
      runs.append([l, l])
  text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
  return f"layer{'s' if len(layers) > 1 else ''} {text}"


def implementation_lines(plan: Sequence[LayerImplementation]) -> list[str]:
  """One line per distinct (implementation, reason) of `plan`, in order of first layer.

  E.g. `"attention: reference on layers 0-5 (6 of 6): the default device (cpu: cpu) is not
  an NVIDIA GPU of compute capability >= 9.0"`.
  """
  groups: dict = {}
  for row in plan:
    groups.setdefault((row.implementation, row.reason), []).append(row.layer)
  return [f"attention: {impl} on {_layer_list(layers)} ({len(layers)} of {len(plan)}): {reason}"
          for (impl, reason), layers in groups.items()]


def gemm_line(gemm: str | None) -> str:
  """One line on the decode GEMM of a model's output and down projections (CONTRACT §10.8):
  `gemm` is the model's resolved `gemm` (`Engine.gemm`), None for a model without one."""
  if gemm is None:
    return "decode GEMM: the model's own (it has no `gemm` attribute)"
  if gemm == "xla":
    return "decode GEMM: gemm='xla': XLA's for every product"
  what = {"mosaic_gpu": "the Mosaic GPU skinny GEMM",
          "interpret": "the Mosaic GPU skinny GEMM under the interpreter"}[gemm]
  return (f"decode GEMM: gemm={gemm!r}: {what} for the bf16/fp16 output and down projections "
          f"of steps of at most {skinny_gemm.MAX_ROWS} rows; XLA's for every other product")
