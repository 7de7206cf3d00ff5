"""The varlen attention epilogue as one Pallas (Triton) kernel: partials -> `[T, H_q, D]`.

The Mosaic GPU attention kernel writes one normalized float32 partial output and
its log-sum-exp (base 2) per item, an item being one q tile (or one key split of
it) of one KV head. Each token's output row is then its tile's partial (one
split) or the log-sum-exp-weighted mean of its segment's split partials, in
q's dtype; tokens outside every real segment get zeros.

Written as XLA ops, that epilogue is a gather, two reductions and a scatter:
four GPU launches per layer, whatever the step holds (the merge is compiled for
the largest split count). This kernel does it in one launch: program `(t, h)`
reads token `t`'s `splits` partial rows of KV head `h` (the `G` rows of its
query heads) and writes them merged. A decode step of 64 tokens and 8 KV heads is
512 tiny programs.

Served when the GQA group and head_dim are powers of two (Triton block shapes)
and jax still has the Pallas Triton backend; `varlen_attention_sm90` keeps the
XLA epilogue otherwise.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import MASK_VALUE

try:
  from jax.experimental.pallas import triton as pl_triton   # pylint: disable=g-import-not-at-top
except ImportError:   # a jax without the Triton backend: the XLA epilogue serves every layout
  pl_triton = None

# jax 0.11/0.12 deprecate the Pallas Triton backend (it warns when a kernel is
# lowered, i.e. when the caller's jit compiles, outside any call site here). This
# 40-line epilogue is the one Triton kernel; porting it to Mosaic GPU is noted in
# docs/PERFORMANCE.md. Only this exact notice is hidden.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)

# Columns of the per-token table (`token_table`).
TOK_ITEM, TOK_SPLITS, TOK_ROW0 = range(3)

# jax moved the masked load/store of the Triton backend from `pl` to
# `pallas.triton`; both spell the same primitive.
_load = getattr(pl_triton, "load", None) or getattr(pl, "load", None)
_store = getattr(pl_triton, "store", None) or getattr(pl, "store", None)


def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def serves(group: int, head_dim: int, *, interpret: bool = False) -> bool:
  """Whether the kernel serves this layout (power-of-two block shapes) on this jax.

  Compiled, it also needs a GPU in this process: Triton lowering reads the
  device's compute capability, so lowering for CUDA on a GPU-less host (the CPU
  tests that inspect the Mosaic GPU call) takes the XLA epilogue.
  """
  if pl_triton is None or _load is None or not (_is_pow2(group) and _is_pow2(head_dim)):
    return False
  return interpret or jax.default_backend() == "gpu"


def _kernel(table_ref, o_ref, lse_ref, out_ref, *, group: int, max_splits: int,
            num_items: int):
  t = pl.program_id(0)
  head = pl.program_id(1)
  item = table_ref[t, TOK_ITEM]
  splits = table_ref[t, TOK_SPLITS]
  row0 = pl.multiple_of(table_ref[t, TOK_ROW0], group)
  is_token = item >= 0
  rows = pl.ds(row0, group)
  lses, masks = [], []
  m = jnp.full((group,), MASK_VALUE, jnp.float32)
  for j in range(max_splits):
    use = is_token & (j < splits)
    slot = jnp.clip(item + j, 0, num_items - 1)
    mask = jnp.full((group,), use)
    lse = _load(lse_ref.at[slot, head, rows], mask=mask, other=MASK_VALUE)
    lses.append(lse)
    masks.append(mask)
    m = jnp.maximum(m, lse)
  head_dim = out_ref.shape[-1]
  num = jnp.zeros((group, head_dim), jnp.float32)
  den = jnp.zeros((group,), jnp.float32)
  for j in range(max_splits):
    slot = jnp.clip(item + j, 0, num_items - 1)
    # Select, never multiply: an unused split's rows were never written.
    weight = jnp.where(masks[j], jnp.exp2(lses[j] - m), 0.0)
    mask2 = jnp.broadcast_to(masks[j][:, None], (group, head_dim))
    o = _load(o_ref.at[slot, head, rows, :], mask=mask2, other=0.0)
    num = num + weight[:, None] * jnp.where(mask2, o, 0.0)
    den = den + weight
  merged = num / jnp.where(den > 0.0, den, 1.0)[:, None]
  merged = jnp.where(is_token, merged, 0.0)
  _store(out_ref.at[t, pl.ds(head * group, group), :], merged.astype(out_ref.dtype))


def token_table(*, item_base, splits, row_block, is_token, group: int):
  """`int32[T, 3]`: each token's first item (-1: no segment), split count, first row."""
  return jnp.stack([jnp.where(is_token, item_base, -1), jnp.where(is_token, splits, 0),
                    row_block * group], axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("group", "max_splits", "out_dtype", "interpret"))
def combine(table, o_part, lse_part, *, group: int, max_splits: int, out_dtype,
            interpret: bool = False):
  """Merges the partials into `[T, K * group, D]` in `out_dtype`.

  Args:
    table: `int32[T, 3]` from `token_table`.
    o_part: `float32[items, K, block_q, D]` normalized partial outputs.
    lse_part: `float32[items, K, block_q]` base-2 log-sum-exp of each partial row.
    group: the GQA group G (a power of two).
    max_splits: most splits of one token (static).
    out_dtype: the output dtype.
    interpret: run the Pallas interpreter (CPU tests).
  """
  num_items, num_kv_heads, _, head_dim = o_part.shape
  num_tokens = table.shape[0]
  if not serves(group, head_dim, interpret=interpret):
    raise NotImplementedError(f"combine kernel needs power-of-two G and head_dim; got G={group}, "
                              f"head_dim={head_dim}")
  kernel = functools.partial(_kernel, group=group, max_splits=max_splits, num_items=num_items)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), out_dtype),
      grid=(num_tokens, num_kv_heads),
      compiler_params=pl_triton.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret,
      name="varlen_attention_combine",
  )(table, o_part, lse_part)
