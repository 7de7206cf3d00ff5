"""The Mosaic GPU varlen attention kernel body (sm90), for `varlen_attention_sm90`.

One program serves items `w, w + num_workers, ...` of one KV head: it streams each
item's K/V tiles through a `num_stages`-deep TMA pipeline, keeps an online float32
softmax in registers and writes the item's normalized partial output and
log-sum-exp (base 2). `varlen_attention_sm90` plans the items (the table whose
columns are the `IT_*` fields below), lays q out and launches this kernel;
`paged_sm90` runs it through a page table (`address`).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from pallas_kernels import indexing
from pallas_kernels.common import MASK_VALUE

LOG2E = math.log2(math.e)
ROW_ALIGN = 8   # TMA into (8, 64)-tiled shared memory needs 8-aligned rows

# Columns of the per-item table the kernel reads.
(IT_SLOT, IT_ACTIVE, IT_COL, IT_KIND, IT_Q_ROW0, IT_Q_TOK0, IT_POS0, IT_LO, IT_END,
 IT_FIRST_ROW, IT_FIRST_LEN, IT_SECOND_LEN, IT_TILE0_ROW, IT_NUM_FIRST, IT_T_BEGIN,
 IT_T_END, IT_ALL_START, IT_ALL_STOP, IT_ROWS, IT_WHOLE) = range(20)
NUM_ITEM_FIELDS = 20

# Head dims whose items run, by default (`VarlenAttentionConfig.full_tile_loop` None),
# the tiles that need no mask (`indexing.full_tile_range`) in a loop of their own with
# the unmasked softmax and no V fix-up, between two loops that choose per tile: faster
# at 128; at 64 the larger loop code costs more than the masks it skips; other head
# dims are unmeasured and keep one loop. The same results bitwise either way.
FULL_TILE_LOOP_HEAD_DIMS = frozenset({128})

# Shared memory of one SM on sm90 and what each resident program costs beyond its
# own allocation (the driver's reserve; Mosaic GPU's reduction scratch, barriers
# and 1 KiB alignment of each buffer, counted generously).
SM_SMEM_BYTES = 228 * 1024
PROGRAM_SMEM_OVERHEAD = 1024 + 3 * 1024
# Programs per SM the register file allows: ~240 registers per thread of one
# 128-thread warpgroup (ptxas report).
MAX_PROGRAMS_PER_SM = 2


def attention_kernel(items_ref, q_ref, k_ref, v_ref,   # Inputs
                      o_ref, lse_ref, out_ref,          # Outputs
                      q_smem, q_bar,                    # Scratch
                      *, group, block_q, block_k, num_stages, cache_rows, window,
                      use_wgmma, num_workers, address=None, tile_pieces=1, atom_parts=False,
                      full_tile_loop=False):
  """One program: items `w, w + num_workers, ...` (segment q tile x key split) of one KV head.

  Grid axes: "worker" (`num_workers` programs per head, each looping over the
  active items, longest first) and "head" (KV head). A static grid sized for the
  worst case would launch mostly empty programs, which still hold shared
  memory while they start. Inputs: the item table (flattened, preceded by the
  number of active items), q as `[K, rows, D]` (rows are
  (token, group head) pairs, pre-scaled by `scale * log2 e`), the K/V caches
  (`cache_rows` rows, padded per `tile_geometry`).
  Outputs: normalized float32 partial outputs `[items, K, block_q, D]` and
  log-sum-exp `[items, K, block_q]` (base 2), indexed by the item's slot, and
  `out_ref`: None, every item writing its partial; or the attention output
  `[T, K, G, D]` in its own dtype (tokens in place,
  `varlen_attention_sm90.tokens_in_place`), which items whose segment is not split
  (`IT_WHOLE`) write their tokens' rows to directly (`store_tokens`) instead of a
  partial (the caller zeros the padding tokens' rows and merges the split ones).
  Scratch: the q tile and its barrier; the K/V stages and the output staging
  either live for all of the program's items, the next item's first tiles
  requested before the current item's store (items back to back,
  `item_prefetch_cols`), or, where that would cost the SM its second program,
  in two consecutive scopes per item that share shared memory.
  `address`: None reads tile rows `[row, row + block_k)` of column `col`; a
  function `(col, row) -> [(row', col'), ...]` maps each tile's first (logical)
  row to where the K/V arrays hold its `tile_pieces` runs of
  `block_k // tile_pieces` consecutive rows (paged storage, `paged_sm90.py`:
  one run per page when pages are smaller than the tile); masks and key
  positions keep the logical rows. Each run is one TMA per K and V, all of a
  stage's arriving on its one barrier (`num_arrivals=tile_pieces`).
  `atom_parts`: K/V and q in one-swizzle-atom column parts read through
  swizzle-only TMA views (`column_parts`), which do not tile the arrays' row
  axis: a cache whose row count is not a multiple of 8 is read in place.
  `full_tile_loop`: the tiles of the first run that need no mask run in a loop of
  their own (`VarlenAttentionConfig.full_tile_loop`).
  """
  head = lax.axis_index("head")
  worker = lax.axis_index("worker")
  num_items = items_ref[0]
  dtype = k_ref.dtype   # storage; q's dtype is the compute dtype (they differ for fp8 K/V)
  head_dim = k_ref.shape[-1]
  q_views = part_views(q_smem, q_scratch(use_wgmma, block_q, head_dim, q_ref.dtype,
                                         atoms=atom_parts)[0])
  stages = kv_stage_scratch(use_wgmma, num_stages, block_k, head_dim, dtype, atoms=atom_parts)
  # A stage's phase completes once all of its copies have arrived, one per piece
  # (`tile_pieces`) and column part: each `copy_gmem_to_smem` arrives once with its
  # own byte count (jax 0.11.2 and 0.12 alike).
  arrivals = tile_pieces * len(stages)
  stage_bars = lambda: plgpu.Barrier(num_arrivals=arrivals, num_barriers=num_stages)

  def item_view(item):
    """The item's table row as the closures `_stream_tiles` and its prologue read."""
    field = lambda f: items_ref[1 + item * NUM_ITEM_FIELDS + f]
    it = dict(slot=field(IT_SLOT), col=field(IT_COL), kind=field(IT_KIND),
              q_row0=field(IT_Q_ROW0), q_tok0=field(IT_Q_TOK0), pos0=field(IT_POS0),
              lo=field(IT_LO), end=field(IT_END), t_begin=field(IT_T_BEGIN),
              t_end=field(IT_T_END), all_start=field(IT_ALL_START),
              all_stop=field(IT_ALL_STOP), num_rows=field(IT_ROWS), whole=field(IT_WHOLE))
    tile_args = (it["lo"], field(IT_FIRST_ROW), field(IT_FIRST_LEN), field(IT_SECOND_LEN),
                 field(IT_TILE0_ROW), field(IT_NUM_FIRST))
    it["full_range"] = None
    if full_tile_loop:
      full_begin, full_end = indexing.full_tile_range(
          *tile_args[:3], *tile_args[4:], it["all_start"], it["all_stop"], block=block_k)
      full_begin = jnp.clip(full_begin, it["t_begin"], it["t_end"])
      it["full_range"] = (full_begin, jnp.clip(full_end, full_begin, it["t_end"]))

    def span(t):
      tile_row, rows_start, rows_end, key0 = indexing.tile_span(t, *tile_args, block=block_k)
      # The production kernel loads the aligned tile (TMA zero-fills rows past
      # the array); the interpreter raises on out-of-bounds reads, so the
      # variant loads the last `block_k` rows instead and masks the overlap.
      load_row = tile_row if use_wgmma else jnp.minimum(tile_row, cache_rows - block_k)
      return load_row, rows_start, rows_end, key0
    it["span"] = span
    return it

  def load_q_tile(it):
    """The item's q tile: one copy per column part (`q_column_parts`), all arriving on `q_bar`."""
    q_rows = pl.ds(it["q_row0"], block_q)
    for (c0, width), (part_smem, _) in zip(
        q_column_parts(use_wgmma, head_dim, atoms=atom_parts), q_views, strict=True):
      src = q_ref.at[head, q_rows] if width == head_dim else q_ref.at[
          head, q_rows, pl.ds(c0, width)]
      plgpu.copy_gmem_to_smem(src, part_smem, q_bar)

  def tiles(it, k_smem, v_smem, k_bars, v_bars):
    return _Tiles(k_ref, v_ref, part_views(k_smem, stages), part_views(v_smem, stages),
                  k_bars, v_bars, span=it["span"], col=it["col"], head=head,
                  t_begin=it["t_begin"], t_end=it["t_end"], num_stages=num_stages,
                  block_k=block_k, use_wgmma=use_wgmma, address=address,
                  tile_pieces=tile_pieces, atom_parts=atom_parts)

  def stream(it, kv, *, prologue):
    """Streams the item's K/V tiles; returns `(acc, m_i, l_i)`."""
    return _stream_tiles(
        tiles(it, *kv), q_views, q_bar, pos0=it["pos0"], q_tok0=it["q_tok0"], lo=it["lo"],
        end=it["end"], kind=it["kind"], all_start=it["all_start"], all_stop=it["all_stop"],
        group=group, block_q=block_q, window=window, prologue=prologue,
        full_range=it["full_range"])

  out_dtype = None if out_ref is None else out_ref.dtype

  def store(it, acc, m_i, l_i, staging, lse_smem, *, chunk_cols=None):
    o_smem, out_smem = staging_views(staging, out_dtype)

    def partial():
      store_partial(acc, m_i, l_i, o_smem, lse_smem, o_ref.at[it["slot"], head],
                    lse_ref.at[it["slot"], head], num_rows=it["num_rows"], block_q=block_q,
                    chunk_cols=chunk_cols)
    if out_ref is None:
      partial()
      return
    pl.when(it["whole"] == 0)(partial)

    @pl.when(it["whole"] != 0)
    def _tokens():
      # q_row0 is the tile's first (token, group head) row: G times its first token.
      store_tokens(acc, l_i, out_smem, out_ref, tok0=div(it["q_row0"], group),
                   num_tokens=div(it["num_rows"], group), head=head, group=group,
                   block_q=block_q, back_to_back=chunk_cols is not None)

  chunk_cols = item_prefetch_cols(block_q=block_q, block_k=block_k, num_stages=num_stages,
                                  head_dim=head_dim, dtype=dtype, atoms=atom_parts)
  if chunk_cols is None:
    # One item at a time: the K/V stages and the output staging share shared memory.
    @pl.loop(worker, num_items, step=num_workers)
    def _run(item):
      it = item_view(item)
      load_q_tile(it)
      acc, m_i, l_i = pl.run_scoped(lambda *kv: stream(it, kv, prologue=True), stages, stages,
                                    stage_bars(), stage_bars())
      pl.run_scoped(lambda staging, lse_smem: store(it, acc, m_i, l_i, staging, lse_smem),
                    staging_type(block_q, head_dim, head_dim, out_dtype),
                    plgpu.SMEM((block_q,), jnp.float32))
    return

  def program(k_smem, v_smem, k_bars, v_bars, o_smem, lse_smem):
    """Items back to back: the next item's q tile and first K/V tiles are requested
    before this item's output is normalized and stored, so those loads overlap the store."""
    kv = (k_smem, v_smem, k_bars, v_bars)

    def begin(item):
      it = item_view(item)
      load_q_tile(it)
      tiles(it, *kv).prologue()

    @pl.when(worker < num_items)
    def _first():
      begin(worker)

    @pl.loop(worker, num_items, step=num_workers)
    def _run(item):
      it = item_view(item)
      acc, m_i, l_i = stream(it, kv, prologue=False)

      @pl.when(item + num_workers < num_items)
      def _next():
        # q and the stages were last read by ordinary loads (q into registers; the
        # interpreter's tiles, the V fix-up): order those before the TMA writes.
        plgpu.commit_smem()
        begin(item + num_workers)

      store(it, acc, m_i, l_i, o_smem, lse_smem, chunk_cols=chunk_cols)

    # The staging must stay allocated until TMA has read it (the writes to global
    # memory complete on their own before the kernel ends).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(program, stages, stages, stage_bars(), stage_bars(),
                staging_type(block_q, chunk_cols, head_dim, out_dtype),
                plgpu.SMEM((block_q,), jnp.float32))


