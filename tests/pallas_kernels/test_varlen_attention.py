"""The Mosaic GPU varlen attention kernel against its reference (CONTRACT §10.7, scenario 49)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_checks import _reference
from attention_checks import check_family
from attention_checks import check_family_patched
from attention_checks import attention_calls
from attention_checks import requires_hopper
from drivers import has_hopper_gpu
from kernel_cases import Family
from kernel_cases import queries
from kernel_cases import random_step
from kernel_cases import resident_storage
from oracle import out_rtol
from oracle import tol
import pallas_kernels
from pallas_kernels import _compat
from pallas_kernels import combine_sm90
from pallas_kernels import config as config_lib
from pallas_kernels import varlen_attention_sm90
from pallas_kernels import varlen_kernel_sm90

# Interpreter families: small enough for two CPU cores, 52 random Steps in all.
INTERPRET_FAMILIES = [
    Family("bf16-flat-gqa8x2-d64", jnp.bfloat16, None, 8, 2, 64, width=8, max_seqs=3,
           capacity=40, num_steps=9),
    Family("fp16-ring5-gqa8x2-d128", jnp.float16, 5, 8, 2, 128, width=6, max_seqs=3,
           capacity=48, num_steps=9),
    Family("f32-ring7-mha-d64", jnp.float32, 7, 2, 2, 64, width=5, max_seqs=4, capacity=40,
           num_steps=9),
    Family("bf16-ring3-mha-d128-f32q", jnp.bfloat16, 3, 2, 2, 128, width=4, max_seqs=3,
           capacity=30, num_steps=9, q_dtype=jnp.float32),
    Family("f32-flat-gqa8x2-d128", jnp.float32, None, 8, 2, 128, width=6, max_seqs=3,
           capacity=24, num_steps=8),
    Family("fp16-flat-mha-d64", jnp.float16, None, 2, 2, 64, width=8, max_seqs=4, capacity=32,
           num_steps=8),
]

# Row counts that are not a multiple of 8 or smaller than a K/V tile (a ring's
# `window + W - 1` rarely is a multiple of 8): flat and ring, before, at and after
# wrap (kernel_cases draws such histories), with fewer segment-table rows than
# cache columns (the kernel stages only the named columns) and with more.
# Families whose queries may see only a few keys store fp16, not bf16: their
# outputs reach |2|, where bf16 rounding of the output or of the probabilities
# (P @ V runs in the storage dtype) alone can exceed the 1e-2 tolerance.
UNALIGNED_INTERPRET_FAMILIES = [
    Family("fp16-flat-rows5-gqa4x1-d64-f32q", jnp.float16, None, 4, 1, 64, width=4,
           max_seqs=3, capacity=5, num_steps=4, q_dtype=jnp.float32),
    Family("fp16-ring4-rows6-mha-d64", jnp.float16, 4, 2, 2, 64, width=3, max_seqs=4,
           capacity=40, num_steps=4),
    Family("fp16-ring8-rows11-gqa2x1-d128", jnp.float16, 8, 2, 1, 128, width=4,
           max_seqs=2, capacity=40, num_steps=4),
    Family("f32-flat-rows13-mha-d64", jnp.float32, None, 1, 1, 64, width=3, max_seqs=4,
           capacity=13, num_steps=4),
    Family("bf16-ring34-rows37-gqa2x1-d64", jnp.bfloat16, 34, 2, 1, 64, width=4, max_seqs=3,
           capacity=90, num_steps=3),
]
# A Gemma-like ring (window 572, W 4: 575 rows) and a 130-row flat cache with
# interpreter K/V tiles of 64 rows.
LARGE_UNALIGNED_INTERPRET_FAMILIES = [
    Family("bf16-ring572-rows575-mha-d64", jnp.bfloat16, 572, 1, 1, 64, width=4, max_seqs=2,
           capacity=700, num_steps=2),
    Family("fp16-flat-rows130-gqa2x1-d64", jnp.float16, None, 2, 1, 64, width=4, max_seqs=2,
           capacity=130, num_steps=2),
]
INTERPRET_BLOCK64_CONFIG = config_lib.VarlenAttentionConfig(
    block_q=8, block_k=64, num_stages=2, split_len=128, split_budget=4, max_splits=4,
    max_programs=4, use_wgmma=False)

# Compiled families: rows a multiple of 8 and >= 64, head dims of 64 or 128; the
# widths make multi-q-tile prefills and the small split length forces splits.
GPU_FAMILIES = [
    Family("bf16-flat-gqa8x2-d128", jnp.bfloat16, None, 8, 2, 128, width=40, max_seqs=5,
           capacity=512, num_steps=9),
    Family("fp16-ring113-gqa8x2-d64", jnp.float16, 113, 8, 2, 64, width=16, max_seqs=4,
           capacity=600, num_steps=9),
    Family("bf16-ring57-mha-d128-f32q", jnp.bfloat16, 57, 4, 4, 128, width=8, max_seqs=4,
           capacity=300, num_steps=9, q_dtype=jnp.float32),
    Family("fp16-flat-mha-d64", jnp.float16, None, 2, 2, 64, width=32, max_seqs=4,
           capacity=256, num_steps=9),
    Family("bf16-ring93-gqa8x2-d64-padded", jnp.bfloat16, 93, 8, 2, 64, width=36, max_seqs=3,
           capacity=400, num_steps=9),
]
# Compiled families whose rows are not a multiple of 8 or are fewer than a K/V
# tile (padded per `tile_geometry`): 575 is Gemma-style window 512 with W 64.
UNALIGNED_GPU_FAMILIES = [
    Family("bf16-ring512-rows575-gqa8x2-d64", jnp.bfloat16, 512, 8, 2, 64, width=64,
           max_seqs=4, capacity=1200, num_steps=6),
    Family("fp16-flat-rows37-gqa4x1-d128", jnp.float16, None, 4, 1, 128, width=8, max_seqs=3,
           capacity=37, num_steps=6),
    Family("fp16-ring8-rows11-mha-d128-f32q", jnp.float16, 8, 2, 2, 128, width=4,
           max_seqs=5, capacity=60, num_steps=6, q_dtype=jnp.float32),
    Family("fp16-ring3-rows6-gqa8x2-d64", jnp.float16, 3, 8, 2, 64, width=4,
           max_seqs=3, capacity=40, num_steps=6),
    Family("fp16-flat-rows5-mha-d64", jnp.float16, None, 2, 2, 64, width=4, max_seqs=3,
           capacity=5, num_steps=6),
    Family("fp16-ring10-rows13-gqa4x2-d128-f32q", jnp.float16, 10, 8, 2, 128, width=4,
           max_seqs=6, capacity=80, num_steps=6, q_dtype=jnp.float32),
    Family("fp16-flat-rows130-gqa8x2-d128", jnp.float16, None, 8, 2, 128, width=16,
           max_seqs=3, capacity=130, num_steps=6),
    Family("fp16-ring69-rows72-mha-d64", jnp.float16, 69, 2, 2, 64, width=4, max_seqs=3,
           capacity=200, num_steps=6),
    # Read in place (`reads_in_place`: unaligned, at least one tile) at head dims 128,
    # 256 and 80: K/V in one-atom column parts of 64 (and 16) columns.
    Family("bf16-ring256-rows319-gqa4x2-d128", jnp.bfloat16, 256, 8, 2, 128, width=64,
           max_seqs=3, capacity=900, num_steps=6),
    Family("fp16-ring190-rows201-gqa2x1-d256", jnp.float16, 190, 2, 1, 256, width=12,
           max_seqs=3, capacity=500, num_steps=6),
    Family("bf16-ring100-rows115-gqa4x1-d80", jnp.bfloat16, 100, 4, 1, 80, width=16,
           max_seqs=3, capacity=400, num_steps=6),
    Family("bf16-ring37-rows40-gqa8x2-d128", jnp.bfloat16, 37, 8, 2, 128, width=4,
           max_seqs=3, capacity=120, num_steps=6),
]
# block_k differs from head_dim, as in the defaults (square tiles: their own test below).
SPLIT_CONFIGS = {
    64: config_lib.VarlenAttentionConfig(block_k=128, split_len=128, split_budget=16,
                                         max_splits=4),
    128: config_lib.VarlenAttentionConfig(block_k=64, split_len=64, split_budget=16,
                                          max_splits=4),
    # Head dims 80 and 256 (the unaligned families read in place); two stages keep 256
    # within shared memory.
    80: config_lib.VarlenAttentionConfig(block_k=64, split_len=64, split_budget=16,
                                         max_splits=4),
    256: config_lib.VarlenAttentionConfig(block_k=64, num_stages=2, split_len=64,
                                          split_budget=16, max_splits=4),
}
INTERPRET_SPLIT_CONFIG = config_lib.VarlenAttentionConfig(
    block_q=8, block_k=8, num_stages=3, split_len=8, split_budget=2, max_splits=3,
    max_split_tokens=3,
    sort_items=False, use_wgmma=False)

@pytest.mark.parametrize("family", INTERPRET_FAMILIES, ids=str)
def test_interpreted_kernel_matches_reference(family, rng):
  check_family(family, rng, config=None, interpret=True)


@pytest.mark.parametrize("family", INTERPRET_FAMILIES[:2], ids=str)
def test_interpreted_kernel_with_splits_matches_reference(family, rng):
  check_family(family, rng, config=INTERPRET_SPLIT_CONFIG, interpret=True)


@pytest.mark.parametrize("family", [INTERPRET_FAMILIES[0], INTERPRET_FAMILIES[1],
                                    INTERPRET_FAMILIES[2]], ids=str)
def test_one_and_three_tile_loops_give_the_same_outputs_bitwise(family, rng):
  """`full_tile_loop`: the tile loop split around the tiles that need no mask (True) or
  one loop choosing per tile (False), either at any head dim (the default, None, picks by
  head dim): the same tiles and arithmetic, so the outputs are bitwise equal and match
  the reference; flat and ring, padded steps, owner blocks, key splits."""
  settings = [(dataclasses.replace(INTERPRET_SPLIT_CONFIG, full_tile_loop=loops), ())
              for loops in (True, False)]
  _check_settings_agree(_agreement(family), rng, settings, interpret=True)


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", GPU_FAMILIES, ids=str)
def test_compiled_kernel_matches_reference(family, splits, rng):
  config = SPLIT_CONFIGS[family.head_dim] if splits else None
  check_family(family, rng, config=config, interpret=False)


@pytest.mark.parametrize("family", UNALIGNED_INTERPRET_FAMILIES, ids=str)
def test_interpreted_kernel_serves_unaligned_and_tiny_row_counts(family, rng):
  check_family(family, rng, config=None, interpret=True)


@pytest.mark.parametrize("family", LARGE_UNALIGNED_INTERPRET_FAMILIES, ids=str)
def test_interpreted_kernel_serves_large_unaligned_row_counts(family, rng):
  check_family(family, rng, config=INTERPRET_BLOCK64_CONFIG, interpret=True)


# Two column parts (D128) and a large unaligned cache; one part (D64) is the kernel's default path.
@pytest.mark.parametrize("family", [INTERPRET_FAMILIES[1], LARGE_UNALIGNED_INTERPRET_FAMILIES[0]],
                         ids=str)
def test_interpreted_kernel_matches_reference_in_one_atom_column_parts(family, rng):
  """The column-part index math that caches read in place use (K/V and q in parts of 64
  columns: one at head dim 64, two at 128), run by the interpreter: flat and ring, splits."""
  config = (INTERPRET_BLOCK64_CONFIG if family in LARGE_UNALIGNED_INTERPRET_FAMILIES
            else INTERPRET_SPLIT_CONFIG)
  check_family_patched(varlen_attention_sm90, "run_items", _in_atom_parts(), family, rng,
                       config=config, interpret=True)


def _in_atom_parts():
  """`run_items` with `atom_parts` forced on: the interpreter (which pads every unaligned
  cache, so the compiled path's reason for the parts never arises there) runs their
  index math on every call."""
  run_items = varlen_attention_sm90.run_items

  def run(*args, **kwargs):
    return run_items(*args, **dict(kwargs, atom_parts=True))
  return run


@pytest.mark.parametrize("rows, head_dim, block_k, want", [
    (575, 128, 64, True), (575, 64, 128, True), (319, 256, 64, True), (115, 80, 64, True),
    (576, 128, 64, False),   # aligned: nothing to pad
    (37, 128, 64, False), (100, 64, 128, False), (5, 64, 128, False)])   # under one tile
def test_which_unaligned_caches_are_read_in_place(rows, head_dim, block_k, want):
  config = config_lib.VarlenAttentionConfig(block_k=block_k)
  assert varlen_attention_sm90.reads_in_place(rows, head_dim, config=config) == want
  assert not varlen_attention_sm90.reads_in_place(
      rows, head_dim, config=dataclasses.replace(config, use_wgmma=False))


@pytest.mark.parametrize("rows, head_dim, tokens", [(575, 128, 8), (575, 64, 64),
                                                    (201, 256, 4), (115, 80, 16)])
def test_unaligned_cache_reaches_the_kernel_without_a_copy(rows, head_dim, tokens):
  """Lowered for CUDA: a cache of unaligned rows (at least one tile) reaches the kernel as
  is, with no pad or gather of K/V; with `reads_in_place` forced off the padded copy
  (zero rows appended) is found, so the check can fail."""
  shapes = _shapes(tokens, 8, rows, 2, head_dim, jnp.bfloat16)
  padded = -(-rows // 8) * 8

  def lowered_text():
    jax.clear_caches()
    attend = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=rows - tokens + 1,
                                       scale=0.1))
    return attend.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

  def kv_copies(text):
    return [line for line in text.splitlines()
            if re.search(rf"tensor<{padded}x\d+x2x{head_dim}x", line)]
  try:
    text = lowered_text()
    assert re.findall(r"custom_call @(\w+)", text) == attention_calls(4, head_dim)
    assert kv_copies(text) == []
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(varlen_attention_sm90, "reads_in_place", lambda *args, **kwargs: False)
      assert kv_copies(lowered_text())
  finally:
    jax.clear_caches()


def _lowered_calls(head_dim, *, config, window=None):
  """The custom calls of one compiled-path call (32 tokens, 4/2 heads, 512 x 5 cache
  columns), lowered for CUDA on any machine; the config must be one the kernel takes."""
  shapes = (jax.ShapeDtypeStruct((32, 8, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((512, 5, 2, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((512, 5, 2, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((32, 5), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
  assert varlen_attention_sm90.check_request(shapes[0], shapes[1], config=config) == config
  attend = jax.jit(functools.partial(varlen_attention_sm90._varlen_attention,  # pylint: disable=protected-access
                                     window=window, scale=0.1, config=config, interpret=None))
  text = attend.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  return re.findall(r"custom_call @(\w+)", text)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_square_tiles_lower_with_q_reloaded_per_tile(head_dim):
  """`block_k == head_dim` is served (no refusal) and lowers for CUDA as one call."""
  config = config_lib.VarlenAttentionConfig(block_k=head_dim)
  assert _lowered_calls(head_dim, config=config) == attention_calls(4, head_dim)


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", GPU_FAMILIES, ids=str)
def test_compiled_kernel_serves_square_tiles(family, splits, rng):
  """`block_k == head_dim`: q is reloaded per tile (held in registers across the tile
  loop it is corrupted from the second tile on), so square tiles compute right."""
  base = SPLIT_CONFIGS[family.head_dim] if splits else config_lib.default_varlen_attention_config(
      group=family.num_q_heads // family.num_kv_heads, head_dim=family.head_dim,
      interpret=False)
  config = dataclasses.replace(base, block_k=family.head_dim)
  check_family(family, rng, config=config, interpret=False)


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", UNALIGNED_GPU_FAMILIES, ids=str)
def test_compiled_kernel_serves_unaligned_and_tiny_row_counts(family, splits, rng):
  config = SPLIT_CONFIGS[family.head_dim] if splits else None
  check_family(family, rng, config=config, interpret=False)


@requires_hopper
def test_compiled_kernel_shrinks_block_k_for_a_small_aligned_cache(rng):
  # 200 rows: block_k 256 does not fit, 128 is square, so 64-row tiles (no padding).
  family = Family("fp16-flat-rows200-gqa8x2-d128", jnp.float16, None, 8, 2, 128, width=16,
                  max_seqs=3, capacity=200, num_steps=6)
  config = config_lib.VarlenAttentionConfig(block_k=256)
  assert varlen_attention_sm90.tile_geometry(200, 128, config=config) == (64, 200)
  check_family(family, rng, config=config, interpret=False)


def test_compiled_kernel_refuses_float32_storage(rng):   # the refusal needs no GPU
  family = INTERPRET_FAMILIES[2]
  step = random_step(rng, family, pad=True, allow_blocks=True)
  k, v = resident_storage(rng, family, step)
  with pytest.raises(NotImplementedError, match="float32 K/V storage"):
    pallas_kernels.varlen_attention(queries(rng, family, step), k, v,
                                    jnp.asarray(step.seq_info), jnp.int32(step.n_segments),
                                    window=family.window, scale=0.125)


def _shapes(num_tokens, num_q_heads, num_rows, num_kv_heads, head_dim, dtype):
  return (jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
          jax.ShapeDtypeStruct((num_rows, 5, num_kv_heads, head_dim), dtype),
          jax.ShapeDtypeStruct((num_rows, 5, num_kv_heads, head_dim), dtype),
          jax.ShapeDtypeStruct((num_tokens, 5), jnp.int32),
          jax.ShapeDtypeStruct((), jnp.int32))


@pytest.mark.parametrize("window", [None, 61], ids=["flat", "ring61"])
def test_production_kernel_lowers_to_one_mosaic_gpu_call(window):
  attend = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=window,
                                     scale=0.1, config=config_lib.VarlenAttentionConfig()))
  lowered = attend.trace(*_shapes(16, 8, 128, 2, 128, jnp.bfloat16)).lower(
      lowering_platforms=("cuda",))
  calls = re.findall(r"custom_call @(\w+)", lowered.as_text())
  assert calls == attention_calls(4, 128)


# (rows, head_dim, window, tokens): unaligned and tiny row counts, flat and ring,
# with fewer tokens than cache columns (staged columns) and more (whole layer).
UNALIGNED_LOWERING_CASES = [
    (1, 128, None, 4), (5, 64, None, 8), (6, 128, 3, 4), (11, 64, 8, 8), (13, 128, 10, 4),
    (37, 128, None, 16), (60, 64, 57, 4), (72, 64, 69, 8), (130, 128, None, 4),
    (575, 64, 512, 64), (575, 128, 512, 8),
]


@pytest.mark.parametrize("rows, head_dim, window, tokens", UNALIGNED_LOWERING_CASES,
                         ids=lambda x: str(x))
@pytest.mark.parametrize("block_k", [None, 256], ids=["default", "block_k256"])
def test_production_kernel_lowers_for_unaligned_and_tiny_row_counts(rows, head_dim, window,
                                                                   tokens, block_k):
  # Mosaic GPU checks the TMA shapes while lowering, so this proves it accepts them.
  # One stage: three 256 x 128 K/V stages would not fit in shared memory.
  config = None if block_k is None else config_lib.VarlenAttentionConfig(block_k=block_k,
                                                                          num_stages=1)
  attend = jax.jit(functools.partial(pallas_kernels.varlen_attention, window=window,
                                     scale=0.1, config=config))
  lowered = attend.trace(*_shapes(tokens, 8, rows, 2, head_dim, jnp.bfloat16)).lower(
      lowering_platforms=("cuda",))
  assert re.findall(r"custom_call @(\w+)", lowered.as_text()) == attention_calls(4, head_dim,
                                                                                 config)


@pytest.mark.parametrize("rows, head_dim, block_k, use_wgmma, want", [
    (128, 128, 64, True, (64, 128)),     # aligned: unchanged
    (575, 128, 64, True, (64, 576)),     # Gemma-like ring: next multiple of 8
    (575, 64, 128, True, (128, 576)),
    (5, 128, 64, True, (64, 64)),        # fewer rows than any tile: one tile
    (100, 64, 128, True, (128, 128)),    # 64 would be square
    (200, 128, 256, True, (64, 200)),    # largest smaller tile, 128 being square
    (200, 64, 256, True, (128, 200)),
    (5, 64, 8, False, (8, 8)),           # interpreter variant, same rules
    (11, 64, 8, False, (8, 16)),
    (20, 64, 64, False, (24, 24)),
])
def test_tile_geometry(rows, head_dim, block_k, use_wgmma, want):
  config = config_lib.VarlenAttentionConfig(block_q=64, block_k=block_k, use_wgmma=use_wgmma)
  block, padded = varlen_attention_sm90.tile_geometry(rows, head_dim, config=config)
  assert (block, padded) == want
  assert padded % varlen_attention_sm90.ROW_ALIGN == 0 and block <= padded and padded >= rows


@pytest.mark.parametrize("shapes, config, match", [
    ((8, 8, 64, 2, 128, jnp.float32), None, "float32 K/V storage is not served.*bfloat16 "
     "or float16.*implementation='reference'"),
    ((8, 8, 64, 2, 8, jnp.bfloat16), None, "multiple of 16 and at most 256 for wgmma"),
    ((8, 8, 64, 2, 40, jnp.float16), None, "multiple of 16 and at most 256 for wgmma"),
    ((8, 8, 64, 2, 320, jnp.bfloat16), None, "multiple of 16 and at most 256 for wgmma"),
    ((8, 130, 64, 2, 64, jnp.bfloat16), None, "GQA group 65 must be at most"),
    ((8, 8, 64, 2, 64, jnp.int8), None, "kv dtype int8"),
    # 256 rows: a smaller cache would get a shrunk K/V tile (`tile_geometry`) that fits.
    ((8, 8, 256, 2, 256, jnp.bfloat16), config_lib.VarlenAttentionConfig(block_k=128),
     "shared memory"),
], ids=["f32", "d8", "d40", "d320", "group65", "int8", "smem"])
def test_production_kernel_refuses_what_it_cannot_serve(shapes, config, match):
  q, k, _, _, _ = _shapes(*shapes)
  with pytest.raises(NotImplementedError, match=match):
    varlen_attention_sm90.static_check(q, k, config=config or
                                       config_lib.VarlenAttentionConfig())


@pytest.mark.parametrize("rows", [1, 5, 60, 575])
def test_production_kernel_accepts_every_row_count(rows):
  config = config_lib.VarlenAttentionConfig()
  q, k, _, _, _ = _shapes(8, 8, rows, 2, 128, jnp.bfloat16)
  assert varlen_attention_sm90.static_check(q, k, config=config) is None
  # The check is live at every row count: a head dim wgmma cannot take is refused.
  q40, k40, _, _, _ = _shapes(8, 8, rows, 2, 40, jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim=40"):
    varlen_attention_sm90.static_check(q40, k40, config=config)
  # The geometry it accepted holds the rows in 8-row multiples and in whole tiles.
  block_k, padded = varlen_attention_sm90.tile_geometry(rows, 128, config=config)
  assert padded >= rows and padded % 8 == 0 and padded >= block_k > 0


def _check_trimmed_tables(family, rng, *, config, interpret, num_steps):
  """A segment table cut to fewer rows (`n_segments` up to the step's width) gives the
  same outputs, bitwise, as the step's full `[T, 5]` table: kernel and reference.

  The rows cut are padding, so only the kernel's plan shrinks (its item table is
  sized by `min(T, rows)`); NaN queries on padding tokens make any read of a
  wrongly planned item visible in the real rows.
  """
  scale = 1.0 / np.sqrt(family.head_dim)
  for index in range(num_steps):
    step = random_step(rng, family, pad=index % 2 == 0, allow_blocks=index % 3 == 0)
    k, v = resident_storage(rng, family, step)
    q = queries(rng, family, step)
    full = jnp.asarray(step.seq_info)
    n = jnp.int32(step.n_segments)
    kwargs = dict(window=family.window, scale=scale)
    want = pallas_kernels.varlen_attention(q, k, v, full, n, **kwargs, config=config,
                                           interpret=interpret)
    want_ref = pallas_kernels.varlen_attention_reference(q, k, v, full, n, **kwargs)
    for rows in sorted({max(1, step.n_segments), int(rng.integers(max(1, step.n_segments),
                                                                  family.width + 1))}):
      table = full[:rows]
      got = pallas_kernels.varlen_attention(q, k, v, table, n, **kwargs, config=config,
                                            interpret=interpret)
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                    err_msg=f"{step.description}, {rows} rows")
      got_ref = pallas_kernels.varlen_attention_reference(q, k, v, table, n, **kwargs)
      np.testing.assert_array_equal(np.asarray(got_ref, np.float32),
                                    np.asarray(want_ref, np.float32),
                                    err_msg=f"reference, {step.description}, {rows} rows")


# The ring GQA D128 family: the flat D64 one adds tracing time, not a path (CI time).
@pytest.mark.parametrize("family", [INTERPRET_FAMILIES[1]], ids=str)
def test_interpreted_kernel_serves_tables_with_fewer_rows(family, rng):
  _check_trimmed_tables(family, rng, config=INTERPRET_SPLIT_CONFIG, interpret=True, num_steps=4)


@requires_hopper
@pytest.mark.parametrize("family", GPU_FAMILIES[:2], ids=str)
def test_compiled_kernel_serves_tables_with_fewer_rows(family, rng):
  _check_trimmed_tables(family, rng, config=SPLIT_CONFIGS[family.head_dim], interpret=False,
                        num_steps=6)


def test_item_table_follows_the_segment_rows():
  from pallas_kernels import varlen_plan   # pylint: disable=g-import-not-at-top
  config = config_lib.VarlenAttentionConfig()
  full = varlen_plan.item_capacity(16384, group=4, tile_rows=64, config=config)
  assert full == 1024 + 16384 + config.split_budget
  assert varlen_plan.item_capacity(16384, group=4, tile_rows=64, config=config,
                                   num_segments=1) == 1024 + 1 + config.split_budget
  # More rows than tokens bound nothing further.
  assert varlen_plan.item_capacity(8, group=4, tile_rows=64, config=config,
                                   num_segments=100) == 1 + 8 + config.split_budget


@pytest.mark.parametrize("shape", [(0, 5), (4, 4), (4,), (2, 5, 1)])
def test_validation_names_a_bad_segment_table(shape):
  q, k, v, _, _ = _shapes(4, 4, 16, 1, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"seq_info must be \[S, 5\] with S >= 1 rows"):
    pallas_kernels.varlen_attention_reference(
        jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
        jnp.zeros(shape, jnp.int32), jnp.int32(0), window=None, scale=0.125)


def test_validation_accepts_numpy_float_scales():
  family = UNALIGNED_INTERPRET_FAMILIES[0]
  q, k, v, seq_info, n_segments = _shapes(4, 4, 5, 1, 64, family.dtype)
  for scale in (np.float32(0.125), np.float64(0.125), 0.125, 1):
    pallas_kernels.varlen_attention_reference(
        jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
        jnp.zeros(seq_info.shape, jnp.int32), jnp.int32(0), window=None, scale=scale)
  with pytest.raises(ValueError, match="must be a Python or NumPy float"):
    pallas_kernels.varlen_attention_reference(
        jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
        jnp.zeros(seq_info.shape, jnp.int32), jnp.int32(0), window=None, scale="0.125")


def test_interpreter_refuses_wgmma():
  family = INTERPRET_FAMILIES[0]
  q, k, v, _, _ = _shapes(8, 8, 64, 2, 64, family.dtype)
  args = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype),
          jnp.zeros((8, 5), jnp.int32), jnp.int32(0))
  with pytest.raises(NotImplementedError, match="interpreter cannot run wgmma"):
    pallas_kernels.varlen_attention(*args, window=None, scale=0.1,
                                    config=config_lib.VarlenAttentionConfig(), interpret=True)
  _compat.reset_interpreter()


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_q=32), "block_q=32 must be a multiple of 64"),
    (dict(block_k=96), "block_k=96 must be a multiple of 64"),
    (dict(num_stages=0), "num_stages=0 must be an int >= 1"),
    (dict(split_budget=-1), "split_budget=-1 must be an int >= 0"),
    (dict(full_tile_loop=1), "full_tile_loop=1 must be a bool or None"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=re.escape(match)):
    config_lib.VarlenAttentionConfig(**kwargs)


def test_configs_are_hashable_static_arguments():
  a = config_lib.VarlenAttentionConfig(block_k=128)
  assert a == config_lib.VarlenAttentionConfig(block_k=128) and hash(a) == hash(
      config_lib.VarlenAttentionConfig(block_k=128))
  assert config_lib.default_varlen_attention_config(group=4, head_dim=128,
                                                    interpret=False).use_wgmma
  assert not config_lib.default_varlen_attention_config(group=4, head_dim=128,
                                                        interpret=True).use_wgmma


def _outputs_per_setting(family, rng, settings, *, interpret):
  """`[(step, args, outputs)]` for `family.num_steps` random Steps (padded or not, with or
  without owner blocks), `outputs` one per entry of `settings`: `(config, hooks)`, the
  call's config (None: the default) and the test hooks `(module, name, replacement)`
  patched in while it is traced; `args` are the call's positional arguments. Each setting
  traces afresh (caches cleared), once for all the Steps (they share their shapes)."""
  scale = 1.0 / np.sqrt(family.head_dim)
  cases = []
  for index in range(family.num_steps):
    step = random_step(rng, family, pad=index % 3 != 0, allow_blocks=index % 2 == 0)
    k, v = resident_storage(rng, family, step)
    cases.append((step, (queries(rng, family, step), k, v, jnp.asarray(step.seq_info),
                         jnp.int32(step.n_segments))))
  outs = []
  for config, hooks in settings:
    with pytest.MonkeyPatch.context() as patch:
      for module, name, replacement in hooks:
        patch.setattr(module, name, replacement)
      jax.clear_caches()   # the hooks are read when a call is traced
      outs.append([np.asarray(pallas_kernels.varlen_attention(
          *args, window=family.window, scale=scale, config=config, interpret=interpret),
          np.float32) for _, args in cases])
  jax.clear_caches()
  return [(step, args, tuple(out[i] for out in outs)) for i, (step, args) in enumerate(cases)]


# The bitwise-agreement tests compare settings with each other (the reference checks above
# cover accuracy): five random Steps per family still reach ring wraps, padded steps,
# owner blocks and key splits, at about half the interpreter time of a family's nine.
AGREEMENT_STEPS = 5


def _agreement(family):
  return dataclasses.replace(family, num_steps=min(family.num_steps, AGREEMENT_STEPS))


def _check_settings_agree(family, rng, settings, *, interpret):
  """Every setting (`_outputs_per_setting`) gives the first's outputs bitwise, and the
  first's match the reference within the storage tolerance plus one unit of the output's
  precision."""
  scale = 1.0 / np.sqrt(family.head_dim)
  for step, args, (first, *others) in _outputs_per_setting(family, rng, settings,
                                                           interpret=interpret):
    for other in others:
      np.testing.assert_array_equal(other, first, err_msg=step.description)
    expected = np.asarray(_reference(*args, window=family.window, scale=scale), np.float32)
    real = slice(0, step.n_tokens)
    np.testing.assert_allclose(first[real], expected[real], atol=tol(family.dtype),
                               rtol=out_rtol(args[0].dtype), err_msg=step.description)


def _compiled_config(family, splits, **changes):
  """The split config (`splits`) or the default one, with `changes`; None: the default."""
  config = SPLIT_CONFIGS[family.head_dim] if splits else None
  if changes:
    config = dataclasses.replace(
        config or config_lib.default_varlen_attention_config(
            group=family.num_q_heads // family.num_kv_heads, head_dim=family.head_dim,
            interpret=False), **changes)
  return config


def _half_row_staging(**kwargs):
  """`item_prefetch_cols` forced to half the row: the output stored in two chunks."""
  return kwargs["head_dim"] // 2


def _one_item_at_a_time(**kwargs):
  """`item_prefetch_cols` forced to None: one item at a time, the K/V stages and the
  output staging sharing shared memory (the layout one-program-per-SM configs use)."""
  del kwargs
  return None


def _through_partials(*args, **kwargs):
  """`tokens_in_place` forced off: every token through a float32 partial and the
  epilogue's gather (the path narrow calls take)."""
  del args, kwargs
  return False


# Test hooks `(module, name, replacement)` for `_outputs_per_setting`.
HALF_ROWS = (varlen_kernel_sm90, "item_prefetch_cols", _half_row_staging)
ONE_AT_A_TIME = (varlen_kernel_sm90, "item_prefetch_cols", _one_item_at_a_time)
THROUGH_PARTIALS = (varlen_attention_sm90, "tokens_in_place", _through_partials)


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", GPU_FAMILIES[:2], ids=str)
def test_compiled_tile_loops_agree_bitwise_and_match_reference(family, splits, rng):
  """Compiled: one tile loop and three (`full_tile_loop`) give the same outputs bitwise, and
  both match the reference (flat GQA D128 and a D64 ring)."""
  _check_settings_agree(family, rng, [(_compiled_config(family, splits, full_tile_loop=loops), ())
                                      for loops in (True, False)], interpret=False)


# Ring GQA D128 and ring MHA D64 (float32): both staging layouts, both head layouts.
@pytest.mark.parametrize("family", INTERPRET_FAMILIES[1:3], ids=str)
def test_items_back_to_back_give_the_same_outputs_bitwise(family, rng):
  """Items back to back (`item_prefetch_cols`, where two programs share an SM) request an
  item's first tiles before the previous item's store, from buffers the program keeps for
  all of its items; the tiles, their order and the arithmetic are those of one item at a
  time, so the outputs are bitwise equal, with the output staged whole or in two column
  chunks. One program per KV head, so every program runs many items back to back (flat
  and ring, padded steps, owner blocks, key splits); the interpreter checks the index
  math and barrier order."""
  config = dataclasses.replace(INTERPRET_SPLIT_CONFIG, max_programs=family.num_kv_heads)
  _check_settings_agree(_agreement(family), rng, [(config, (ONE_AT_A_TIME,)), (config, ()),
                                                  (config, (HALF_ROWS,))], interpret=True)


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", GPU_FAMILIES[:2], ids=str)
def test_compiled_items_back_to_back_agree_bitwise_and_match_reference(family, splits, rng):
  """Compiled: items back to back (D128's staging in 64-column halves, D64's whole) give
  the outputs of one item at a time bitwise, and both match the reference."""
  config = _compiled_config(family, splits)
  _check_settings_agree(family, rng, [(config, ()), (config, (ONE_AT_A_TIME,))],
                        interpret=False)


# Every token of a step may split only up to `max_split_tokens` tokens: with 3 (the
# interpreter split config) or 4, a step of more tokens writes its unsplit tokens in
# place and merges the split ones (`varlen_attention_sm90.tokens_in_place`).
# Ring GQA D128 (one copy per token) and ring MHA D64 (runs of tokens), the two store paths.
@pytest.mark.parametrize("family", INTERPRET_FAMILIES[1:3], ids=str)
def test_tokens_in_place_give_the_partials_outputs_bitwise(family, rng):
  """Tokens in place (`tokens_in_place`, wide calls): the kernel writes each unsplit
  token's rows into the output in its dtype (one copy per token, runs of tokens
  multi-head), and the epilogue zeros the padding tokens' rows, where narrow calls send
  every token through a float32 partial and the epilogue's gather; split tokens are
  merged either way. The arithmetic is the same, so the outputs are bitwise equal,
  padding rows included (the interpreter fills fresh memory with NaN, so a padding or
  real row left unwritten shows), for one item at a time and back to back (with the
  float32 staging whole or in halves: a 16-bit output then stages whole rows in the
  halves' bytes, a float32 one halves), flat and ring, owner blocks, key splits."""
  config = dataclasses.replace(INTERPRET_SPLIT_CONFIG, max_programs=2 * family.num_kv_heads)
  settings = [(config, (THROUGH_PARTIALS,)), (config, ()), (config, (ONE_AT_A_TIME,)),
              (config, (HALF_ROWS,))]
  for step, _, (partials, *in_place) in _outputs_per_setting(_agreement(family), rng, settings,
                                                             interpret=True):
    for out in in_place:
      np.testing.assert_array_equal(out, partials, err_msg=step.description)
    assert not np.any(in_place[0][step.n_tokens:]), step.description


@pytest.mark.parametrize("group, head_dim, dtype, width, chunks, want", [
    (4, 64, jnp.bfloat16, 300, None, True),      # a wide call: unsplit tokens in place
    (4, 64, jnp.bfloat16, 200, None, False),     # may split every token: one merge pass
    (4, 64, jnp.bfloat16, 200, "no splits", False),  # a short cache: the gather is cheaper
    (4, 64, jnp.bfloat16, 300, "fused", False),  # the fused combine kernel keeps partials
    (1, 128, jnp.bfloat16, 300, None, True),     # runs of 2 tokens: 512 bytes
    (1, 80, jnp.bfloat16, 300, None, False),     # 2 x 160 bytes: TMA needs 128-aligned
    (4, 80, jnp.bfloat16, 300, None, True),      # 4 x 160 = 640 bytes a token
    (3, 96, jnp.bfloat16, 300, None, False),     # 3 x 192 = 576 bytes
    (2, 96, jnp.float32, 300, None, True),       # float32 output: 2 x 384 bytes
    (2, 256, jnp.bfloat16, 300, None, False),    # a 256-column staging: not lowered in time
])
def test_which_calls_write_tokens_in_place(group, head_dim, dtype, width, chunks, want):
  """`tokens_in_place`: calls of more tokens than may split, whose epilogue would gather
  every token's partial, and whose token rows TMA can read from the staging
  (128-byte-aligned starts)."""
  config = config_lib.default_varlen_attention_config(group=group, head_dim=head_dim,
                                                      interpret=False)
  if chunks == "no splits":
    config = dataclasses.replace(config, max_splits=1)
  elif chunks == "fused":
    config = dataclasses.replace(config, fused_combine=True)
  decide = functools.partial(varlen_attention_sm90.tokens_in_place, config,
                             num_tokens=width, group=group, head_dim=head_dim,
                             block_k=config.block_k, kv_dtype=jnp.bfloat16, out_dtype=dtype)
  if chunks == "fused" and not combine_sm90.supported(group=group, head_dim=head_dim):
    want = True
  assert decide() == want


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family", GPU_FAMILIES[:4], ids=str)
def test_compiled_tokens_in_place_agree_bitwise_and_match_reference(family, splits, rng):
  """Compiled: unsplit tokens written in place (and padding zeros) give the outputs of
  every token through partials bitwise, and both match the reference; GQA 4 (a TMA per
  token) and multi-head (runs of tokens) at head dims 64 and 128, bf16, fp16 and a
  float32 output, with splits (at most 4 split tokens: the rest in place)."""
  config = _compiled_config(family, splits, max_split_tokens=4)
  _check_settings_agree(family, rng, [(config, ()), (config, (THROUGH_PARTIALS,))],
                        interpret=False)


@pytest.mark.parametrize("head_dim, block_k, num_stages, want", [
    (64, 128, 2, 64), (80, 64, 2, 80), (96, 64, 2, 96), (112, 64, 2, 112),
    (128, 64, 2, 64),                         # whole rows would leave room for one program
    (128, 64, 3, None), (128, 128, 2, None),  # one program per SM either way
    (256, 64, 2, None)])                      # measured slower back to back (one per SM)
def test_which_configs_run_items_back_to_back(head_dim, block_k, num_stages, want):
  """The output staging's width back to back (`item_prefetch_cols`): the widest that keeps
  two programs per SM, by the shared memory each needs; None keeps one item at a time."""
  cols = functools.partial(varlen_kernel_sm90.item_prefetch_cols, block_q=64, block_k=block_k,
                           num_stages=num_stages, head_dim=head_dim, dtype=jnp.bfloat16)
  assert cols() == want
  if want is not None:
    itemsize = 2
    smem = (64 * head_dim * itemsize + num_stages * 2 * block_k * head_dim * itemsize
            + 64 * want * 4 + 64 * 4)
    assert 2 * (smem + varlen_kernel_sm90.PROGRAM_SMEM_OVERHEAD) <= 228 * 1024
