"""The paged Mosaic GPU kernels (CONTRACT §3.1, issue 13 item 3) against the references and
against the column kernels on the same logical contents.

Storage comes from `kernel_cases` (random steps: padded, owner blocks, sequences
spanned twice) laid out by `paged_cases` in scattered pages with NaN in every
page and row nobody holds, and, in half the steps, a fork sharing full pages.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_checks import attention_calls
from attention_checks import requires_hopper
from kernel_cases import Family
from kernel_cases import Step
from kernel_cases import queries
from oracle import tol
from paged_cases import paged_copy
from paged_checks import check_attention
from paged_checks import check_write
from paged_checks import paged_reference
import pallas_kernels
from pallas_kernels import _compat
from pallas_kernels import config as config_lib
from pallas_kernels import paged_sm90

# (family, page size): GQA groups 1, 2 and 4, head dims 64 and 128, bf16; page 16
# holds two interpreter K/V tiles of 8 rows, page 3 gets 3-row tiles.
INTERPRET_CASES = [
    (Family("bf16-g1-d64", jnp.bfloat16, None, 2, 2, 64, width=6, max_seqs=3, capacity=40,
            num_steps=3), 8),
    (Family("bf16-g2-d128", jnp.bfloat16, None, 4, 2, 128, width=5, max_seqs=3, capacity=48,
            num_steps=3), 16),
    (Family("bf16-g4-d64", jnp.bfloat16, None, 4, 1, 64, width=4, max_seqs=3, capacity=30,
            num_steps=3), 3),
    # Head dim 112 in three column parts (64 + 32 + 16, `varlen_kernel_sm90.column_parts`).
    (Family("fp16-g2-d112", jnp.float16, None, 4, 2, 112, width=5, max_seqs=3, capacity=40,
            num_steps=3), 8),
]
INTERPRET_SPLIT_CONFIG = config_lib.VarlenAttentionConfig(
    block_q=8, block_k=8, num_stages=3, split_len=8, split_budget=2, max_splits=3,
    max_split_tokens=3, sort_items=False, use_wgmma=False)

# Compiled: pages of 64 and 128 rows (d64's 128-row default tile needs 128).
GPU_CASES = [
    (Family("bf16-g1-d128", jnp.bfloat16, None, 4, 4, 128, width=16, max_seqs=4,
            capacity=512, num_steps=6), 64),
    (Family("bf16-g2-d64", jnp.bfloat16, None, 4, 2, 64, width=40, max_seqs=5, capacity=768,
            num_steps=6), 128),
    (Family("bf16-g4-d128", jnp.bfloat16, None, 8, 2, 128, width=32, max_seqs=4,
            capacity=1024, num_steps=6), 128),
    # Head dim 256 (q in 128-column parts) in float16.
    (Family("fp16-g2-d256", jnp.float16, None, 4, 2, 256, width=16, max_seqs=4,
            capacity=512, num_steps=6), 64),
    # Head dims 80 and 96 in column parts (64 + 16, 64 + 32).
    (Family("bf16-g1-d80", jnp.bfloat16, None, 4, 4, 80, width=16, max_seqs=4,
            capacity=512, num_steps=6), 64),
    (Family("fp16-g4-d96", jnp.float16, None, 8, 2, 96, width=32, max_seqs=4,
            capacity=1024, num_steps=6), 128),
]
GPU_SPLIT_CONFIG = config_lib.VarlenAttentionConfig(block_k=64, split_len=64, split_budget=16,
                                                   max_splits=4)


@pytest.mark.parametrize("family, page_size", INTERPRET_CASES, ids=lambda x: str(x))
def test_interpreted_paged_attention_matches_reference_and_columns(family, page_size, rng):
  check_attention(family, page_size, rng, config=None, interpret=True)


def test_interpreted_paged_attention_with_splits(rng):
  family = dataclasses.replace(INTERPRET_CASES[1][0], num_steps=2)
  check_attention(family, 16, rng, config=INTERPRET_SPLIT_CONFIG, interpret=True)


def _fork_step() -> Step:
  """Column 0 decodes at position 20; column 1 prefills 3 tokens at 5; column 2, forked from
  column 0 at 16, decodes at 18. W = 6, one padded token."""
  seq_info = np.array([[0, 1, 0, 20, 0], [1, 3, 1, 5, 0], [4, 1, 2, 18, 0]] + [[5, 0, 3, 0, 0]] * 3,
                      np.int32)
  seq_cols = np.array([0, 1, 1, 1, 2, 3], np.int32)
  positions = np.array([20, 5, 6, 7, 18, 0], np.int32)
  return Step(5, seq_cols, positions, positions, seq_info, 3, "fork")


def test_a_fork_reads_the_shared_pages_and_its_own(rng):
  family = Family("bf16-g2-d64", jnp.bfloat16, None, 4, 2, 64, width=6, max_seqs=3,
                  capacity=32, num_steps=1)
  step = _fork_step()
  k, v = (rng.standard_normal((32, 4, 2, 64)) for _ in range(2))
  for x in (k, v):
    x[21:, 0] = x[8:, 1] = x[19:, 2] = x[:, 3] = np.nan    # rows past each read range
    x[:16, 2] = x[:16, 0]                                   # the fork's prefix is the donor's
  paged = paged_copy(rng, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), step,
                     page_size=8, fork=True)
  table = np.asarray(paged.page_table)
  assert paged.shared_pages == 2 and (table[2, :2] == table[0, :2]).all()
  assert table[2, 2] != table[0, 2]
  q = queries(rng, family, step)
  rest = (paged.v_pool, paged.page_table, jnp.asarray(step.seq_info), jnp.int32(3))
  attend = lambda k_pool: np.asarray(pallas_kernels.paged_varlen_attention(
      q, k_pool, *rest, window=None, scale=0.125, interpret=True), np.float32)[:5]
  out = attend(paged.k_pool)
  assert np.isfinite(out).all()
  want = paged_reference(q, paged.k_pool, *rest, scale=0.125)
  np.testing.assert_allclose(out, np.asarray(want, np.float32)[:5], atol=tol(jnp.bfloat16),
                             rtol=0)
  # Poisoning the fork's own third page changes the fork's output only; poisoning a shared
  # page changes both sharers' (so the kernel really reads it through both tables).
  own = attend(paged.k_pool.at[table[2, 2]].set(jnp.nan))
  assert np.isnan(own[4]).all()
  np.testing.assert_array_equal(own[:4], out[:4])
  shared = attend(paged.k_pool.at[table[0, 1]].set(jnp.nan))
  assert np.isnan(shared[[0, 4]]).all()
  np.testing.assert_array_equal(shared[1:4], out[1:4])


@requires_hopper
@pytest.mark.parametrize("splits", [False, True], ids=["default", "splits"])
@pytest.mark.parametrize("family, page_size", GPU_CASES, ids=lambda x: str(x))
def test_compiled_paged_attention_matches_reference_and_columns(family, page_size, splits,
                                                                rng):
  config = None
  if splits:   # block_k != head_dim: square tiles are refused over pages; head dim 256 fits two stages
    stages = 2 if family.head_dim == 256 else GPU_SPLIT_CONFIG.num_stages
    config = dataclasses.replace(GPU_SPLIT_CONFIG, block_k=128 if family.head_dim == 64 else 64,
                                 num_stages=stages)
  check_attention(family, page_size, rng, config=config, interpret=False)


# --------------------------------------------------------------------------- write


@pytest.mark.parametrize("family, page_size", INTERPRET_CASES[:2], ids=lambda x: str(x))
def test_interpreted_paged_write_matches_references(family, page_size, rng):
  check_write(dataclasses.replace(family, num_steps=2), page_size, rng, interpret=True)


@requires_hopper
@pytest.mark.parametrize("family, page_size", GPU_CASES, ids=lambda x: str(x))
def test_compiled_paged_write_matches_references(family, page_size, rng):
  check_write(family, page_size, rng, interpret=False)


@pytest.mark.parametrize("page_size", [4, 3], ids=["p4-shift", "p3-divide"])
def test_interpreted_paged_write_looks_each_page_up_in_the_kernel(page_size, rng):
  """Tokens of three columns span several pages each (a wide prefill crossing two page
  boundaries, decodes at page starts and ends); padding tokens name real, held rows and
  carry NaN. Checked against a NumPy oracle of the addressing (row `r` of column `c` at
  `pool[table[c, r // P], r % P]`): real rows written bitwise, every other pool row,
  the NaN-poisoned free pages included, unchanged."""
  cols, slots, heads, dim = 3, 4, 2, 16
  num_pages = cols * slots + 3
  table = np.full((cols + 1, slots), num_pages - 1, np.int32)
  table[:cols] = rng.permutation(num_pages - 1)[:cols * slots].reshape(cols, slots)
  held = np.unique(table[:cols])
  pool = rng.standard_normal((2, num_pages, page_size, heads, dim)).astype(np.float32)
  pool[:, np.setdiff1d(np.arange(num_pages), held)] = np.nan   # free pages and scratch
  # Column 0 prefills 2P + 1 rows from row 1; column 2 decodes at the last row of its
  # second page, column 1 at the first row of its third; then 3 padding tokens that name
  # held rows of columns 0 and 1.
  rows0 = list(range(1, 2 * page_size + 2))
  seq_cols = [0] * len(rows0) + [2, 1, 0, 1, cols]
  rows = rows0 + [2 * page_size - 1, 2 * page_size, 0, page_size, 0]
  n_tokens = len(rows0) + 2
  new = rng.standard_normal((2, len(rows), heads, dim)).astype(np.float32)
  new[:, n_tokens:] = np.nan
  args = (jnp.asarray(pool[0]), jnp.asarray(pool[1]), jnp.asarray(new[0]), jnp.asarray(new[1]),
          jnp.asarray(seq_cols, jnp.int32), jnp.asarray(rows, jnp.int32), jnp.int32(n_tokens),
          jnp.asarray(table))
  got = pallas_kernels.paged_kv_write(*args, interpret=True)
  want = pool.copy()
  for t in range(n_tokens):
    page = table[seq_cols[t], rows[t] // page_size]
    want[:, page, rows[t] % page_size] = new[:, t]
  for g, w, r in zip(got, want, pallas_kernels.paged_kv_write_reference(*args)):
    assert np.asarray(g).tobytes() == w.tobytes()
    assert np.asarray(r).tobytes() == w.tobytes()


def test_the_lowered_paged_write_runs_no_xla_op_but_reshapes():
  """The page lookup happens inside the write kernel: lowered for the GPU, the only
  StableHLO ops besides the one Mosaic GPU call are reshapes (the pool views and the
  flattened table) and the stack of K and V into the kernel's `[T, 2, K, D]` operand
  (a broadcast of each and one concatenate); no gather of the table, no index
  arithmetic in XLA."""
  s = _shapes(64, 32, 200, 64, 8, 128)
  write = jax.jit(pallas_kernels.paged_kv_write, donate_argnums=(0, 1))
  text = write.trace(s["pool"], s["pool"], s["new"], s["new"], s["ints"], s["ints"], s["n"],
                     s["table"]).lower(lowering_platforms=("cuda",)).as_text()
  ops = re.findall(r"=\s*\"?(stablehlo\.[\w.]+)", text)
  assert ops.count("stablehlo.custom_call") == 1
  assert ops.count("stablehlo.concatenate") == 1
  assert set(ops) == {"stablehlo.custom_call", "stablehlo.reshape", "stablehlo.broadcast_in_dim",
                      "stablehlo.concatenate"}, ops


# --------------------------------------------------------------------------- shapes, refusals


def _shapes(num_tokens, num_q_heads, num_pages, page_size, num_kv_heads, head_dim,
            dtype=jnp.bfloat16, cols=9, pages_per_col=16):
  pool = jax.ShapeDtypeStruct((num_pages, page_size, num_kv_heads, head_dim), dtype)
  return dict(q=jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype), pool=pool,
              table=jax.ShapeDtypeStruct((cols, pages_per_col), jnp.int32),
              seq_info=jax.ShapeDtypeStruct((num_tokens, 5), jnp.int32),
              n=jax.ShapeDtypeStruct((), jnp.int32),
              new=jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim), dtype),
              ints=jax.ShapeDtypeStruct((num_tokens,), jnp.int32))


def _touching_pool(text, pool_shape):
  """Lowered lines that produce or take a pool- or view-sized tensor, as op names."""
  num_pages, page_size, heads, dim = pool_shape
  sizes = (f"{num_pages}x{page_size}x{heads}x{dim}", f"{num_pages * page_size}x1x{heads}x{dim}")
  ops = []
  for line in text.splitlines():
    if any(size in line for size in sizes):
      match = re.search(r"(func\.func|stablehlo\.\w+|call|return)", line)
      ops.append(match.group(1) if match else line)
  return ops


@pytest.mark.parametrize("head_dim, page_size", [(128, 64), (128, 128), (64, 128), (64, 256),
                                                (80, 64), (112, 128)])
def test_compiled_kernels_lower_with_no_copy_of_the_pool(head_dim, page_size):
  """Lowered for the GPU on any machine (Mosaic GPU checks the TMA shapes while lowering): one
  Mosaic GPU call each, and the pool reaches it through free reshapes only (no gather, copy
  or slice of K/V outside the kernel); the donated write aliases the pools in place."""
  s = _shapes(64, 32, 200, page_size, 8, head_dim)
  attend = jax.jit(functools.partial(pallas_kernels.paged_varlen_attention, window=None,
                                     scale=0.1))
  text = attend.trace(s["q"], s["pool"], s["pool"], s["table"], s["seq_info"], s["n"]).lower(
      lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == attention_calls(4, head_dim)
  assert set(_touching_pool(text, s["pool"].shape)) <= {
      "func.func", "call", "stablehlo.reshape", "stablehlo.custom_call"}
  write = jax.jit(pallas_kernels.paged_kv_write, donate_argnums=(0, 1))
  text = write.trace(s["pool"], s["pool"], s["new"], s["new"], s["ints"], s["ints"], s["n"],
                     s["table"]).lower(lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]
  assert set(_touching_pool(text, s["pool"].shape)) <= {
      "func.func", "call", "stablehlo.reshape", "stablehlo.custom_call", "return"}
  call = next(line for line in text.splitlines() if "custom_call @mosaic_gpu_v2" in line)
  assert "output_operand_aliases" in call
  entry = next(line for line in text.splitlines() if "func.func public @main" in line)
  assert len(re.findall(r"tf\.aliasing_output", entry)) == 2


def test_paged_head_dim_256_kernel_lowers():
  """Head dim 256 over pages: the kernel (q in 128-column parts, as over columns) lowers for
  CUDA with one call (its GPU family above runs it against the reference)."""
  s = _shapes(64, 32, 200, 64, 8, 256)
  config = config_lib.default_varlen_attention_config(group=4, head_dim=256, interpret=False)
  assert paged_sm90.serves(64, config.block_k)
  text = paged_sm90._paged_attention.trace(   # pylint: disable=protected-access
      s["q"], s["pool"], s["pool"], s["table"], s["seq_info"], s["n"], scale=0.1,
      config=config, interpret=None).lower(lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == attention_calls(4, 256)


@pytest.mark.parametrize("head_dim, page_size, interpret, want", [
    (128, 64, False, 64), (128, 128, False, 64), (128, 256, False, 64),
    (64, 128, False, 128), (64, 384, False, 128),
    # Pages smaller than the compiled tile: a tile of whole pages (64 is square for d64).
    (128, 8, False, 64), (128, 16, False, 64), (128, 32, False, 64),
    (64, 16, False, 128), (64, 32, False, 128), (64, 64, False, 128),
    (64, 8, True, 8), (64, 16, True, 8), (64, 12, True, 6), (64, 3, True, 3), (64, 7, True, 7),
])
def test_the_default_tile_serves_the_page(head_dim, page_size, interpret, want):
  s = _shapes(8, 8, 10, page_size, 2, head_dim)
  config = paged_sm90.check_request(s["q"], s["pool"], interpret=interpret)
  assert config.block_k == want
  assert page_size % want == 0 or (want % page_size == 0 and page_size % 8 == 0)


@pytest.mark.parametrize("head_dim, page_size, config, interpret, match", [
    (128, 96, None, False, r"page_size=96 is served by no K/V tile .*head_dim=128 \(\[64\] rows\)"),
    (64, 48, None, False, r"page_size=48 is served by no K/V tile .*head_dim=64 \(\[128\] rows\)"),
    (128, 4, None, False, "page_size=4 is served by no K/V tile"),      # divides, not 8-aligned
    (64, 24, None, False, "page_size=24 is served by no K/V tile"),
    (128, 96, config_lib.VarlenAttentionConfig(block_k=64), False,
     r"page_size=96 must be a multiple of config.block_k=64 .* or a multiple of 8 dividing it"),
    (64, 4, config_lib.VarlenAttentionConfig(block_k=16, use_wgmma=False), True,
     r"page_size=4 must be a multiple of config.block_k=16"),
    (64, 128, config_lib.VarlenAttentionConfig(block_k=128), True,
     "interpreter cannot run wgmma"),
    (192, 64, None, False, r"head_dim=192: .*128-column parts"),
    (128, 128, config_lib.VarlenAttentionConfig(block_k=128), False,
     r"square K/V tiles are served over columns but over pages not yet checked"),
], ids=["p96", "d64-p48", "p4", "d64-p24", "explicit", "explicit-p4", "interpret-wgmma",
        "d192", "square"])
def test_paged_kernels_refuse_what_they_cannot_serve(head_dim, page_size, config, interpret,
                                                     match):
  s = _shapes(8, 8, 10, page_size, 2, head_dim)
  with pytest.raises(NotImplementedError, match=match):
    pallas_kernels.check_paged(s["q"], s["pool"], config=config, interpret=interpret)


def test_paged_attention_validates_its_arguments():
  q = jnp.zeros((4, 4, 64), jnp.bfloat16)
  pool = jnp.zeros((5, 8, 2, 64), jnp.bfloat16)
  seq_info, n = jnp.zeros((4, 5), jnp.int32), jnp.int32(0)
  table = jnp.zeros((3, 4), jnp.int32)
  with pytest.raises(ValueError, match="window=5: paged storage serves flat layers only"):
    pallas_kernels.paged_varlen_attention(q, pool, pool, table, seq_info, n, window=5,
                                          scale=0.1, interpret=True)
  with pytest.raises(ValueError, match="page_table must be int32"):
    pallas_kernels.paged_varlen_attention(q, pool, pool, table.astype(jnp.float32), seq_info,
                                          n, window=None, scale=0.1, interpret=True)
  with pytest.raises(ValueError, match="k_pool and v_pool must share one"):
    pallas_kernels.paged_kv_write(pool, pool[:4], q[:, :2], q[:, :2], seq_info[:, 0],
                                  seq_info[:, 0], n, table, interpret=True)
  _compat.reset_interpreter()


@requires_hopper
def test_compiled_paged_write_and_attention_update_the_pools_in_place():
  """Compiled with the pools donated, a write then attention step has no pool-sized copy and
  aliases every pool byte (the reshapes to the kernels' view are bitcasts)."""
  s = _shapes(64, 32, 200, 64, 8, 128)

  def step(k_pool, v_pool, q, k_new, v_new, seq_cols, rows, n, table, seq_info):
    k_pool, v_pool = pallas_kernels.paged_kv_write(k_pool, v_pool, k_new, v_new, seq_cols, rows,
                                                   n, table)
    out = pallas_kernels.paged_varlen_attention(q, k_pool, v_pool, table, seq_info, n,
                                                window=None, scale=0.1)
    return k_pool, v_pool, out

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      s["pool"], s["pool"], s["q"], s["new"], s["new"], s["ints"], s["ints"], s["n"], s["table"],
      s["seq_info"]).compile()
  sizes = ("[200,64,8,128]", "[12800,1,8,128]")
  copies = [line for line in compiled.as_text().splitlines()
            if re.search(r"\s(copy|copy-start)\(", line) and any(x in line for x in sizes)]
  assert not copies, copies
  pool_bytes = 200 * 64 * 8 * 128 * 2
  assert compiled.memory_analysis().alias_size_in_bytes >= 2 * pool_bytes