def store_partial(acc, m_i, l_i, o_smem, lse_smem, o_dst, lse_dst, *, num_rows, block_q,
                  chunk_cols=None):
  """Normalizes an item's accumulator and stores its real rows and log-sum-exp (base 2).

  `acc`: the float32 accumulator as a tuple of column parts (`column_parts`).

  `o_dst` `[block_q, D]` and `lse_dst` `[block_q]` are the item's slot of the
  float32 partial outputs; `o_smem`, `lse_smem` the staging buffers.
  `chunk_cols`: None, the whole row one item at a time; a width, chunks of it back to
  back (`o_smem` is `[block_q, chunk_cols]`; see `_staged_chunks`).
  """
  has_keys = l_i > 0.0
  l_safe = jnp.where(has_keys, l_i, 1.0)   # guarded: a row may see no key of this split
  # Store only the item's real rows, rounded up to 8: a decode item has G of
  # 64. TMA sizes are static, so the count is stored as a sum of powers of two.
  num_rows8 = (num_rows + 7) // 8 * 8

  def store_rows(src, dst):
    def store_run(offset, size):
      rows = pl.ds(offset, size)
      plgpu.copy_smem_to_gmem(src.at[rows], dst.at[rows])
    _power_of_two_runs(num_rows8, largest=block_q, smallest=8, store=store_run)

  def stage_lse(i):
    if i == 0:
      lse_smem[...] = jnp.where(has_keys, m_i + jnp.log(l_safe) * LOG2E, MASK_VALUE)

  def store(i, c_out, width):
    store_rows(o_smem, o_dst if width == o_dst.shape[-1] else o_dst.at[:, pl.ds(c_out, width)])
    if i == 0:
      plgpu.copy_smem_to_gmem(lse_smem, lse_dst)

  _staged_chunks(acc, l_safe, o_smem, back_to_back=chunk_cols is not None,
                 before_commit=stage_lse, store=store)


