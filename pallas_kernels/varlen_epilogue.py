"""The XLA epilogue of `varlen_attention_sm90`: partials and log-sum-exps to `[T, H_q, D]`.

The kernel writes, per item (segment q tile x key split) and KV head, a
normalized float32 partial output and its log-sum-exp (base 2). `combine`
copies each token's partial back in q's dtype and merges the partials of
tokens whose segment was split over its keys (flash decoding). The opt-in
Mosaic GPU kernel `combine_sm90` does the same in one launch.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import combine_sm90
from pallas_kernels.common import MASK_VALUE


def combine(o_part, lse_part, seg, *, num_tokens, group, block_q, max_splits,
             max_split_tokens, out_dtype):
  """Merges each token's split partials and returns `[T, H_q, D]` in `out_dtype`.

  Steps whose every token may split (at most `max_split_tokens` tokens) merge every
  token over its splits (`_merge_every_token`). Wider steps gather every token's
  first (often only) partial once; tokens of split segments (at most
  `max_split_tokens` of them, see `_segment_plan`) are compacted and merged over
  their `max_splits` partials, then scattered back.
  """
  num_items, num_kv_heads, _, head_dim = o_part.shape
  tokens = combine_sm90.token_items(seg, num_tokens=num_tokens, group=group, block_q=block_q,
                                    num_items=num_items)
  is_token, item_base, splits, row_block = tokens
  o_part, lse_part = _token_rows(o_part, lse_part, group=group, block_q=block_q)
  heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :]
  if max_splits > 1 and num_tokens <= max_split_tokens:
    return _merge_every_token(o_part, lse_part, is_token, item_base, splits, row_block,
                              heads=heads, max_splits=max_splits, out_dtype=out_dtype)
  out = o_part[item_base[:, None], heads, row_block[:, None]]            # [T, K, G, D]
  # Padding tokens gathered unwritten partials; give them zeros, deterministically.
  # Converted here, not after the scatter below: the gather, select and convert are
  # one fusion writing `out_dtype` (a float32 `out` and a separate convert measured
  # slower on the H200 for wide prefills); the values are the same.
  out = jnp.where(is_token[:, None, None, None], out, 0.0).astype(out_dtype)
  out = _merge_split_tokens(out, o_part, lse_part, tokens, max_splits=max_splits,
                            max_split_tokens=max_split_tokens)
  return out.reshape(num_tokens, num_kv_heads * group, head_dim)


def finish_in_place(out, o_part, lse_part, tokens, *, group, block_q, max_splits,
                    max_split_tokens):
  """`[T, H_q, D]` from the kernel's output with every unsplit token in place
  (`out` `[T, K, G, D]`, see `varlen_kernel_sm90.store_tokens`): the padding tokens'
  rows zeroed and the split tokens' merged from their partials; `tokens` is
  `combine_sm90.token_items`.

  The padding tokens are zeroed by a scatter whose real tokens' indices are out of
  range (dropped), so no list of them is built: the kernel's first version took a
  `jnp.nonzero` list (two scans over the tokens), and its call measured ~0.6 ms
  slower per 16,384 tokens on the H200 than every token through partials.
  """
  num_tokens, num_kv_heads, _, head_dim = out.shape
  is_token = tokens[0]
  padding = jnp.where(is_token, num_tokens, jnp.arange(num_tokens, dtype=jnp.int32))
  out = out.at[padding].set(jnp.zeros((), out.dtype), mode="drop")
  o_part, lse_part = _token_rows(o_part, lse_part, group=group, block_q=block_q)
  out = _merge_split_tokens(out, o_part, lse_part, tokens, max_splits=max_splits,
                            max_split_tokens=max_split_tokens)
  return out.reshape(num_tokens, num_kv_heads * group, head_dim)


def _token_rows(o_part, lse_part, *, group, block_q):
  """The partials as `[items, K, tile tokens, G, D]` and `[items, K, tile tokens, G]`.

  The idle rows past the tile's whole tokens (when G does not divide block_q)
  are dropped; the gathers read every row through this view.
  """
  num_items, num_kv_heads, _, head_dim = o_part.shape
  tile_tokens = block_q // group                          # see `q_tile_rows`
  tile_rows = tile_tokens * group
  return (o_part[:, :, :tile_rows].reshape(num_items, num_kv_heads, tile_tokens, group,
                                           head_dim),
          lse_part[:, :, :tile_rows].reshape(num_items, num_kv_heads, tile_tokens, group))


def _merge_split_tokens(out, o_part, lse_part, tokens, *, max_splits, max_split_tokens):
  """`out` `[T, K, G, D]` with the tokens of split segments (at most `max_split_tokens`)
  compacted, merged over their partials and scattered back in `out`'s dtype."""
  is_token, item_base, splits, row_block = tokens
  num_tokens = out.shape[0]
  num_items, num_kv_heads = o_part.shape[:2]
  heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :]
  num_split_tokens = min(num_tokens, max_split_tokens)
  if max_splits > 1 and num_split_tokens:
    (picked,) = jnp.nonzero(is_token & (splits > 1), size=num_split_tokens,
                            fill_value=num_tokens)
    safe = jnp.minimum(picked, num_tokens - 1)
    split = jnp.arange(max_splits, dtype=jnp.int32)
    used = split[None, :] < splits[safe][:, None]                        # [S, J]
    items = jnp.clip(item_base[safe][:, None] + split[None, :], 0, num_items - 1)
    merged = _merge_splits(o_part, lse_part, items, row_block[safe], used, heads=heads)
    # Fill entries (== T) are dropped.
    out = out.at[picked].set(merged.astype(out.dtype), mode="drop")
  return out


