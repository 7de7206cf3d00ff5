"""Write + varlen attention for one layer, behind `implementation=` (CONTRACT §6.4, §10.7).

Dispatch: `"reference"` runs the pure-jnp references; `"mosaic_gpu"` the Pallas
Mosaic GPU kernels; `"interpret"` the same kernels under the Mosaic GPU
interpreter; `None` picks `"mosaic_gpu"` on an NVIDIA GPU of compute capability
>= 9.0 unless the kernels' static checks refuse the layer, and then runs the
reference with a `KernelFallbackWarning` (once per layer shape and reason; see
`jaxkv._implementation`, which `implementation_plan` shares). An explicit
choice re-raises the kernel's `NotImplementedError`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import fp8
from jaxkv import _implementation
from jaxkv._config import CacheConfig
from jaxkv._implementation import default_implementation  # pylint: disable=unused-import
from jaxkv._sharding import per_shard, validate_mesh
from jaxkv._state import CacheState, Phase, Status
from jaxkv._validate import (static_validate_attend, static_validate_implementation,
                             static_validate_state, step_width_of)


class KVDtypeWarning(UserWarning):
  """`attend` got q/k/v in a dtype other than the cache's `kv_dtype` (they are cast)."""


_dtype_warned: set = set()   # (layer shape, dtypes) already reported


def warn_dtype_mismatch(config: CacheConfig, layer: int, q, k, v) -> None:
  """Warns once per (layer shape, dtypes) when q/k/v differ from `kv_dtype`.

  K/V are cast to `kv_dtype` on the write (float32 activations into a bfloat16
  cache lose precision silently otherwise), and on a Hopper GPU a q that is
  not in `kv_dtype` sends the layer to the reference attention.
  """
  dtypes = tuple(np.dtype(x.dtype) for x in (q, k, v))
  if all(d == config.kv_dtype for d in dtypes) or config.is_fp8:
    # An fp8 cache always quantises its activations' K/V: that is what it was asked for.
    return
  key = (tuple(q.shape[1:]), tuple(k.shape[1:]), dtypes, config.kv_dtype)
  if key in _dtype_warned:
    return
  _dtype_warned.add(key)
  warnings.warn(f"attend: layer {layer} got q/k/v in {'/'.join(map(str, dtypes))} but the "
                f"cache stores kv_dtype={config.kv_dtype}; K/V are cast to it on the write. "
                "Run the model in kv_dtype (or build the CacheConfig with the activations' "
                "dtype) to silence this.", KVDtypeWarning, stacklevel=3)


def static_validate_scale(scale) -> float | None:
  """`scale` as a Python float: finite and > 0 (None: `1/sqrt(head_dim)`); ValueError naming it."""
  if scale is None:
    return None
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
    raise ValueError(f"scale={scale!r} must be a Python float or None")
  value = float(scale)
  # NaN or inf would make every output NaN; 0 or less is never a softmax scale.
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"scale={scale!r} must be a finite float > 0 (or None: 1/sqrt(head_dim))")
  return value


def _write_and_attend(implementation, *, window, scale, paged=False, scaled=False):
  """`(k_cache, v_cache, q, k, v[, k_scale, v_scale], step, rows, n_tokens, n_segments
  [, page_table]) -> (k, v, out)` for one implementation: the write, then the attention
  over the written cache. A paged layer takes the pool and its page table; an fp8
  layer (`scaled`) its per-head scales, which the write quantises with and the
  attention dequantises with (16- and 32-bit layers pass no scale at all)."""
  def split(rest):
    """`(scale keywords, the rest)` of the operands after v."""
    if not scaled:
      return {}, rest
    return dict(k_scale=rest[0], v_scale=rest[1]), rest[2:]

  if paged:
    if implementation == "reference":
      write = pallas_kernels.paged_kv_write_reference
      attention = pallas_kernels.paged_varlen_attention_reference
    else:
      interpret = implementation == "interpret"
      write = functools.partial(pallas_kernels.paged_kv_write, interpret=interpret)
      attention = functools.partial(pallas_kernels.paged_varlen_attention, interpret=interpret)

    def run_paged(k_pool, v_pool, q, k, v, *rest):
      scales, (step, rows, n_tokens, n_segments, page_table) = split(rest)
      k_pool, v_pool = write(k_pool, v_pool, k, v, step.seq_cols, rows, n_tokens, page_table,
                             **scales)
      out = attention(q, k_pool, v_pool, page_table, step.seq_info, n_segments, window=window,
                      scale=scale, **scales)
      return k_pool, v_pool, out

    return run_paged
  if implementation == "reference":
    write, attention = pallas_kernels.kv_write_reference, pallas_kernels.varlen_attention_reference
  else:
    interpret = implementation == "interpret"
    write = functools.partial(pallas_kernels.kv_write, interpret=interpret)
    attention = functools.partial(pallas_kernels.varlen_attention, interpret=interpret)

  def run(k_cache, v_cache, q, k, v, *rest):
    scales, (step, rows, n_tokens, n_segments) = split(rest)
    k_cache, v_cache = write(k_cache, v_cache, k, v, step.seq_cols, rows, n_tokens, **scales)
    out = attention(q, k_cache, v_cache, step.seq_info, n_segments, window=window,
                    scale=scale, **scales)
    return k_cache, v_cache, out

  return run


