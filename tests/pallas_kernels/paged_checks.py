"""Checks shared by the paged kernel tests: the paged kernels against the paged references
(which share no code with them) and the column kernels on the same logical contents, over
`kernel_cases`' random steps laid out by `paged_cases` (scattered pages, NaN in every page and
row nobody holds)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernel_cases import queries
from kernel_cases import random_step
from kernel_cases import resident_storage
from oracle import tol
from paged_cases import paged_copy
from paged_cases import read_through_table
import pallas_kernels
from pallas_kernels import paged_sm90


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_reference(q, k_pool, v_pool, page_table, seq_info, n_segments, *, scale):
  return pallas_kernels.paged_varlen_attention_reference(
      q, k_pool, v_pool, page_table, seq_info, n_segments, window=None, scale=scale)


def check_attention(family, page_size, rng, *, config, interpret):
  """Random steps: the paged kernel runs twice (bitwise equal), matches the paged reference
  within the dtype's tolerance and the column kernel (same config) bitwise, and gives the
  same outputs with its segment table cut to the real rows."""
  scale = 1.0 / np.sqrt(family.head_dim)
  shared = 0
  for index in range(family.num_steps):
    step = random_step(rng, family, pad=index % 3 != 0, allow_blocks=index % 2 == 0)
    paged = paged_copy(rng, *resident_storage(rng, family, step), step, page_size=page_size,
                       fork=index % 2 == 1)
    shared += paged.shared_pages
    q = queries(rng, family, step)
    segments = (jnp.asarray(step.seq_info), jnp.int32(step.n_segments))
    args = (q, paged.k_pool, paged.v_pool, paged.page_table) + segments
    run = functools.partial(pallas_kernels.paged_varlen_attention, *args, window=None,
                            scale=scale, config=config, interpret=interpret)
    out, again = run(), run()
    real = slice(0, step.n_tokens)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(again, np.float32),
                                  err_msg=step.description)
    got = np.asarray(out[real], np.float32)
    assert np.isfinite(got).all(), step.description
    want = np.asarray(paged_reference(*args, scale=scale)[real], np.float32)
    np.testing.assert_allclose(got, want, atol=tol(family.dtype), rtol=0,
                               err_msg=step.description)
    # The same kernel body over columns, with the tile the paged call chose: same sums.
    used = paged_sm90.check_request(q, paged.k_pool, config=config, interpret=interpret)
    columns = pallas_kernels.varlen_attention(q, paged.k_cols, paged.v_cols, *segments,
                                              window=None, scale=scale, config=used,
                                              interpret=interpret)
    np.testing.assert_array_equal(got, np.asarray(columns[real], np.float32),
                                  err_msg=step.description)
    # The segment table cut to its real rows: a smaller plan, the same outputs bitwise.
    trimmed = pallas_kernels.paged_varlen_attention(
        q, paged.k_pool, paged.v_pool, paged.page_table,
        segments[0][:max(1, step.n_segments)], segments[1], window=None, scale=scale,
        config=config, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(trimmed, np.float32), np.asarray(out, np.float32),
                                  err_msg=f"{step.description}, table of the real rows")
  return shared


def check_write(family, page_size, rng, *, interpret):
  """The paged write kernel against the paged reference (pools bitwise equal, NaN included)
  and against the column reference read back through the table in NumPy; pages nobody holds
  (free pages, the scratch page) are never written."""
  for index in range(family.num_steps):
    step = random_step(rng, family, pad=index % 2 == 0, allow_blocks=False)
    paged = paged_copy(rng, *resident_storage(rng, family, step), step, page_size=page_size,
                       fork=False)
    new = rng.standard_normal((2, family.width, family.num_kv_heads, family.head_dim))
    new[:, step.n_tokens:] = np.nan                  # padded tokens must not be written
    k_new, v_new = (jnp.asarray(x, jnp.float32) for x in new)
    plan = (jnp.asarray(step.seq_cols), jnp.asarray(step.rows), jnp.int32(step.n_tokens))
    args = (paged.k_pool, paged.v_pool, k_new, v_new) + plan + (paged.page_table,)
    got = pallas_kernels.paged_kv_write(*args, interpret=interpret)
    want = pallas_kernels.paged_kv_write_reference(*args)
    columns = pallas_kernels.kv_write_reference(paged.k_cols, paged.v_cols, k_new, v_new, *plan)
    table = np.asarray(paged.page_table)
    held = np.unique(table[:family.max_seqs])
    unheld = np.setdiff1d(np.arange(paged.k_pool.shape[0]), held)
    for g, w, c in zip(got, want, columns):
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                    err_msg=step.description)
      logical = read_through_table(g, table, page_size)[:, :family.max_seqs]
      held_rows = np.asarray(c, np.float32)[:, :family.max_seqs]
      for col in range(family.max_seqs):     # columns with no page read the scratch page
        if (table[col] != unheld[-1]).any():
          np.testing.assert_array_equal(logical[:, col], held_rows[:, col],
                                        err_msg=step.description)
      assert np.isnan(np.asarray(g, np.float32)[unheld]).all(), step.description
