"""Paged storage through the Mosaic GPU kernels (sm90): attention and the K/V write.

A paged flat layer's pool `[num_pages, P, K, D]` is handed to the column
kernels as `[num_pages * P, 1, K, D]`, a free reshape: pool row `page * P + o`
of "column 0" is offset `o` of `page`. Nothing of K/V is gathered or copied.

- Attention runs `varlen_attention_sm90`'s kernel body unchanged on logical
  tiles (a column's logical rows are its positions, `[0, M * P)` with `M` table
  entries per column); only each tile's load address is looked up in the page
  table inside the kernel (`address` below). Either `P` is a multiple of the K/V
  tile `block_k` (a tile lies in one page: one TMA per tile for K and one for
  V, one page-table lookup) or `block_k` is a multiple of `P` and `P` one of 8
  (pages of 8, 16, 32 rows: a tile spans `block_k // P` whole pages, one TMA
  and one lookup per page, each into its 8-aligned row slice of the stage, all
  on the stage's barrier). Small pages waste less of each sequence's last page
  (issue 13's memory row) at the cost of more, smaller copies.
- The write runs `kv_write_sm90`'s kernel body unchanged; each real token's
  pool row is looked up in the page table inside the kernel from scalar reads
  (`_paged_write_kernel`), so XLA runs nothing before it: only the step's new
  rows move, in place when the pool is donated.

The page table names pages the caller's bookkeeping owns; rows past a read
range, free pages and the scratch page may hold NaN and are never read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels import config as config_lib
from pallas_kernels import kv_write_sm90
from pallas_kernels import varlen_attention_sm90 as column
from pallas_kernels import varlen_kernel_sm90 as kernel_body

_div = kernel_body.div


def pool_view(pool):
  """`[num_pages, P, K, D] -> [num_pages * P, 1, K, D]`: the pool as one column of rows."""
  num_pages, page_size, num_kv_heads, head_dim = pool.shape
  return pool.reshape(num_pages * page_size, 1, num_kv_heads, head_dim)


def _tile_sizes(default_block_k: int, head_dim: int, *, use_wgmma: bool) -> list[int]:
  """K/V tile rows the kernel may use, largest first, none above the config's."""
  if use_wgmma:   # multiples of 64, not square (served over columns only, see check_request)
    return [b for b in range(default_block_k, 0, -64) if b != head_dim]
  return list(range(default_block_k, 0, -1))


