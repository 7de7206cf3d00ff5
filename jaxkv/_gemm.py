"""Which GEMM serves a model's decode-width output and down projections (CONTRACT §10.8).

A decode step multiplies a few rows (one per decoding sequence) by every layer's weights, so
it is weight reads. XLA's split-K GEMMs stream the o and down weights well below the copy
ceiling; `pallas_kernels.skinny_gemm.skinny_matmul` streams them faster on Hopper
(docs/performance-history.md, "Serving speed" §17). `linear_dot_general(gemm)` is the `dot_general` a
Linear is built with: a `[M, K] @ [K, N]` that `skinny_matmul` serves (`M <= 128` rows, bf16
or fp16, whole tiles) goes to it; anything else (wider steps, other shapes, dtypes, sharded
outputs) to `jax.lax.dot_general`, unchanged.

The two paths differ only in summation order (float32 accumulation in both, one rounding to
the output dtype), so greedy tokens of a model with near-tied logits may differ between
them; `gemm="xla"` keeps XLA's GEMMs everywhere.
"""

from __future__ import annotations

import functools

import jax

from jaxkv._implementation import default_implementation
from pallas_kernels.skinny_gemm import skinny_matmul, skinny_matmul_refusal

GEMMS = (None, "xla", "mosaic_gpu", "interpret")


def resolve_gemm(gemm, mesh=None) -> str:
  """`gemm` checked and resolved: None picks `"mosaic_gpu"` when the default device is a
  Hopper-or-newer GPU and the model is not sharded (`mesh is None`), else `"xla"`.

  Raises:
    ValueError: `gemm` is not one of `GEMMS`; `"mosaic_gpu"` or `"interpret"` with a mesh
      (the kernel serves unsharded weights only); `"mosaic_gpu"` without a Hopper GPU.
  """
  if gemm not in GEMMS:
    raise ValueError(f"gemm={gemm!r} must be one of {GEMMS}")
  if gemm is None:
    return "mosaic_gpu" if mesh is None and default_implementation() == "mosaic_gpu" else "xla"
  if gemm != "xla" and mesh is not None:
    raise ValueError(f"gemm={gemm!r} serves unsharded weights only; with mesh= use "
                     "gemm=None or 'xla'")
  if gemm == "mosaic_gpu" and default_implementation() != "mosaic_gpu":
    raise ValueError(f"gemm='mosaic_gpu' needs a Hopper-or-newer GPU as the default device "
                     f"(it is {jax.devices()[0].platform}); use gemm=None, 'xla' or 'interpret'")
  return gemm


def serves(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
           **kwargs) -> bool:
  """Whether `skinny_matmul` serves this `dot_general` (a plain `[M, K] @ [K, N]`)."""
  (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
  return (lhs.ndim == 2 and rhs.ndim == 2 and tuple(contract_l) == (1,)
          and tuple(contract_r) == (0,) and not batch_l and not batch_r
          and lhs.dtype == rhs.dtype and preferred_element_type in (None, lhs.dtype)
          and precision in (None, jax.lax.Precision.DEFAULT)
          and all(v is None for v in kwargs.values())
          and skinny_matmul_refusal(lhs.shape[0], *rhs.shape, lhs.dtype) is None)


def _skinny_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, interpret: bool, **kwargs):
  if serves(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs):
    return skinny_matmul(lhs, rhs, interpret=interpret)
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type, **kwargs)


# One object per choice, so models built alike share their (static) graph definitions.
_DOT_GENERALS = {
    "xla": jax.lax.dot_general,
    "mosaic_gpu": functools.partial(_skinny_dot_general, interpret=False),
    "interpret": functools.partial(_skinny_dot_general, interpret=True),
}


def linear_dot_general(gemm: str):
  """The `dot_general` for an `nnx.Linear` under a resolved `gemm` (`resolve_gemm`)."""
  return _DOT_GENERALS[gemm]
