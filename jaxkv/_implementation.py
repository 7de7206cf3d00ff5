"""Which implementation serves each layer with `implementation=None`, and why (CONTRACT §10.7).

`choose_implementation` is the one decision: the default device picks
`"mosaic_gpu"` or `"reference"`, then the kernels' own static checks
(`pallas_kernels.check_kv_write` / `check_varlen_attention`, shapes and dtypes
only) decide whether the kernels serve the layer. `attend` dispatches with it,
and `implementation_plan` reports it for a whole CacheConfig ahead of time.

A fallback from the kernels to the reference on a Hopper GPU is never silent:
`attend` warns once per (layer shape, reason) with `KernelFallbackWarning`. A
CPU (or pre-Hopper) default of `"reference"` is not a fallback and does not warn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple
import warnings

import jax

import pallas_kernels
from jaxkv._config import CacheConfig


class KernelFallbackWarning(UserWarning):
  """`implementation=None` on a Hopper GPU runs the reference for a layer the kernels refuse."""


class LayerImplementation(NamedTuple):
  """One row of `implementation_plan` (and of `jaxkv.serve.Engine.implementations`)."""

  layer: int
  implementation: str      # "mosaic_gpu" or "reference"; an engine also reports an explicit
                           # "interpret", or "unknown" for a layer its model attends itself
  reason: str


def default_implementation() -> str:
  """`"mosaic_gpu"` on a Hopper-or-newer NVIDIA GPU, else `"reference"`."""
  device = jax.devices()[0]
  if device.platform == "gpu":
    capability = getattr(device, "compute_capability", None)
    if capability is not None and float(capability) >= 9.0:
      return "mosaic_gpu"
  return "reference"


def kernel_refusal(q, k_cache, *, paged: bool = False) -> str | None:
  """Why the compiled kernels refuse this layer (their NotImplementedError), or None.

  `q` is `[T, H_q, D]`, `k_cache` `[R, C, K, D]` (a paged layer's pool
  `[pages, P, K, D]` when `paged`): arrays or ShapeDtypeStructs.
  """
  try:
    if paged:
      pallas_kernels.check_paged(q, k_cache)
    else:
      pallas_kernels.check_kv_write(k_cache)
      pallas_kernels.check_varlen_attention(q, k_cache)
  except NotImplementedError as e:
    return str(e)
  return None


def choose_implementation(q, k_cache, *, paged: bool = False) -> tuple[str, str]:
  """`(implementation, reason)` that `implementation=None` uses for one layer.

  `paged`: the layer lives in a page pool (`k_cache` is the pool), served by
  the kernels that read the page table (`pallas_kernels.paged_*`).
  """
  default = default_implementation()
  if default == "reference":
    device = jax.devices()[0]
    return "reference", (f"the default device ({device.platform}: {device.device_kind}) is "
                         "not an NVIDIA GPU of compute capability >= 9.0")
  refusal = kernel_refusal(q, k_cache, paged=paged)
  if refusal is not None:
    return "reference", f"the Mosaic GPU kernels refuse this layer: {refusal}"
  if paged:
    return default, ("Hopper GPU; the Mosaic GPU kernels serve this layer's heads, dtype and "
                     "page size through its page table")
  return default, "Hopper GPU; the Mosaic GPU kernels serve this layer's heads and dtype"


_warned: set = set()   # (layer shape, reason) pairs already reported


def warn_fallback(q, k_cache, reason: str) -> None:
  """Warns once per (layer shape, reason) that a layer runs the reference on a Hopper GPU."""
  key = (tuple(q.shape[1:]), tuple(k_cache.shape[2:]), str(k_cache.dtype), reason)
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(f"implementation=None runs the reference for a layer with {q.shape[1]} query "
                f"heads, {k_cache.shape[2]} KV heads of dim {k_cache.shape[3]} and "
                f"{k_cache.dtype} storage: {reason}", KernelFallbackWarning, stacklevel=4)


def implementation_plan(config: CacheConfig,
                        n_q_heads: int | Sequence[int]) -> list[LayerImplementation]:
  """Which implementation `attend(..., implementation=None)` uses for each layer, and why.

  Decided for the current default device with the same checks `attend` runs
  (`choose_implementation`), on abstract shapes: nothing is allocated or traced.

  Args:
    config: the cache's static configuration.
    n_q_heads: query heads, one int for every layer or one per layer.

  Returns:
    One `LayerImplementation(layer, implementation, reason)` per layer, in order.
  """
  heads = [n_q_heads] * config.num_layers if isinstance(n_q_heads, int) else list(n_q_heads)
  if len(heads) != config.num_layers:
    raise ValueError(f"n_q_heads has {len(heads)} entries for {config.num_layers} layers")
  plan = []
  for layer, (cfg, h_q) in enumerate(zip(config.layers, heads)):
    if not isinstance(h_q, int) or h_q < 1 or h_q % cfg.n_kv_heads:
      raise ValueError(f"layer {layer}: n_q_heads={h_q!r} must be a positive multiple of "
                       f"n_kv_heads={cfg.n_kv_heads}")
    q = jax.ShapeDtypeStruct((config.step_width, h_q, cfg.head_dim), config.kv_dtype)
    # The row count never decides (the kernels serve every row count).
    k_cache = jax.ShapeDtypeStruct(config.layer_shape(layer, config.initial_flat_rows),
                                   config.kv_dtype)
    plan.append(LayerImplementation(
        layer, *choose_implementation(q, k_cache, paged=config.is_paged_layer(layer))))
  return plan