def store_tokens(acc, l_i, stage, out_ref, *, tok0, num_tokens, head, group, block_q,
                 back_to_back=False):
  """Normalizes an item's accumulator into the output's dtype and stores its tokens' rows
  in place: rows `(token, g)` of the tile to `out_ref[tok0 + token, head, g]`.

  `out_ref` is the attention output `[T, K, G, D]` (`[T, H_q, D]` with the query
  heads of a KV head side by side); `stage` the staging in its dtype; a tile holds
  `block_q // G` whole tokens (`q_tile_rows`), the item's first `num_tokens` of them
  real. One TMA per token, of its G rows (a token's rows are contiguous in the
  staging but G rows apart from the next token's in the output, and Mosaic GPU does
  not lower a `[tokens, G, D]` view of the staging); with G = 1, runs of tokens, as a
  sum of powers of two, largest first (a run of `s` tokens starts at a multiple of
  `2s`). TMA reads shared memory from 128-byte-aligned addresses, which
  `tokens_in_place` checks. `stage`'s width and `back_to_back`: see `_staged_chunks`.
  """
  tile_tokens = block_q // group
  head_dim = out_ref.shape[-1]

  def columns(ref, c_out, width):
    return ref if width == head_dim else ref.at[..., pl.ds(c_out, width)]

  def store(i, c_out, width):
    del i
    if group == 1:
      def store_run(first, size):
        plgpu.copy_smem_to_gmem(
            stage.at[pl.ds(first, size)],
            columns(out_ref.at[pl.ds(tok0 + first, size), head, 0], c_out, width))
      _power_of_two_runs(num_tokens, largest=tile_tokens, smallest=1, store=store_run)
      return
    for token in range(tile_tokens):
      @pl.when(token < num_tokens)
      def _store_token(token=token):
        plgpu.copy_smem_to_gmem(stage.at[pl.ds(token * group, group)],
                                columns(out_ref.at[tok0 + token, head], c_out, width))

  # Guarded: a row may see no key (its output is then zero).
  _staged_chunks(acc, jnp.where(l_i > 0.0, l_i, 1.0), stage, back_to_back=back_to_back,
                 before_commit=lambda i: None, store=store)


def _power_of_two_runs(count, *, largest: int, smallest: int, store):
  """Issues `store(first, size)` for `[0, count)` cut into runs of powers of two from
  the largest power of two up to `largest` down to `smallest`, larger runs first (a
  run of `s` starts at a multiple of `2s`): TMA sizes are static, `count` is not.
  `count` is a multiple of `smallest`."""
  size = 1 << (largest.bit_length() - 1)
  while size >= smallest:
    @pl.when(count & size != 0)
    def _store_run(size=size):
      store(count & -(2 * size), size)
    size //= 2


