"""The varlen attention epilogue as one Mosaic GPU kernel (sm90).

`varlen_attention_sm90`'s kernel writes, per item (a q tile of a segment, or one
key split of it), a normalized float32 partial `[items, K, block_q, D]` and its
log-sum-exp (base 2) `[items, K, block_q]`. The epilogue turns them into the
`[T, H_q, D]` output: each token's partial, or the log-sum-exp merge of its
splits, and zeros for padding tokens. In XLA that is a gather, a compaction of
the split tokens, a merge and a scatter: about five launches per layer, a
tenth of a decode step (docs/PERFORMANCE.md, issue 11).

Here it is one XLA fusion and one kernel per layer:

- XLA computes each (split, query row)'s merge weight `exp2(lse_j - max) / sum`
  from the log-sum-exps (a `[J, K, T * G]` gather of scalars; 0 where the split
  does not exist, so padding tokens get weight 0 everywhere), and a small int32
  table: each token's first item, split count and row block in its item;
- the kernel, program (block of `ROWS / G` tokens, KV head), brings each
  token's `G` partial rows of split `j` into shared memory by TMA (one copy per
  token: the rows of one token are contiguous in its item), multiplies them by
  the weights and accumulates, for `j` below the block's largest split count,
  then stores each token's `G` rows to `out[t, head * G : (head + 1) * G]`.

Rows whose weight is 0 are selected away, never multiplied in (a split that does
not exist left its shared-memory rows stale, NaN at first). Served when `G`
divides `ROWS` and a token's partial rows are a whole number of 128-byte TMA
units (`supported`); the XLA epilogue serves the rest.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import MASK_VALUE
from pallas_kernels.common import token_segment_index

ROWS = 64          # query rows of one program: the wgmma layout's row tile
_TMA_UNIT = 128    # bytes a TMA load into shared memory must be a multiple of
_MAX_BARRIERS = 32   # barriers in one group (Mosaic GPU)


def supported(*, group: int, head_dim: int) -> bool:
  """Whether the kernel serves this head layout (else the XLA epilogue does)."""
  return ROWS % group == 0 and (group * head_dim * 4) % _TMA_UNIT == 0


def token_items(seg, *, num_tokens: int, group: int, block_q: int, num_items: int):
  """Per token: `(is_token, item_base, splits, row_block)`, each `[num_tokens]`.

  `item_base` is the token's first item (its q tile's split 0), `splits` its
  segment's split count (the token's partials are items `item_base + j`,
  `j < splits`), `row_block` the token's place among its tile's whole tokens
  (its rows are `row_block * G + g`). Padding tokens have `is_token` False.
  """
  tokens = jnp.arange(num_tokens, dtype=jnp.int32)
  # Padded rows have q_len 0 (`_segment_plan`), so they are not real.
  s = jnp.clip(token_segment_index(seg["q_start"], seg["q_len"] > 0, num_tokens), 0,
               seg["q_start"].shape[0] - 1)
  is_token = (tokens >= seg["q_start"][s]) & (tokens < seg["q_start"][s] + seg["q_len"][s])
  tile_tokens = block_q // group                          # see `q_tile_rows`
  local_token = tokens - seg["q_start"][s]
  splits = seg["splits"][s]
  item_base = seg["cu_items"][s] - seg["num_items"][s] + (local_token // tile_tokens) * splits
  item_base = jnp.clip(item_base, 0, num_items - 1)
  return is_token, item_base, splits, local_token % tile_tokens


def _plan(lse_part, seg, *, num_tokens, group, block_q, max_splits):
  """`(weights float32[J, K, T' * G], info int32[blocks, info_width])` for `T'` padded tokens.

  `T'` rounds `num_tokens` up to whole blocks of `ROWS / G` tokens; the extra
  tokens are padding (no split, weight 0). `info` has a row per block: its
  tokens' first items, split counts and row blocks, then the block's largest
  split count (`[blocks, info_width]`; one TMA brings it into shared memory).
  """
  num_items, num_kv_heads, _ = lse_part.shape
  tokens_per_block = ROWS // group
  blocks = -(-num_tokens // tokens_per_block)
  padded = blocks * tokens_per_block
  is_token, item_base, splits, row_block = token_items(
      seg, num_tokens=num_tokens, group=group, block_q=block_q, num_items=num_items)
  splits = jnp.where(is_token, splits, 0)
  extra = padded - num_tokens
  item_base, splits, row_block = (jnp.pad(x, (0, extra)) for x in (item_base, splits,
                                                                    row_block))
  split = jnp.arange(max_splits, dtype=jnp.int32)
  items = jnp.clip(item_base[None, :] + split[:, None], 0, num_items - 1)      # [J, T']
  rows = row_block[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]   # [T', G]
  heads = jnp.arange(num_kv_heads, dtype=jnp.int32)
  lse = lse_part[items[:, None, :, None], heads[None, :, None, None], rows[None, None]]
  exists = (split[:, None] < splits[None, :])[:, None, :, None]                # [J, 1, T', 1]
  lse = jnp.where(exists, lse, MASK_VALUE)
  weight = jnp.where(exists, jnp.exp2(lse - lse.max(axis=0, keepdims=True)), 0.0)
  total = weight.sum(axis=0, keepdims=True)
  weight = weight / jnp.where(total > 0, total, 1.0)
  by_block = lambda x: x.reshape(blocks, tokens_per_block)
  info = jnp.concatenate([by_block(item_base), by_block(splits), by_block(row_block),
                          by_block(splits).max(axis=1, keepdims=True)], axis=1)
  info = jnp.pad(info, ((0, 0), (0, info_width(group) - info.shape[1])))
  return weight.reshape(max_splits, num_kv_heads, padded * group), info.astype(jnp.int32)


def info_width(group: int) -> int:
  """Int32 fields of a block's row of the token table: 3 per token and the largest split
  count, padded to whole 128-byte TMA units."""
  fields = 3 * (ROWS // group) + 1
  unit = _TMA_UNIT // 4
  return -(-fields // unit) * unit


def _combine_kernel(info_ref, weight_ref, o_ref,          # Inputs
                    out_ref,                              # Output
                    info_smem, o_smem, w_smem, out_smem, info_bar, o_bars, w_bar,   # Scratch
                    *, group, num_tokens, use_layouts):
  """Program (token block, KV head): `out[t, head * G + g] = sum_j w[j, row] * o_j[row]`."""
  block, head = lax.axis_index("block"), lax.axis_index("head")
  tokens_per_block = ROWS // group
  t0 = block * tokens_per_block
  rows = pl.ds(t0 * group, ROWS)
  # The block's token table in shared memory: its scalar reads are then short, where
  # dependent reads from global memory would serialise ~1 us each.
  plgpu.copy_gmem_to_smem(info_ref.at[block], info_smem, info_bar)
  plgpu.barrier_wait(info_bar)
  item_of = lambda i: info_smem[i]
  splits_of = lambda i: info_smem[tokens_per_block + i]
  row_block_of = lambda i: info_smem[2 * tokens_per_block + i]
  if use_layouts:
    layout = plgpu.Layout.WGMMA
    load = lambda ref: plgpu.load(ref, layout=layout)
    load_rows = lambda ref: plgpu.load(ref, layout=layout.reduce(1))
    broadcast = lambda w: lax.broadcast_in_dim(w, (ROWS, o_smem.shape[1]), [0])
  else:
    load = load_rows = lambda ref: ref[...]
    broadcast = lambda w: jnp.broadcast_to(w[:, None], (ROWS, o_smem.shape[1]))

  num_bars = o_bars.shape[0]

  def round_(j, acc):
    # The previous round's loads of these buffers come before the TMA overwrites them.
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(weight_ref.at[j, head, rows], w_smem, w_bar)
    # Tokens in chunks of one barrier each (a barrier group holds at most 32).
    for first in range(0, tokens_per_block, num_bars):
      chunk = range(first, min(first + num_bars, tokens_per_block))
      for i in chunk:
        @pl.when(j < splits_of(i))
        def _fetch(i=i):
          src = o_ref.at[item_of(i) + j, head, pl.ds(row_block_of(i) * group, group)]
          plgpu.copy_gmem_to_smem(src, o_smem.at[pl.ds(i * group, group)],
                                  o_bars.at[i - first])
      for i in chunk:
        @pl.when(j < splits_of(i))
        def _wait(i=i):
          plgpu.barrier_wait(o_bars.at[i - first])
    plgpu.barrier_wait(w_bar)
    w = broadcast(load_rows(w_smem))
    return acc + jnp.where(w > 0.0, load(o_smem) * w, 0.0)

  acc = jnp.zeros((ROWS, o_smem.shape[1]), jnp.float32)
  if use_layouts:
    acc = plgpu.layout_cast(acc, plgpu.Layout.WGMMA)
  acc = lax.fori_loop(0, info_smem[3 * tokens_per_block], round_, acc)
  out_smem[...] = acc.astype(out_smem.dtype)
  plgpu.commit_smem()
  for i in range(tokens_per_block):
    @pl.when(t0 + i < num_tokens)
    def _store(i=i):
      plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(i * group, group)],
                              out_ref.at[t0 + i, pl.ds(head * group, group)])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("num_tokens", "group", "block_q", "max_splits",
                                             "interpret"))
def combine_sm90(o_part, lse_part, seg, *, num_tokens, group, block_q, max_splits, interpret):
  """`[T, H_q, D]` float32 from the attention kernel's partials (see the module docstring).

  Args:
    o_part: `float32[items, K, block_q, D]` normalized partial outputs.
    lse_part: `float32[items, K, block_q]` their log-sum-exps (base 2).
    seg: the segment plan (`varlen_plan._segment_plan`).
    interpret: None compiles for the GPU; interpreter parameters run it on CPU.
  """
  _, num_kv_heads, _, head_dim = o_part.shape
  weight, info = _plan(lse_part, seg, num_tokens=num_tokens, group=group, block_q=block_q,
                       max_splits=max_splits)
  tokens_per_block = ROWS // group
  blocks = -(-num_tokens // tokens_per_block)
  kernel = functools.partial(_combine_kernel, group=group, num_tokens=num_tokens,
                             use_layouts=interpret is None)
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), jnp.float32),
      scratch_types=[plgpu.SMEM((info_width(group),), jnp.int32),
                     plgpu.SMEM((ROWS, head_dim), jnp.float32),
                     plgpu.SMEM((ROWS,), jnp.float32),
                     plgpu.SMEM((ROWS, head_dim), jnp.float32),
                     plgpu.Barrier(),
                     plgpu.Barrier(num_barriers=min(tokens_per_block, _MAX_BARRIERS)),
                     plgpu.Barrier()],
      grid=(blocks, num_kv_heads),
      grid_names=("block", "head"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(info, weight, o_part)
