"""Varlen attention over a step's segment table: the Mosaic GPU kernel (sm90).

Work is cut into *items*, each served for one KV head at a time:

- a segment's query rows are its (token, query head of the GQA group) pairs,
  `q_len * G` of them, cut into q tiles of `floor(block_q / G)` whole tokens
  (`q_tile_rows`; one tile for decode), so the G query heads of a group share
  every K/V tile they stream, for any G up to `block_q`;
- a segment with a single q tile (decode, short prefill) may be further split
  over its keys (flash decoding); the number of splits is chosen on device from
  the segment lengths, within a static budget.

Segments with `q_len = 0` (padded rows of the table) produce no items. This
module checks requests, plans the items (`varlen_plan`: `_segment_plan`,
`_item_table`, the static split bound), lays q out and launches the kernel body of `varlen_kernel_sm90`. A fixed grid of
`max_programs` programs (workers x KV heads) loops over the active items,
longest first. Each item streams the K/V tiles of its key range (the
segment's one or two ring row runs, see `indexing.run_tiling`) through a
`num_stages`-deep TMA pipeline, keeps an online float32 softmax in registers,
and writes its real rows of a normalized float32 partial output plus the
log-sum-exp (base 2). The epilogue copies each token's partial back to
``[T, H_q, D]` in q's dtype, merging the splits of split segments: XLA
operations (`varlen_epilogue.combine`), or, with `fused_combine=True` and a
head layout it serves, one Mosaic GPU kernel (`combine_sm90`). Calls whose
epilogue would copy every token's partial (more tokens than may split:
`tokens_in_place`) instead have the kernel write each
unsplit token's rows into `[T, H_q, D]` itself; only the padding tokens' zeros and
the split tokens' merge remain (`varlen_epilogue.finish_in_place`).

A cache whose row count is not a multiple of 8 (most rings) is read in place by
the compiled kernel when it holds at least one K/V tile (`reads_in_place`);
smaller caches, and every such cache under the interpreter, are padded with zero
rows first (`tile_geometry`, `_padded_caches`): a copy of the step's columns of
that layer.

Keys are selected with `jnp.where` on loaded tiles (rows outside the read range
may hold NaN), and tiles with rows outside the read range have those V rows
zeroed in shared memory before the P @ V matmul (0 * NaN would be NaN).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels import _compat
from pallas_kernels import combine_sm90
from pallas_kernels import config as config_lib
from pallas_kernels import fp8
from pallas_kernels import indexing
from pallas_kernels import varlen_epilogue
from pallas_kernels import varlen_kernel_sm90
from pallas_kernels.common import SUPPORTED_KV_DTYPES
from pallas_kernels.varlen_kernel_sm90 import LOG2E
from pallas_kernels.varlen_kernel_sm90 import ROW_ALIGN
from pallas_kernels.varlen_kernel_sm90 import attention_kernel
from pallas_kernels.varlen_kernel_sm90 import Q_PART_MAX_COLS
from pallas_kernels.varlen_kernel_sm90 import q_scratch
from pallas_kernels.varlen_kernel_sm90 import shared_layout_bytes
from pallas_kernels.varlen_plan import _item_table
from pallas_kernels.varlen_plan import _segment_plan
from pallas_kernels.varlen_plan import bounded_config
from pallas_kernels.varlen_plan import item_capacity


def _cdiv(a, b):
  return (a + b - 1) // b


# wgmma head dims: a multiple of 16 elements (32 bytes, the smallest swizzle
# wgmma takes, see `swizzle_bytes`) and at most 256 (wgmma's N and TMA's box).
WGMMA_HEAD_DIM_MULTIPLE = 16
WGMMA_MAX_HEAD_DIM = 256


SMEM_BYTES = 227 * 1024    # dynamic shared memory one sm90 program may use


def _smem_bytes(config, head_dim: int, itemsize: int) -> int:
  """Shared memory of one program: the q tile, then K/V stages or output staging.

  One item at a time, the stages and the float32 output staging live in
  consecutive scopes (see `attention_kernel`), so only the larger of the two
  counts; items back to back (`varlen_kernel_sm90.item_prefetch_cols`) are used
  only where both fit, so this is what a config needs at least.
  """
  return shared_layout_bytes(
      block_q=config.block_q, block_k=config.block_k, num_stages=config.num_stages,
      head_dim=head_dim, itemsize=itemsize)


def q_tile_rows(block_q: int, group: int) -> int:
  """Rows of a q tile that hold queries: `floor(block_q / G)` whole tokens' G rows.

  A token's G rows never straddle two tiles, so every tile row maps to one
  (token, head) pair by `row // G` and the combine reads a token's G rows from
  one partial. A G that does not divide `block_q` (3, 5, 6, 7, 9..15 with 64-row
  wgmma tiles) leaves `block_q mod G` idle rows per tile (at most 1/4 of a 64-row
  tile for G <= 16) instead of padding every token to a divisor of `block_q`
  (G 5 -> 8 would idle 3/8 of every prefill tile and its q copy).
  """
  return (block_q // group) * group


def static_check(q, k_cache, *, config):
  """Raises NotImplementedError for valid requests this kernel cannot serve.

  The row count never is a reason (see `tile_geometry`).
  """
  _, num_q_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[2]
  group = num_q_heads // num_kv_heads
  dtype = np.dtype(k_cache.dtype)
  if dtype not in SUPPORTED_KV_DTYPES and not fp8.is_fp8(dtype):
    raise NotImplementedError(f"kv dtype {dtype} is not supported")
  if group > config.block_q:
    raise NotImplementedError(f"GQA group {group} must be at most {config.block_q=} "
                              "(a token's query heads share one q tile)")
  if not config.use_wgmma:
    return
  if fp8.is_fp8(dtype):
    # The interpreter variant converts fp8 tiles to q's dtype after the load; the wgmma
    # path would need that conversion (or fp8 wgmma) laid out for 1-byte tiles in shared
    # memory, which has not been written and run on a GPU.
    raise NotImplementedError(
        f"{dtype} K/V storage is not served by the compiled Mosaic GPU attention kernel "
        "(its fp8 dequantisation before wgmma is not implemented); "
        "implementation='reference' serves it")
  if dtype == np.dtype(jnp.float32):
    # wgmma on float32 operands rounds them to tf32 (~1e-3), outside CONTRACT's 1e-5.
    raise NotImplementedError(
        "float32 K/V storage is not served by the compiled Mosaic GPU attention "
        "kernel (wgmma rounds float32 to tf32, ~1e-3 error); store K/V as bfloat16 or "
        "float16 to use it, or run float32 with implementation='reference'")
  if head_dim % WGMMA_HEAD_DIM_MULTIPLE or head_dim > WGMMA_MAX_HEAD_DIM:
    raise NotImplementedError(f"{head_dim=} must be a multiple of "
                              f"{WGMMA_HEAD_DIM_MULTIPLE} and at most {WGMMA_MAX_HEAD_DIM} "
                              "for wgmma")
  # The K/V tile this cache will really use (`tile_geometry` shrinks it for small caches).
  block_k, _ = tile_geometry(k_cache.shape[0], head_dim, config=config)
  smem = _smem_bytes(dataclasses.replace(config, block_k=block_k), head_dim, dtype.itemsize)
  if smem > SMEM_BYTES:
    raise NotImplementedError(f"{config} needs {smem} bytes of shared memory for "
                              f"{head_dim=}, more than the {SMEM_BYTES} an sm90 program has; "
                              "use fewer stages or a smaller block_k")
  if head_dim > Q_PART_MAX_COLS and head_dim % Q_PART_MAX_COLS:
    # A q tile wider than 128 columns is loaded in 128-column parts, QK^T one wgmma per
    # part (`varlen_kernel_sm90.q_column_parts`): the one layout Mosaic GPU lowers for it.
    raise NotImplementedError(f"{head_dim=}: head dims above {Q_PART_MAX_COLS} must be a "
                              f"multiple of {Q_PART_MAX_COLS} for the compiled Mosaic GPU "
                              "kernel (its q tile loads in 128-column parts); use "
                              "implementation='reference'")
  # Every row count >= 1 is served: `tile_geometry` pads the rest.


def check_request(q, k_cache, *, config=None, interpret=False):
  """Resolves the config and raises NotImplementedError if this call cannot be served.

  Needs only shapes and dtypes (arrays or `jax.ShapeDtypeStruct`s), so a
  dispatcher can ask before tracing anything; `varlen_attention_sm90` runs the
  same check. Returns the config the call will use.
  """
  interpreted = _compat.resolve_interpret(interpret) is not None
  if config is None:
    config = config_lib.default_varlen_attention_config(
        group=q.shape[1] // k_cache.shape[2], head_dim=q.shape[-1], interpret=interpreted)
  if interpreted and config.use_wgmma:
    raise NotImplementedError("the Mosaic GPU interpreter cannot run wgmma here; use "
                              "VarlenAttentionConfig(use_wgmma=False)")
  static_check(q, k_cache, config=config)
  return config


def tile_geometry(num_rows: int, head_dim: int, *, config) -> tuple[int, int]:
  """Static K/V tile rows and the row count the kernel's K/V arrays get.

  Returns `(block_k, padded_rows)`. TMA into (8, 64)-tiled shared memory tiles
  the cache's row axis too, so Mosaic GPU needs the K/V arrays' row count to be
  a multiple of `ROW_ALIGN`, and tiles start at 8-aligned rows. A row count
  that is not (a ring's `window + W - 1` rarely is) is padded up to the next
  multiple with zero rows, which no read range reaches; the ring arithmetic
  keeps the true `num_rows`. `block_k` is `config.block_k` when the (padded)
  rows hold a whole tile; a smaller cache gets the largest smaller tile that
  fits (64 or 128 rows for wgmma, not `head_dim`: square tiles are served but not
  chosen, see `config.default_varlen_attention_config`), and is
  padded up to one tile when none fits. Both variants use this geometry; the
  compiled kernel reads an unaligned cache of at least one tile in place instead
  of padding it (`reads_in_place`; the padded row count then goes unused).
  """
  padded_rows = _cdiv(num_rows, ROW_ALIGN) * ROW_ALIGN
  if config.block_k <= padded_rows:
    return config.block_k, padded_rows
  if config.use_wgmma:
    sizes = [b for b in (64, 128) if b < config.block_k and b != head_dim]
  else:
    sizes = list(range(ROW_ALIGN, config.block_k, ROW_ALIGN))
  fitting = [b for b in sizes if b <= padded_rows]
  block_k = max(fitting) if fitting else min(sizes + [config.block_k])
  return block_k, max(padded_rows, block_k)


def reads_in_place(num_rows: int, head_dim: int, *, config) -> bool:
  """Whether the compiled kernel reads an unaligned cache of `num_rows` rows in place.

  True for the wgmma path when the rows are not a multiple of 8 and hold at least
  one K/V tile (`tile_geometry`): the TMA boxes then never start past the array
  and zero-fill the rows they run past, where a copy with zero rows appended
  (`_padded_caches`) would read and write nearly the whole layer per call. K, V and
  q are then read in one-swizzle-atom column parts (`varlen_kernel_sm90.column_parts`
  with `atoms`), whose swizzle-only TMA views do not tile the row axis. Smaller
  caches (under one tile) are still padded by a copy, at most one tile per column.
  """
  block_k, padded_rows = tile_geometry(num_rows, head_dim, config=config)
  return config.use_wgmma and padded_rows != num_rows and num_rows >= block_k


def _padded_caches(k_cache, v_cache, seq_info, *, padded_rows: int):
  """K/V arrays of `padded_rows` rows for the kernel, and the segment table to read them with.

  Unchanged when no padding is needed. Otherwise the step's readable K/V is
  copied with zero rows appended (see `tile_geometry`): the whole layer, or,
  when the segment table has fewer rows than the cache has columns, only the
  columns its rows name (a padded segment row names the scratch column, which
  nothing reads), segment `i` then reading staged column `i`. The ring
  arithmetic keeps the true row count, so no read range reaches the zero rows.
  """
  num_rows, num_cols = k_cache.shape[:2]
  if padded_rows == num_rows:
    return k_cache, v_cache, seq_info
  width = seq_info.shape[0]
  if width < num_cols:
    cols = seq_info[:, indexing.SEG_COL]
    k_cache, v_cache = k_cache[:, cols], v_cache[:, cols]
    seq_info = seq_info.at[:, indexing.SEG_COL].set(jnp.arange(width, dtype=jnp.int32))
  pad = ((0, padded_rows - num_rows), (0, 0), (0, 0), (0, 0))
  return jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), seq_info


@functools.partial(jax.jit, static_argnames=("window", "scale", "config", "interpret"))
def _varlen_attention(q, k_cache, v_cache, seq_info, n_segments, k_scale=None, v_scale=None, *,
                      window, scale, config, interpret):
  _, num_q_heads, head_dim = q.shape
  num_rows, _, num_kv_heads, _ = k_cache.shape
  group = num_q_heads // num_kv_heads
  tile_rows = q_tile_rows(config.block_q, group)
  block_k, padded_rows = tile_geometry(num_rows, head_dim, config=config)
  in_place = reads_in_place(num_rows, head_dim, config=config)
  if in_place:
    padded_rows = num_rows
  else:
    k_cache, v_cache, seq_info = _padded_caches(k_cache, v_cache, seq_info,
                                                padded_rows=padded_rows)
  config = bounded_config(config, num_rows, block_k=block_k, window=window)
  seg = _segment_plan(seq_info, n_segments, num_rows=num_rows, window=window, group=group,
                      tile_rows=tile_rows, block_k=block_k, align=ROW_ALIGN, config=config)
  return run_items(attention_kernel, q, seg, (k_cache, v_cache), group=group, block_k=block_k,
                   cache_rows=padded_rows, window=window, scale=scale, config=config,
                   interpret=_compat.resolve_interpret(interpret), atom_parts=in_place,
                   k_scale=k_scale, v_scale=v_scale)


def run_items(kernel, q, seg, kv_inputs, *, group, block_k, cache_rows, window, scale, config,
              interpret, atom_parts=False, k_scale=None, v_scale=None):
  """The item table, q's layout, the Mosaic GPU call and the epilogue for a segment plan.

  Shared by this module's wrapper and the paged one (`paged_sm90`): `kernel` is
  `attention_kernel` or a variant that takes more inputs after V (the page
  table), and `kv_inputs` are the arrays it reads after q (K, V, ...).
  `interpret` is resolved (`_compat.resolve_interpret`). `atom_parts`: see
  `varlen_kernel_sm90.attention_kernel`. `k_scale`, `v_scale`: fp8 K/V's per-head
  scales (else None): K's is folded into q, V's applied to the output, both exact
  (powers of two), so the kernel multiplies the stored values as they are.
  """
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = num_q_heads // group
  kv_dtype = kv_inputs[0].dtype
  # The products' dtype: the storage's, or q's for fp8 storage (q and P are not
  # rounded to fp8; the kernel converts each loaded fp8 tile).
  dtype = q.dtype if fp8.is_fp8(kv_dtype) else kv_dtype
  block_q = config.block_q
  tile_rows = q_tile_rows(block_q, group)
  max_items = item_capacity(num_tokens, group=group, tile_rows=tile_rows, config=config,
                            num_segments=seg["q_len"].shape[0])
  items = _item_table(seg, max_items=max_items, group=group, tile_rows=tile_rows,
                      block_k=block_k, window=window, sort_items=config.sort_items)
  # q rows as (token, group head) pairs per KV head, pre-scaled for exp2. The
  # last q tile's TMA may read past the rows: the GPU zero-fills those rows (no
  # copy), so only an array shorter than one tile is padded; the interpreter
  # raises on such reads, so there every tile is padded in.
  qt = q.astype(jnp.float32) * (scale * LOG2E)
  if k_scale is not None:
    qt = qt * jnp.repeat(k_scale.astype(jnp.float32), group)[None, :, None]
  qt = qt.astype(dtype)
  qt = qt.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
  qt = qt.reshape(num_kv_heads, num_tokens * group, head_dim)
  pad = block_q if interpret is not None else max(0, block_q - num_tokens * group)
  if pad:
    qt = jnp.pad(qt, ((0, 0), (0, pad), (0, 0)))
  num_workers = max(1, min(max_items, config.max_programs // num_kv_heads))
  in_place = tokens_in_place(config, num_tokens=num_tokens, group=group, head_dim=head_dim,
                             block_k=block_k, kv_dtype=kv_dtype, out_dtype=q.dtype,
                             atom_parts=atom_parts)
  full_tile_loop = config.full_tile_loop
  if full_tile_loop is None:
    full_tile_loop = head_dim in varlen_kernel_sm90.FULL_TILE_LOOP_HEAD_DIMS
  kernel = functools.partial(
      kernel, group=group, block_q=block_q, block_k=block_k,
      num_stages=config.num_stages, cache_rows=cache_rows, window=window,
      use_wgmma=config.use_wgmma, num_workers=num_workers, atom_parts=atom_parts,
      full_tile_loop=full_tile_loop)
  out_type = [jax.ShapeDtypeStruct((max_items, num_kv_heads, block_q, head_dim), jnp.float32),
              jax.ShapeDtypeStruct((max_items, num_kv_heads, block_q), jnp.float32)]
  if in_place:
    tokens = combine_sm90.token_items(seg, num_tokens=num_tokens, group=group, block_q=block_q,
                                      num_items=max_items)
    out_type.append(jax.ShapeDtypeStruct((num_tokens, num_kv_heads, group, head_dim), q.dtype))
  else:
    num_refs = 4 + len(kv_inputs)   # items, q, the K/V inputs, the partials and lse
    kernel = _without_output(kernel, num_refs)
  outs = plgpu.kernel(
      kernel,
      out_type=tuple(out_type),
      scratch_types=q_scratch(config.use_wgmma, block_q, head_dim, dtype, atoms=atom_parts),
      grid=(num_workers, num_kv_heads),
      grid_names=("worker", "head"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(items, qt, *kv_inputs)
  o_part, lse_part = outs[:2]
  if in_place:
    out = varlen_epilogue.finish_in_place(
        outs[2], o_part, lse_part, tokens, group=group, block_q=block_q,
        max_splits=config.max_splits, max_split_tokens=config.max_split_tokens)
  elif config.fused_combine and combine_sm90.supported(group=group, head_dim=head_dim):
    out = combine_sm90.combine_sm90(
        o_part, lse_part, seg, num_tokens=num_tokens, group=group, block_q=block_q,
        max_splits=config.max_splits, interpret=interpret).astype(q.dtype)
  else:
    out = varlen_epilogue.combine(
        o_part, lse_part, seg, num_tokens=num_tokens, group=group, block_q=block_q,
        max_splits=config.max_splits, max_split_tokens=config.max_split_tokens,
        out_dtype=q.dtype)
  if v_scale is not None:
    # The output is linear in V: its head's scale once here, not on every V tile.
    per_q_head = jnp.repeat(v_scale.astype(jnp.float32), group)[None, :, None]
    out = (out.astype(jnp.float32) * per_q_head).astype(q.dtype)
  return out


def _without_output(kernel, num_refs):
  """`kernel` called with `out_ref` None (after its first `num_refs` refs): every item
  writes its partial."""
  def body(*refs):
    return kernel(*refs[:num_refs], None, *refs[num_refs:])
  return body


def tokens_in_place(config, *, num_tokens, group, head_dim, block_k, kv_dtype, out_dtype,
                    atom_parts=False) -> bool:
  """Whether the kernel writes unsplit tokens' rows in place (`store_tokens`).

  Yes for calls of more than `max_split_tokens` tokens (prefill and mixed steps),
  whose epilogue would otherwise gather every token's float32 partial. Narrower
  calls (decode steps) keep their partials: where every token may split, one pass
  merges them all (`varlen_epilogue.combine`), and where none can (a cache too short
  to split) the gather measured cheaper than the padding scatter and the kernel's
  stores by token; so does the fused combine kernel. The compiled kernel stores each
  token's G rows of a staged chunk by TMA (with G = 1, runs of 2^j tokens from a
  multiple of 2^(j+1)), which reads shared memory from 128-byte-aligned addresses, so
  a token's rows of a chunk (two tokens' with G = 1) must span a multiple of 128
  bytes: every 16-bit layout staged in 64-column chunks or whole rows of 64 or 128
  columns; head dims 80, 96 and 112 only with some groups; not head dim 256
  (`MAX_TOKEN_STAGING_COLS`).
  """
  if config.fused_combine and combine_sm90.supported(group=group, head_dim=head_dim):
    return False
  if num_tokens <= config.max_split_tokens:
    return False
  # The same rule for the interpreter variant, which checks no alignment, so that it runs
  # the layouts the compiled kernel does.
  chunk = varlen_kernel_sm90.item_prefetch_cols(block_q=config.block_q, block_k=block_k,
      num_stages=config.num_stages, head_dim=head_dim, dtype=kv_dtype,
      atoms=atom_parts) or head_dim
  cols = varlen_kernel_sm90.token_staging_cols(chunk, head_dim, out_dtype)
  if cols > MAX_TOKEN_STAGING_COLS:
    return False
  token_bytes = group * cols * np.dtype(out_dtype).itemsize
  return (token_bytes * (2 if group == 1 else 1)) % 128 == 0


# The widest output staging in the output's dtype the kernel writes tokens in place
# from: jax 0.12's Mosaic GPU layout inference searched for minutes for a `(64, 256)`
# 16-bit register store (head dim 256 one item at a time), so head dim 256 keeps its
# tokens in float32 partials (a float32 staging of that width lowers at once).
MAX_TOKEN_STAGING_COLS = 128


def varlen_attention_sm90(q, k_cache, v_cache, seq_info, n_segments, *, window, scale,
                          k_scale=None, v_scale=None, config=None, interpret=False):
  """Attention of every step token over its own column's visible keys (CONTRACT §8).

  Args:
    q: `[T, H_q, D]` queries in step-token order (any float dtype).
    k_cache, v_cache: `[R, C, K, D]` storage of one layer (bf16, fp16 or fp32; fp8
      under the interpreter, with `k_scale`/`v_scale`), already holding this step's
      K/V; rows outside a segment's read range may hold anything, NaN included.
    seq_info: `[S, 5]` int32 segment table (`S >= 1` rows, one per token for a cache
      step; fewer bound the plan, see `varlen_attention_reference`); rows
      `[0, n_segments)` are real.
    n_segments: int32 scalar.
    window: None (flat) or the ring window.
    scale: softmax scale (Python float).
    config: a `VarlenAttentionConfig`; None picks the heuristic default.
    interpret: False compiles for the GPU; True (or `InterpretGPUParams`) runs
      the Mosaic GPU interpreter.

  Returns:
    `[T, H_q, D]` in q's dtype; rows of tokens outside the real segments (padding,
    every token when `n_segments` is 0) are zeros: `jaxkv.pure.attend` relies on it.

  Raises:
    NotImplementedError: for a valid request this kernel cannot serve (dtype,
      head dim, GQA group larger than `block_q`; wgmma under the interpreter).
  """
  config = check_request(q, k_cache, config=config, interpret=interpret)
  return _varlen_attention(q, k_cache, v_cache, seq_info, jnp.asarray(n_segments, jnp.int32),
                           k_scale, v_scale, window=window, scale=float(scale), config=config,
                           interpret=_compat.resolve_interpret(interpret))