def _staged_chunks(acc, l_safe, stage, *, back_to_back, before_commit, store):
  """Normalizes the accumulator by `l_safe` (each row's sum, 1 where it has none) into
  `stage`, in its dtype, chunk by chunk, and stores each chunk: `before_commit(i)`
  stages more (the log-sum-exp), then the shared-memory writes are committed and
  `store(i, first output column, width)` issues the TMAs.

  `stage` is `[block_q, D]` (the whole row) or narrower (chunks of its width,
  `output_chunks`). One item at a time (`back_to_back` False) waits until the
  stores are done; back to back (`item_prefetch_cols`), each chunk is written once TMA
  has read the staging's previous contents, and nothing is awaited after the last.
  """
  # One reciprocal per row and a multiply per element: the same arithmetic whichever
  # chunks the row is staged in (a division by a broadcast may be compiled as either,
  # depending on the fusion around it, as the interpreter's XLA CPU code showed).
  inv_l = 1.0 / l_safe

  def stage_parts(parts):
    """Writes the normalized accumulator parts side by side into `stage`."""
    c0 = 0
    for part in parts:
      width = part.shape[-1]
      dst = stage if width == stage.shape[-1] else stage.at[:, pl.ds(c0, width)]
      dst[...] = (part * lax.broadcast_in_dim(inv_l, part.shape, [0])).astype(stage.dtype)
      c0 += width

  chunks = output_chunks(tuple(part.shape[-1] for part in acc), stage.shape[-1])
  c_out = 0
  for i, (p, c, width) in enumerate(chunks):
    if back_to_back:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if p is None:   # the whole row, every part
      stage_parts(acc)
    else:
      part = acc[p]
      stage_parts((part if width == part.shape[-1] else part[:, c:c + width],))
    before_commit(i)
    plgpu.commit_smem()
    store(i, c_out, width)
    c_out += width
  if not back_to_back:
    plgpu.wait_smem_to_gmem(0)