def _merge_every_token(o_part, lse_part, is_token, item_base, splits, row_block, *, heads,
                       max_splits, out_dtype):
  """`combine` for steps whose every token may split: `[T, K, G, D]` merges, no scatter.

  In place of a first-partial copy, a compaction and a scatter: two to three XLA
  kernels per layer instead of five, for the narrow (decode) steps this serves.

  A token's unused split slots read its first partial again (written, and just
  read, so cached) and are selected away; a token with one split gets its
  partial times exactly 1. Padding tokens get zeros.
  """
  num_tokens = is_token.shape[0]
  num_items = o_part.shape[0]
  split = jnp.arange(max_splits, dtype=jnp.int32)
  used = is_token[:, None] & (split[None, :] < splits[:, None])            # [T, J]
  items = jnp.clip(item_base[:, None] + jnp.where(used, split[None, :], 0), 0, num_items - 1)
  merged = _merge_splits(o_part, lse_part, items, row_block, used, heads=heads)
  return merged.reshape(num_tokens, -1, merged.shape[-1]).astype(out_dtype)


def _merge_splits(o_part, lse_part, items, row_block, used, *, heads):
  """`float32[N, K, G, D]`: for each of `N` tokens, its used partials merged by weight.

  Token `n`'s partials are items `items[n, j]` at tile row block `row_block[n]`,
  `j` where `used[n, j]`. A token with no used partial (padding, or a fill
  entry) gets zeros.
  """
  rows = row_block[:, None, None]
  lse = lse_part[items[:, :, None], heads[None], rows]                     # [N, J, K, G]
  used = used[:, :, None, None]
  lse = jnp.where(used, lse, MASK_VALUE)
  weight = jnp.where(used, jnp.exp2(lse - lse.max(axis=1, keepdims=True)), 0.0)
  # Select, never multiply: a partial of an unused slot may be unwritten, and is never summed.
  o = jnp.where(used[..., None], o_part[items[:, :, None], heads[None], rows], 0.0)
  # Sums over the slots in slot order and a reciprocal per row: merges of any slot count
  # then round alike (XLA may reassociate an axis reduction, and compile a division by a
  # broadcast as a multiply by the reciprocal or not, depending on the fusion around
  # it: a split bound of 3 against 6 slots differed by one unit in the last place on
  # CPU), so trailing unused slots (weight 0) change no bit.
  denom = _slot_sum(weight)
  inv_denom = 1.0 / jnp.where(denom > 0, denom, 1.0)
  return _slot_sum(weight[..., None] * o) * inv_denom[..., None]


def _slot_sum(x):
  """`x.sum(axis=1)` added in slot order, `((x0 + x1) + x2) + ...`."""
  total = x[:, 0]
  for j in range(1, x.shape[1]):
    total = total + x[:, j]
  return total