def tile_pages(page_size: int, block_k: int) -> int:
  """Pages one K/V tile reads: 1 when a tile lies in one page, else `block_k // P`."""
  return max(1, block_k // page_size)


def serves(page_size: int, block_k: int) -> bool:
  """Whether tiles of `block_k` rows can stream pages of `page_size` rows.

  Either every tile lies in one page (`P % block_k == 0`) or every tile is whole
  pages whose rows start at multiples of `ROW_ALIGN` (TMA into (8, 64)-tiled
  shared memory takes 8-aligned row slices): `block_k % P == 0`, `P % 8 == 0`.
  """
  return page_size % block_k == 0 or (block_k % page_size == 0
                                      and page_size % column.ROW_ALIGN == 0)


def check_request(q, k_pool, *, config=None, interpret=False):
  """Resolves the config and raises NotImplementedError if this paged call cannot be served.

  Shapes and dtypes only (arrays or `jax.ShapeDtypeStruct`s). Without a config
  the heuristic default's K/V tile becomes the largest tile the kernel may use
  that `serves` the page size: one the page is a multiple of, or one that is a
  multiple of the page when the page is a multiple of 8 (the interpreter takes
  any tile, so it serves every page size; the compiled kernel needs a multiple
  of 64 rows that is not the head dim: 128 for head dim 64, 64 for 128, so it
  serves pages of 8, 16, 32, 64 and multiples of its tile). An explicit config's
  `block_k` must serve the page size.

  Returns:
    The `VarlenAttentionConfig` the call will use.
  """
  page_size, num_kv_heads, head_dim = k_pool.shape[1:]
  interpreted = _compat.resolve_interpret(interpret) is not None
  align = column.ROW_ALIGN
  if config is None:
    default = config_lib.default_varlen_attention_config(
        group=q.shape[1] // num_kv_heads, head_dim=head_dim, interpret=interpreted)
    tiles = _tile_sizes(default.block_k, head_dim, use_wgmma=default.use_wgmma)
    sizes = [b for b in tiles if serves(page_size, b)]
    if not sizes:
      raise NotImplementedError(
          f"{page_size=} is served by no K/V tile the compiled Mosaic GPU kernel can use for "
          f"{head_dim=} ({tiles} rows): a page_size must be a multiple of a tile, or a "
          f"multiple of {align} that divides one; use e.g. {align}, {tiles[0] // 2} or "
          f"{tiles[0]}")
    config = dataclasses.replace(default, block_k=sizes[0])
  elif not serves(page_size, config.block_k):
    raise NotImplementedError(
        f"{page_size=} must be a multiple of {config.block_k=} (a tile in one page) or a "
        f"multiple of {align} dividing it (a tile of whole pages)")
  if config.use_wgmma and config.block_k == head_dim:
    # Over columns square tiles run right since q is reloaded per tile
    # (`varlen_kernel_sm90._stream_tiles`); the paged kernel shares that loop but has not
    # run square tiles on a GPU since.
    raise NotImplementedError(
        f"{config.block_k=} == {head_dim=}: square K/V tiles are served over columns but "
        "over pages not yet checked on a GPU; use another block_k")
  # The kernel's K/V arrays are the pool's view; a pool of fewer rows than one tile still
  # streams whole tiles (its lookups clamp into the table), so check that tile.
  num_pages = k_pool.shape[0]
  view = jax.ShapeDtypeStruct((max(num_pages * page_size, config.block_k), 1, num_kv_heads,
                               head_dim), k_pool.dtype)
  return column.check_request(q, view, config=config, interpret=interpret)


def _page_row(table_ref, col, row, *, page_size, pages_per_col):
  """Pool-view row of logical `row` of column `col`: `page * P + row % P`, from scalar reads.

  The slot is clamped into the table (as `indexing.page_address` does), so a lookup
  stays inside the table for any row.
  """
  slot = jnp.minimum(_div(row, page_size), pages_per_col - 1)
  page = table_ref[col * pages_per_col + slot]
  return page * page_size + (row - slot * page_size)


def _paged_kernel(items_ref, q_ref, k_ref, v_ref, table_ref,   # Inputs
                  o_ref, lse_ref, out_ref,                    # Outputs
                  q_smem, q_bar,                              # Scratch
                  *, page_size, pages_per_col, block_k, **kwargs):
  """`varlen_kernel_sm90.attention_kernel` with each tile's rows looked up in the page table.

  `table_ref` is the page table flattened to `[C * M]` int32. A tile starts at a
  logical row `r` that is a multiple of `block_k` (the interpreter variant may
  move the last one back to `max(M * P, block_k) - block_k`), so `r` is a
  multiple of `min(P, block_k)`:
  - `P >= block_k`: the tile's rows lie in page `table[col, r // P]` from offset
    `r % P` on, one lookup;
  - `P < block_k`: its rows are the whole pages `table[col, r // P + i]`,
    `i < block_k // P`, one lookup each (slots past the table clamp to its last
    entry: those rows are past every read range, masked and never summed).
  """
  pieces = tile_pages(page_size, block_k)
  if pieces == 1:
    def address(col, row):
      # Clamped: a lookup issued early for an empty item must stay inside the table.
      return [(_page_row(table_ref, col, row, page_size=page_size,
                         pages_per_col=pages_per_col), 0)]
  else:
    def address(col, row):
      slot0, base = _div(row, page_size), col * pages_per_col
      return [(table_ref[base + jnp.minimum(slot0 + i, pages_per_col - 1)] * page_size, 0)
              for i in range(pieces)]

  kernel_body.attention_kernel(
      items_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, out_ref, q_smem, q_bar, address=address,
      block_k=block_k, tile_pieces=pieces, **kwargs)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _paged_attention(q, k_pool, v_pool, page_table, seq_info, n_segments, k_scale=None,
                     v_scale=None, *, scale, config, interpret):
  # pylint: disable=protected-access
  num_q_heads = q.shape[1]
  page_size, num_kv_heads = k_pool.shape[1:3]
  pages_per_col = page_table.shape[1]
  num_rows = pages_per_col * page_size        # logical rows (positions) of a column
  group = num_q_heads // num_kv_heads
  block_k = config.block_k
  tile_rows = column.q_tile_rows(config.block_q, group)
  config = column.bounded_config(config, num_rows, block_k=block_k, window=None)
  seg = column._segment_plan(seq_info, n_segments, num_rows=num_rows, window=None,
                             group=group, tile_rows=tile_rows, block_k=block_k,
                             align=column.ROW_ALIGN, config=config)
  kernel = functools.partial(_paged_kernel, page_size=page_size, pages_per_col=pages_per_col)
  # Logical rows past `M * P` map to the table's last page (see `_paged_kernel`), so a
  # column of fewer rows than one tile still streams a whole tile: the interpreter
  # variant's last-tile clamp (`cache_rows - block_k`) stays at row 0 or above.
  return column.run_items(kernel, q, seg, (pool_view(k_pool), pool_view(v_pool),
                                           page_table.reshape(-1)),
                          group=group, block_k=block_k, cache_rows=max(num_rows, block_k),
                          window=None, scale=scale, config=config, interpret=interpret,
                          k_scale=k_scale, v_scale=v_scale)


def paged_varlen_attention_sm90(q, k_pool, v_pool, page_table, seq_info, n_segments, *, scale,
                                k_scale=None, v_scale=None, config=None, interpret=False):
  """`paged_varlen_attention_reference` on the Mosaic GPU kernel (flat layers only).

  Args:
    q: `[T, H_q, D]` queries in step-token order (any float dtype).
    k_pool, v_pool: `[num_pages, P, K, D]` pools (bf16, fp16 or fp32) already
      holding this step's K/V; pages and rows outside a segment's read range
      may hold anything, NaN included.
    page_table: `[C, M]` int32; column `c`'s position `p` is at
      `pool[page_table[c, p // P], p % P]`.
    seq_info: `[S, 5]` int32 segment table (`S >= 1` rows, one per token for a cache
      step; fewer bound the plan, see `varlen_attention_reference`); rows
      `[0, n_segments)` are real.
    n_segments: int32 scalar.
    scale: softmax scale (Python float).
    config: a `VarlenAttentionConfig` whose `block_k` divides `P`, or is a
      multiple of a `P` that is a multiple of 8; None picks one.
    interpret: False compiles for the GPU; True (or `InterpretGPUParams`) runs
      the Mosaic GPU interpreter.

  Returns:
    `[T, H_q, D]` in q's dtype; rows of tokens outside the real segments are zeros
    (`jaxkv.pure.attend` relies on it).

  Raises:
    NotImplementedError: a valid request this kernel cannot serve (the column
      kernel's reasons, or a page size no usable K/V tile serves, see `serves`).
  """
  config = check_request(q, k_pool, config=config, interpret=interpret)
  return _paged_attention(q, k_pool, v_pool, page_table, seq_info,
                          jnp.asarray(n_segments, jnp.int32), k_scale, v_scale,
                          scale=float(scale),
                          config=config, interpret=_compat.resolve_interpret(interpret))


def check_write_request(k_pool, *, config=None) -> int:
  """Raises NotImplementedError iff `paged_kv_write_sm90` would refuse this pool.

  Returns the write's `block_heads` (`kv_write_sm90.check_request` on the pool's view).
  """
  return kv_write_sm90.check_request(jax.eval_shape(pool_view, k_pool), config=config)


def _paged_write_kernel(seq_cols_ref, rows_ref, n_tokens_ref, kv_new_ref,  # Inputs
                        table_ref,                                        # Inputs
                        k_ref, v_ref,            # Inputs, written in place (Refs)
                        *scratch, page_size, pages_per_col, block_heads):
  """`kv_write_sm90._kv_write_kernel` with each token's row looked up in the page table.

  `table_ref` is the page table flattened to `[C * M]` int32; the pools are
  viewed as one column of rows (`pool_view`), so every token writes column 0.
  """

  def address(token):
    row = _page_row(table_ref, seq_cols_ref[token], rows_ref[token], page_size=page_size,
                    pages_per_col=pages_per_col)
    return row, 0

  kv_write_sm90._kv_write_kernel(   # pylint: disable=protected-access
      seq_cols_ref, rows_ref, n_tokens_ref, kv_new_ref, k_ref, v_ref, *scratch,
      block_heads=block_heads, address=address)


@functools.partial(jax.jit, static_argnames=("block_heads", "interpret"))
def _paged_kv_write(k_pool, v_pool, k_new, v_new, seq_cols, rows, n_tokens, page_table,
                    k_scale=None, v_scale=None, *, block_heads, interpret):
  page_size, pages_per_col = k_pool.shape[1], page_table.shape[1]
  kernel = functools.partial(_paged_write_kernel, page_size=page_size,
                             pages_per_col=pages_per_col)
  k_view, v_view = kv_write_sm90.run_write(
      kernel, pool_view(k_pool), pool_view(v_pool), k_new, v_new, seq_cols, rows, n_tokens,
      (page_table.reshape(-1),), block_heads=block_heads, interpret=interpret, k_scale=k_scale,
      v_scale=v_scale)
  return k_view.reshape(k_pool.shape), v_view.reshape(v_pool.shape)


def paged_kv_write_sm90(k_pool, v_pool, k_new, v_new, seq_cols, rows, n_tokens, page_table, *,
                        k_scale=None, v_scale=None, config=None, interpret=False):
  """`paged_kv_write_reference` on the Mosaic GPU write kernel, in place when donated.

  The kernel looks each real token's pool row `page * P + offset` up in the page
  table itself (no XLA work before it), moves only the new K/V rows, and skips
  padding tokens (`t >= n_tokens`), so no page is written but the step's own.

  Raises:
    NotImplementedError: a dtype or head geometry TMA cannot move.
  """
  block_heads = check_write_request(k_pool, config=config)
  return _paged_kv_write(k_pool, v_pool, k_new, v_new, seq_cols, rows,
                         jnp.asarray(n_tokens, jnp.int32), page_table, k_scale, v_scale,
                         block_heads=block_heads,
                         interpret=_compat.resolve_interpret(interpret))