def token_staging_cols(cols: int, head_dim: int, out_dtype) -> int:
  """Columns of the in-place token staging (`store_tokens`) in a float32 staging of
  `cols` columns: as many of the output's dtype as fit its bytes (a 16-bit output
  stages twice the columns, so head dim 128 back to back stages whole rows: half the
  copies), at most the row."""
  return min(head_dim, cols * 4 // np.dtype(out_dtype).itemsize)


def staging_type(block_q: int, cols: int, head_dim: int, out_dtype):
  """The output staging, `[block_q, cols]` float32 for partials, and, when items may
  write their tokens in place (`out_dtype` not None), a view in the output's dtype
  over the same bytes (`staging_views`; `token_staging_cols` columns)."""
  f32 = plgpu.SMEM((block_q, cols), jnp.float32)
  if out_dtype is None or np.dtype(out_dtype) == np.dtype(jnp.float32):
    return f32
  return plgpu.RefUnion(f32, plgpu.SMEM(
      (block_q, token_staging_cols(cols, head_dim, out_dtype)), out_dtype))


def staging_views(staging, out_dtype):
  """`(float32 view, output-dtype view or None)` of a staging of `staging_type`."""
  if out_dtype is None:
    return staging, None
  if np.dtype(out_dtype) == np.dtype(jnp.float32):
    return staging, staging
  return tuple(staging)


def output_chunks(part_widths, chunk_cols):
  """`(part, first column in the part, width)` of each staged chunk of the output, left
  to right: `(None, 0, D)` for the whole row (`chunk_cols == D`), else every column part
  of the accumulator cut into pieces of `chunk_cols` (which divides each part)."""
  if chunk_cols == sum(part_widths):
    return ((None, 0, chunk_cols),)
  assert all(width % chunk_cols == 0 for width in part_widths), (part_widths, chunk_cols)
  return tuple((p, c, chunk_cols) for p, width in enumerate(part_widths)
               for c in range(0, width, chunk_cols))


def shared_layout_bytes(*, block_q, block_k, num_stages, head_dim, itemsize) -> int:
  """Shared memory of one program one item at a time: the q tile, then the K/V stages
  or the float32 output staging (and its log-sum-exp), which share memory."""
  stages = num_stages * 2 * block_k * head_dim * itemsize
  staging = block_q * (head_dim + 1) * 4
  return block_q * head_dim * itemsize + max(stages, staging)


def _programs_per_sm(smem_bytes: int) -> int:
  return min(MAX_PROGRAMS_PER_SM, SM_SMEM_BYTES // (smem_bytes + PROGRAM_SMEM_OVERHEAD))


def item_prefetch_cols(*, block_q, block_k, num_stages, head_dim, dtype, atoms=False):
  """The output staging's width for items back to back, or None for one item at a time.

  Back to back, a program requests the next item's q tile and first K/V tiles
  before it stores the current item's output, so the store and those loads
  overlap; it then holds q, the K/V stages and the float32 staging at once,
  where one at a time the staging reuses the stages' memory. The widest staging
  (the whole row, else halves, else quarters of the accumulator's column parts)
  that keeps two programs per SM is chosen: at head dim 128 with 64-row tiles
  and two stages, a 64-column staging (96 KiB a program) where the whole row
  would leave room for one. Configs that fit one program per SM either way keep
  one item at a time.
  """
  itemsize = np.dtype(dtype).itemsize
  q_bytes = block_q * head_dim * itemsize
  stage_bytes = num_stages * 2 * block_k * head_dim * itemsize
  lse_bytes = block_q * 4
  shared = _programs_per_sm(shared_layout_bytes(block_q=block_q, block_k=block_k,
                                                num_stages=num_stages, head_dim=head_dim,
                                                itemsize=itemsize))
  if shared < MAX_PROGRAMS_PER_SM:
    # One program per SM (head dim 256; 128-key tiles or three stages at 128): back to
    # back measured slower there (the larger staging leaves less L1), and nothing hides it.
    return None
  widths = [width for _, width in column_parts(head_dim, atoms=atoms)]
  # Narrower chunks than the row are stored by TMA into column slices of the float32
  # partials, which Mosaic GPU takes for row widths that are multiples of 32 elements.
  narrower = [] if head_dim % 32 else [
      cols for cols in (max(widths), max(widths) // 2, max(widths) // 4)
      if cols < head_dim and cols % 8 == 0 and all(width % cols == 0 for width in widths)]
  for cols in (head_dim, *narrower):
    smem = q_bytes + stage_bytes + block_q * cols * 4 + lse_bytes
    if smem + PROGRAM_SMEM_OVERHEAD <= SM_SMEM_BYTES and _programs_per_sm(smem) >= shared:
      return cols
  return None


def row_bound_mask(load_row, rows_start, rows_end, key0, key_col, query_row, *, lo, end, kind,
                   window):
  """Which scores of a tile are real, as two column limits per row: `lo_r <= col < hi_r`.

  A score is real when its row is in the read rows and its key is in the read
  range and visible to the row's query (CONTRACT §7.2). Row `load_row + c` of the
  tile holds key `c + key0 - c0`, `c0 = rows_start - load_row`, so each condition
  is a bound on the column `c`: the read rows `[c0, rows_end - load_row)`, the
  read range `[lo, end)`, causality (`key <= q`) and the ring's window (`key > q -
  window`) for the row's query position `q` (`query_row`, one per row), none of
  the last two for an owner block. Scalars and per-row vectors only, so the score
  array sees two compares rather than a dozen integer ops per score.
  """
  c0 = rows_start - load_row
  shift = c0 - key0                        # key k sits in column k + shift
  c_lo = jnp.maximum(c0, lo + shift)
  c_hi = jnp.minimum(rows_end - load_row, end + shift)
  is_block = (kind == indexing.KIND_BLOCK).astype(jnp.int32)
  causal_hi = query_row + (shift + 1)
  # An owner block's rows see the whole read range: their causal bound becomes `c_hi`.
  hi = jnp.minimum(causal_hi + is_block * (c_hi - causal_hi), c_hi)
  cols = key_col.shape
  in_cols = key_col < lax.broadcast_in_dim(hi, cols, [0])
  if window is None:
    return in_cols & (key_col >= c_lo)
  win_lo = query_row + (shift + 1 - window)
  row_lo = jnp.maximum(win_lo - is_block * (win_lo - c_lo), c_lo)
  return in_cols & (key_col >= lax.broadcast_in_dim(row_lo, cols, [0]))


def online_softmax(s, m_i, l_i, acc, mask, dtype):
  """One tile's online-softmax update (base 2); `mask` None: every score is real.

  `acc` is a tuple of column parts. Returns `(m_new, l_i, acc, p)` with `acc`
  rescaled and `p` in `dtype` for P @ V.
  """
  if mask is not None:
    s = jnp.where(mask, s, MASK_VALUE)
  m_new = jnp.maximum(m_i, s.max(axis=1))
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  l_i = l_i * alpha + p.sum(axis=1)
  acc = tuple(part * lax.broadcast_in_dim(alpha, part.shape, [0]) for part in acc)
  return m_new, l_i, acc, p.astype(dtype)


class _Tiles:
  """Where an item's K/V tiles are and how they are requested: the TMA side of the
  pipeline (`_stream_tiles` consumes it).

  `k_smem`, `v_smem`: one `(copy view, matmul view)` pair per column part
  (`column_parts`, `part_views`). `address`, `tile_pieces`: see `attention_kernel`.
  """

  def __init__(self, k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, *, span, col, head, t_begin,
               t_end, num_stages, block_k, use_wgmma, address=None, tile_pieces=1,
               atom_parts=False):
    self.k_ref, self.v_ref, self.k_smem, self.v_smem = k_ref, v_ref, k_smem, v_smem
    self.k_bars, self.v_bars = k_bars, v_bars
    self.span, self.col, self.head, self.t_begin, self.t_end = span, col, head, t_begin, t_end
    self.num_stages, self.block_k, self.use_wgmma = num_stages, block_k, use_wgmma
    self.address, self.tile_pieces, self.atom_parts = address, tile_pieces, atom_parts
    self.head_dim = k_ref.shape[-1]
    self.parts = column_parts(self.head_dim, atoms=atom_parts)
    self.piece_rows = block_k // tile_pieces
    if tile_pieces > 1:   # checked by the caller (`paged_sm90.check_request`)
      assert self.piece_rows * tile_pieces == block_k and self.piece_rows % ROW_ALIGN == 0, (
          block_k, tile_pieces)

  def locate(self, t):
    """Where tile `t` is stored: one `(first row, column)` of the K/V arrays per piece."""
    load_row = self.span(t)[0]
    where = [(load_row, self.col)] if self.address is None else self.address(self.col, load_row)
    assert len(where) == self.tile_pieces, (len(where), self.tile_pieces)
    return where

  def _stage_rows(self, smem, stage, piece):
    # Static row slices at multiples of 8 rows: whole (8, swizzle)-tiles of the stage.
    if self.tile_pieces == 1:
      return smem.at[stage]
    return smem.at[stage, pl.ds(piece * self.piece_rows, self.piece_rows)]

  def fetch(self, t, stage, where=None, names=("k", "v")):
    pieces = self.locate(t) if where is None else where
    loads = []
    for load_row, load_col in pieces:
      if self.use_wgmma:
        load_row = pl.multiple_of(load_row, ROW_ALIGN)
      loads.append((pl.ds(load_row, self.piece_rows), load_col))
    # K first: its tile is waited on first.
    chosen = {"k": (self.k_ref, self.k_smem, self.k_bars),
              "v": (self.v_ref, self.v_smem, self.v_bars)}
    for cache_ref, part_smems, bars in (chosen[name] for name in names):
      for (c0, width), (smem, _) in zip(self.parts, part_smems, strict=True):
        for piece, (rows, load_col) in enumerate(loads):
          src = cache_ref.at[rows, load_col, self.head]
          if width != self.head_dim:   # one column part of the rows (`column_parts`)
            src = cache_ref.at[rows, load_col, self.head, pl.ds(c0, width)]
          plgpu.copy_gmem_to_smem(src, self._stage_rows(smem, stage, piece), bars.at[stage])

  def prologue(self):
    """Requests the item's first `num_stages` tiles, one per stage."""
    t_begin, t_end = self.t_begin, self.t_end
    # Paged storage: the first stages' page-table loads are issued together, before
    # the first TMA has to wait on one (the tile is clamped into the item's range).
    first = [None] * self.num_stages if self.address is None else [
        self.locate(jnp.minimum(t_begin + stage, jnp.maximum(t_end - 1, t_begin)))
        for stage in range(self.num_stages)]
    for stage in range(self.num_stages):
      @pl.when(t_begin + stage < t_end)
      def _prologue():
        self.fetch(t_begin + stage, stage, first[stage])


def _stream_tiles(tiles, q_smem, q_bar, *, pos0, q_tok0, lo, end, kind, all_start, all_stop,
                  group, block_q, window, prologue=True, full_range=None):
  """The TMA pipeline and online softmax over tiles `[t_begin, t_end)` of one item.

  `tiles`: the item's `_Tiles`. `q_smem`: one `(copy view, matmul view)` pair per
  column part (`q_column_parts`); the returned accumulator is a tuple of
  `column_parts`. `prologue`: False when the caller has already requested the
  first tiles (`_Tiles.prologue`). `full_range`: None, or tiles `[begin, end)`
  within `[t_begin, t_end)` that need no mask (`full_tile_loop`): they run in a
  loop of their own with the unmasked softmax.
  """
  k_ref, k_smem, v_smem = tiles.k_ref, tiles.k_smem, tiles.v_smem
  k_bars, v_bars = tiles.k_bars, tiles.v_bars
  span, t_begin, t_end = tiles.span, tiles.t_begin, tiles.t_end
  num_stages, block_k, use_wgmma = tiles.num_stages, tiles.block_k, tiles.use_wgmma
  address, locate, fetch = tiles.address, tiles.locate, tiles.fetch
  # K/V tiles are stored in `kv_dtype`; the products run in q's dtype (`dtype`). They
  # differ only for fp8 storage, whose tiles are converted after the load (its scales
  # are applied outside the kernel: K's folded into q, V's to the output).
  kv_dtype = k_ref.dtype
  dtype = q_smem[0][1].dtype
  convert = (lambda x: x) if kv_dtype == dtype else (lambda x: x.astype(dtype))
  head_dim = tiles.head_dim
  parts = tiles.parts
  atom_parts = tiles.atom_parts
  if prologue:
    tiles.prologue()
  plgpu.barrier_wait(q_bar)
  q_cols = q_column_parts(use_wgmma, head_dim, atoms=atom_parts)

  def load_q():
    """q's column parts as values (the WGMMA register layout on the wgmma path)."""
    if not use_wgmma:
      return [part[...] for _, part in q_smem]
    return [plgpu.load(part, layout=plgpu.Layout.WGMMA) for _, part in q_smem]

  def k_columns(stage, c0, width):
    """Columns `[c0, c0 + width)` of K's stage: a column part or a slice of one."""
    for (p0, p_width), (_, smem) in zip(parts, k_smem):
      if p0 <= c0 and c0 + width <= p0 + p_width:
        return smem.at[stage] if width == p_width else smem.at[stage, :, pl.ds(c0 - p0, width)]
    raise AssertionError((parts, c0, width))

  # Square tiles (`block_k == head_dim`) load q for every tile: held in registers across
  # the tile loop, q is corrupted from the second tile on when P has its shape (the
  # Mosaic GPU miscompute recorded in docs/performance-history.md, "Square tiles").
  q = None if use_wgmma and block_k == head_dim else load_q()

  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = wgmma_layout.reduce(1)
  iota = lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma_layout)
  # Query position of each row: rows are (token, group head) pairs.
  query_pos = pos0 + div(q_tok0 + iota((block_q, block_k), 0), group)
  key_col = iota((block_q, block_k), 1)
  query_row = query_pos.max(axis=1)   # one value per row, once per item

  def body(t, carry, *, all_full=False):
    """One tile; `all_full` (static): the loop holds only tiles that need no mask."""
    acc, m_i, l_i = carry
    stage = lax.rem(t - t_begin, jnp.int32(num_stages))
    # Paged storage: look the refill tile's page up before this tile's math, so
    # the page-table load's latency hides behind it (the index is clamped to
    # the item's tiles; an unused lookup reads a valid table entry).
    refill = None if address is None else locate(jnp.minimum(t + num_stages, t_end - 1))
    load_row, rows_start, rows_end, key0 = span(t)
    is_partial = (rows_start > load_row) | (rows_end < load_row + block_k)
    plgpu.barrier_wait(k_bars.at[stage])
    q_now = load_q() if q is None else q
    # QK^T accumulates one product per q column part over K's matching columns.
    if use_wgmma:
      def compute_qk(acc_ref):
        for (c0, width), q_part in zip(q_cols, q_now, strict=True):
          plgpu.wgmma(acc_ref, q_part, k_columns(stage, c0, width).transpose((1, 0)))
        return acc_ref[...]
      s = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_k), jnp.float32))
    else:
      s = sum(lax.dot_general(q_part, convert(k_columns(stage, c0, width)[...]),
                              (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
              for (c0, width), q_part in zip(q_cols, q_now, strict=True))

    # The K stage is free once QK^T has read it (wgmma is awaited above): its
    # refill flies during this tile's softmax and P @ V, not after them.
    @pl.when(t + num_stages < t_end)
    def _refill_k():
      if not use_wgmma:
        plgpu.commit_smem()   # order the ordinary loads of K before the TMA (see below)
      fetch(t + num_stages, stage, refill, names=("k",))

    def softmax_update(s, m_i, l_i, acc, *, masked):
      mask = None
      if masked:
        mask = row_bound_mask(load_row, rows_start, rows_end, key0, key_col, query_row, lo=lo,
                              end=end, kind=kind, window=window)
      return online_softmax(s, m_i, l_i, acc, mask, dtype)

    # A tile whose rows all hold read-range keys that every query of the item
    # sees (interior decode tiles) skips the mask arithmetic.
    if all_full:
      m_new, l_i, acc, p16 = softmax_update(s, m_i, l_i, acc, masked=False)
    else:
      is_full = (~is_partial) & (key0 >= all_start) & (key0 + block_k <= all_stop)
      m_new, l_i, acc, p16 = lax.cond(
          is_full, functools.partial(softmax_update, masked=False),
          functools.partial(softmax_update, masked=True), s, m_i, l_i, acc)

    plgpu.barrier_wait(v_bars.at[stage])
    # P @ V: one product per column part, into that part of the accumulator.
    v_tiles = [smem.at[stage] for _, smem in v_smem]
    if not all_full:   # a full tile has no rows outside the read range
      v_valid = []
      for _, width in parts:
        v_row = load_row + iota((block_k, width), 0)
        v_valid.append((v_row >= rows_start) & (v_row < rows_end))
    if use_wgmma:
      if not all_full:
        # Zeroed, not only masked in P: stale or NaN rows outside the read range would
        # reach the output through 0 * NaN.
        @pl.when(is_partial)
        def _zero_rows_outside_read_range():
          for v_tile, valid in zip(v_tiles, v_valid, strict=True):
            v = plgpu.load(v_tile, layout=wgmma_layout)
            v_tile[...] = jnp.where(valid, v, jnp.zeros_like(v))
          plgpu.commit_smem()
      acc = tuple(
          pl.run_state(lambda acc_ref, v_tile=v_tile: plgpu.wgmma(acc_ref, p16, v_tile))(
              plgpu.ACC.init(part))
          for part, v_tile in zip(acc, v_tiles, strict=True))
    else:
      new_acc = []
      for i, (part, v_tile) in enumerate(zip(acc, v_tiles, strict=True)):
        v = convert(v_tile[...])
        v = v if all_full else jnp.where(v_valid[i], v, jnp.zeros((), dtype))
        new_acc.append(part + lax.dot_general(p16, v, (((1,), (0,)), ((), ())),
                                              precision=lax.Precision.HIGHEST,
                                              preferred_element_type=jnp.float32))
      acc = tuple(new_acc)

    @pl.when(t + num_stages < t_end)
    def _refill():
      if not use_wgmma:
        # The tiles were read by ordinary loads; order those before the TMA
        # (async proxy) overwrites the stage. wgmma already reads through the
        # async proxy, and the production V fix-up ends with this fence.
        plgpu.commit_smem()
      fetch(t + num_stages, stage, refill, names=("v",))
    return acc, m_new, l_i

  acc = tuple(plgpu.layout_cast(jnp.zeros((block_q, width), jnp.float32), wgmma_layout)
              for _, width in parts)
  m_i = plgpu.layout_cast(jnp.full((block_q,), MASK_VALUE, jnp.float32), row_layout)
  l_i = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
  carry = (acc, m_i, l_i)
  if full_range is None:
    return lax.fori_loop(t_begin, t_end, body, carry)
  full_begin, full_end = full_range
  carry = lax.fori_loop(t_begin, full_begin, body, carry)
  carry = lax.fori_loop(full_begin, full_end, functools.partial(body, all_full=True), carry)
  return lax.fori_loop(full_end, t_end, body, carry)


def div(x, divisor: int):
  """`x // divisor` for non-negative int32 `x`; a shift for powers of two."""
  if divisor & (divisor - 1) == 0:
    return lax.shift_right_logical(x, jnp.int32(divisor.bit_length() - 1))
  return lax.div(x, jnp.int32(divisor))


def swizzle_bytes(head_dim: int, dtype) -> int:
  """The widest wgmma swizzle (128, 64 or 32 bytes) that divides a K/V row.

  wgmma reads (8, swizzle / itemsize)-tiled shared memory, so a row must be a
  whole number of swizzle atoms. 128 bytes serves head dims that are multiples
  of 64 (16-bit); 96 (192 bytes) gets 64-byte and 80 (160 bytes) 32-byte atoms.
  A narrower swizzle keeps the rows at their true width: no zero columns in
  shared memory or in the matmuls, and the TMA boxes read only the row's bytes
  (no cache copy, no padded head dim). The index math is the same for every
  head dim, which is what the interpreter variant (no swizzle) checks on CPU.
  """
  row_bytes = head_dim * np.dtype(dtype).itemsize
  return next(s for s in (128, 64, 32) if row_bytes % s == 0)


# Widest q tile (in columns) loaded into registers whole. Mosaic GPU can load a
# `(64, 256)` 16-bit tile in the WGMMA layout only from `(8, 64)`-tiled shared
# memory, which the q copy cannot use (an item's first q row is `token * G`, not a
# multiple of 8), so wider heads load q in column parts of this width
# (docs/PERFORMANCE.md, "Head layouts": why head dim 256 did not lower).
Q_PART_MAX_COLS = 128


# Column part widths (16-bit elements): one 128-, 64- or 32-byte swizzle atom per row.
PART_WIDTHS = (64, 32, 16)


def column_parts(head_dim: int, *, atoms: bool = False) -> tuple[tuple[int, int], ...]:
  """`(first column, width)` of each column part of a K/V tile in shared memory.

  Head dims whose 16-bit rows take only the 32-byte swizzle as a whole (80, 112:
  an odd multiple of 16 above 64) are split into parts of 64, 32 and 16 columns,
  largest first, each one swizzle atom wide and swizzled by it (128, 64 and 32
  bytes): one 160-byte row of head dim 80 was read in 32-byte atoms by TMA and
  wgmma; in parts most of it goes in 128-byte atoms, which measured faster on the
  H200. At 96 (64-byte atoms as a whole) parts only add instructions (slower in
  prefill), so 96 stays one part, as does every other head dim (multiples of 32,
  below 64, not a multiple of 16): one part of the whole row. The interpreter
  variant splits the same way, so CPU tests run the part index math.

  `atoms`: every head dim that is a multiple of 16 in such parts (128: two of 64;
  64: one), for caches read in place through swizzle-only views (`attention_kernel`).
  """
  if atoms and head_dim % PART_WIDTHS[-1] == 0:
    return _greedy_parts(head_dim)
  if (head_dim < PART_WIDTHS[0] or head_dim % PART_WIDTHS[-1]
      or head_dim % (2 * PART_WIDTHS[-1]) == 0):   # 64-byte atoms or wider: one part
    return ((0, head_dim),)
  return _greedy_parts(head_dim)


def _greedy_parts(head_dim: int) -> tuple[tuple[int, int], ...]:
  parts, c0 = [], 0
  for width in PART_WIDTHS:
    while head_dim - c0 >= width:
      parts.append((c0, width))
      c0 += width
  return tuple(parts)


def q_column_parts(use_wgmma: bool, head_dim: int, *,
                   atoms: bool = False) -> tuple[tuple[int, int], ...]:
  """`(first column, width)` of each column part of the q tile.

  On the wgmma path a q tile wider than 128 columns loads in 128-column parts;
  otherwise q is split like K (`column_parts`), so each part of QK^T meets one
  K part.
  """
  if use_wgmma and head_dim > Q_PART_MAX_COLS and not atoms:
    assert head_dim % Q_PART_MAX_COLS == 0, head_dim   # static_check's head dims
    return tuple((c0, Q_PART_MAX_COLS) for c0 in range(0, head_dim, Q_PART_MAX_COLS))
  return column_parts(head_dim, atoms=atoms)


def q_scratch(use_wgmma: bool, block_q: int, head_dim: int, dtype, *, atoms: bool = False):
  """The q tile's column parts in shared memory (a tuple) and their barrier (one
  arrival per part).

  Split q tiles (80 and 112, or every head dim with `atoms`) are swizzle-atom
  unions like K's (`kv_stage_scratch`): with the tiled view's transforms on the
  copy, TMA would tile q's row and column axes (an item's first q row is `token *
  G`, and 80 columns are not a multiple of 64). Other parts have no explicit
  transforms (Mosaic GPU infers them, as before parts).
  """
  parts = q_column_parts(use_wgmma, head_dim, atoms=atoms)
  if _atom_views(use_wgmma, head_dim, atoms):
    types = tuple(_atom_union((block_q, width), dtype) for _, width in parts)
  else:
    types = tuple(plgpu.SMEM((block_q, width), dtype) for _, width in parts)
  return [types, plgpu.Barrier(num_arrivals=len(parts))]


def kv_stage_scratch(use_wgmma: bool, num_stages: int, block_k: int, head_dim: int, dtype, *,
                     atoms: bool = False):
  """The K (or V) pipeline stages: one `(copy view, matmul view)` pair per column part.

  One part (`column_parts`): one buffer, both views, `(8, swizzle)`-tiled as wgmma
  reads it. Several parts: each part is a union of two views of one buffer, the
  matmul view tiled and swizzled, the copy view swizzled only. A part's rows are
  exactly one swizzle atom wide, so the two views hold the same bytes; the copy
  view keeps TMA from tiling the cache's row (`head_dim`) axis, which Mosaic GPU
  refuses when the head dim is not a multiple of the part's tile (80 is not of 64).
  The interpreter has no swizzle: one plain buffer per part serves both views.
  Returns the scratch types, one per part; `part_views` turns the allocated refs
  into the pairs.
  """
  parts = column_parts(head_dim, atoms=atoms)
  if not _atom_views(use_wgmma, head_dim, atoms):
    return tuple(plgpu.SMEM((num_stages, block_k, width), dtype,
                            transforms=smem_transforms(use_wgmma, dtype, width))
                 for _, width in parts)
  return tuple(_atom_union((num_stages, block_k, width), dtype) for _, width in parts)


def _atom_views(use_wgmma: bool, head_dim: int, atoms: bool) -> bool:
  """Whether q's and K/V's column parts are swizzle-atom unions (`_atom_union`): on the
  wgmma path, for split head dims (80, 112) or with `atoms`. One rule for both, since
  `part_views` pairs q's and K's parts the same way."""
  return use_wgmma and (atoms or len(column_parts(head_dim)) > 1)


def _atom_union(shape, dtype):
  """Two views of one shared buffer whose rows are one swizzle atom: swizzled only
  (for TMA: no tiling of the global array) and tiled and swizzled (for wgmma and
  register loads). The same bytes: an `(8, row)` tile of such rows is 8 whole rows."""
  swizzle = swizzle_bytes(shape[-1], dtype)
  assert swizzle == shape[-1] * np.dtype(dtype).itemsize, (shape, swizzle)
  return plgpu.RefUnion(
      plgpu.SMEM(shape, dtype, transforms=(plgpu.SwizzleTransform(swizzle),)),
      plgpu.SMEM(shape, dtype, transforms=smem_transforms(True, dtype, shape[-1])))


def part_views(refs, scratch):
  """`(copy view, matmul view)` per column part of the refs allocated for `scratch`
  (`kv_stage_scratch`, `q_scratch`): a union's two views, or one buffer twice."""
  return tuple(tuple(ref) if isinstance(kind, plgpu.RefUnion) else (ref, ref)
               for ref, kind in zip(refs, scratch, strict=True))


def smem_transforms(use_wgmma, dtype, head_dim):
  """Tiling and swizzle of a K/V tile (or column part) `head_dim` columns wide."""
  if not use_wgmma:
    return ()
  swizzle = swizzle_bytes(head_dim, dtype)
  swizzle_elems = swizzle // np.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