def attend(config: CacheConfig, state: CacheState, layer: int, q, k, v, *, scale=None,
           implementation=None, mesh=None, kv_axis: str = "tp"):
  """Writes layer `layer`'s K/V for the step's real tokens, then attends (CONTRACT §6.4, §8).

  Args:
    config: static.
    state: donated; must be PREPARED.
    layer: static layer id.
    q: `[W, H_q, D]`; k, v: `[W, n_kv_heads, D]`. Rows `n..W-1` are padding.
      `W` is the width of `state.step`: the config's step width, or less when the
      step is a narrowed view (`narrow_step`).
    scale: softmax scale (static): a finite float > 0; None means
      `1/sqrt(head_dim)`.
    implementation: see the module docstring.
    mesh, kv_axis: with a mesh (static), K/V are split over their heads along
      `kv_axis` and the write and attention run per shard (`jaxkv._sharding`).

  Returns:
    `(state, out, status)`: `out` is `[W, H_q, D]` in `q.dtype`, rows `n..W-1`
    unspecified, and the layer is marked served (`state.attended`), which
    `commit_step` requires of every layer. Outside PREPARED the status is
    NOT_PREPARED, nothing is written, `out` is zeros and no layer is marked,
    so the step's `commit_step` refuses too (a caller that checks only the
    commit status still sees the failure).

  q, k and v in a dtype other than `config.kv_dtype` warn (`KVDtypeWarning`)
  once per layer shape and dtypes: K/V are cast to `kv_dtype` on the write.

  Raises:
    ValueError: at trace time for a bad layer id, shape, head count, scale or
      argument.
  """
  static_validate_implementation(implementation)
  static_validate_state(config, state)
  static_validate_attend(config, layer, q, k, v, width=step_width_of(config, state))
  validate_mesh(config, mesh, kv_axis)
  scale = static_validate_scale(scale)
  warn_dtype_mismatch(config, layer, q, k, v)
  head_dim = config.layers[layer].head_dim
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  is_prepared = state.phase == Phase.PREPARED
  step = state.step
  # A refused attend writes nothing (n = 0) and reports no segment.
  n_tokens = jnp.where(is_prepared, step.n_tokens, 0)
  n_segments = jnp.where(is_prepared, step.n_segments, 0)
  scaled = config.is_fp8
  scales = ()
  if scaled:
    # The scale rule (CONTRACT §3.2): an unset head's scale is fixed by this write's real
    # tokens; a set one never changes. A refused attend (n = 0) leaves every scale unset.
    scales = (fp8.update_scale(state.k_scale[layer], k, n_tokens, config.kv_dtype),
              fp8.update_scale(state.v_scale[layer], v, n_tokens, config.kv_dtype))
  operands = (state.k[layer], state.v[layer], q, k, v, *scales, step, step.write_rows[layer],
              n_tokens, n_segments)
  paged = config.is_paged_layer(layer)
  if paged:
    operands += (state.page_table,)
  static = dict(window=config.window(layer), scale=scale, paged=paged, scaled=scaled)
  run = lambda impl: per_shard(_write_and_attend(impl, **static), mesh, kv_axis,
                               head_vectors=len(scales))(*operands)
  ran = implementation
  if implementation is None:
    ran, reason = _implementation.choose_implementation(q, state.k[layer], paged=paged)
    if ran != _implementation.default_implementation():
      _implementation.warn_fallback(q, state.k[layer], reason)
    try:
      k_cache, v_cache, out = run(ran)
    except NotImplementedError as e:
      # A refusal the static checks did not foresee: still served, still reported.
      _implementation.warn_fallback(q, state.k[layer], f"the kernels raised: {e}")
      ran = "reference"
      k_cache, v_cache, out = run(ran)
  else:
    k_cache, v_cache, out = run(implementation)
  if ran == "reference":
    out = jnp.where(is_prepared, out, jnp.zeros_like(out))
  # else: the kernels (columns and pages) return zeros for every token outside
  # a real segment, and a refused attend has none (n_segments = 0), so the
  # select (one more GPU launch per layer) is not needed.
  status = jnp.where(is_prepared, jnp.int32(Status.OK), jnp.int32(Status.NOT_PREPARED))
  new_k = state.k[:layer] + (k_cache,) + state.k[layer + 1:]
  new_v = state.v[:layer] + (v_cache,) + state.v[layer + 1:]
  if scaled:
    state = dataclasses.replace(
        state, k_scale=state.k_scale[:layer] + (scales[0],) + state.k_scale[layer + 1:],
        v_scale=state.v_scale[:layer] + (scales[1],) + state.v_scale[layer + 1:])
  # An elementwise select, not a scatter: the layers' marks then fuse into one
  # kernel (a scatter per layer was 16 of a decode step's ~460 GPU launches).
  is_layer = jnp.arange(config.num_layers, dtype=jnp.int32) == layer
  attended = jnp.where(is_layer & is_prepared, jnp.int32(1), state.attended)
  return dataclasses.replace(state, k=new_k, v=new_v, attended=attended), out, status
