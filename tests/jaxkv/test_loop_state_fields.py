"""Every `Columns` leaf is per-column (`[S, ...]`, moved as a whole by the paged loop's column swap),
every `Outputs` leaf per output row, and `ColumnParams` mirrors the queue's per-request fields.

Before: the sampling and timing merges added per-output-row fields (`[R]`, `[RL, T]`) to a flat
state whose swap moved every field not in a hand-kept list as a column; with `R == S` silently,
with `R != S` as an assert inside the trace. Now the sub-pytree a field sits in decides.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models import ModelConfig
from jaxkv.serve import SamplingParams
from jaxkv.serve import columns
from jaxkv.serve import paged_claims
from jaxkv.serve.state import ColumnParams, init_loop_state, pack_queue


def _state():
  config = dataclasses.replace(
      ModelConfig.llama(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=8).cache_config(
                            capacity=64, max_seqs=3, max_write=4), page_size=4)
  # 5 requests, one with logprobs: R = 8 output rows and 8 logprob rows, S = 3 columns.
  params = [SamplingParams(max_tokens=2, logprobs=1)] + [SamplingParams(max_tokens=2)] * 4
  queue = pack_queue([(1, 2)] * 5, params, max_len=8, max_stop=1, num_logprobs=1)
  return config, queue, init_loop_state(config, queue, num_widths=1, prefix_cache=True)


def test_columns_are_per_column_and_outputs_per_row():
  config, queue, ls = _state()
  s = config.max_seqs
  for path, leaf in jax.tree_util.tree_leaves_with_path(ls.cols):
    assert leaf.shape[:1] == (s,), (jax.tree_util.keystr(path), leaf.shape)
  for path, leaf in jax.tree_util.tree_leaves_with_path(ls.out):
    assert leaf.shape[0] == queue.rows != s, (jax.tree_util.keystr(path), leaf.shape)


def test_column_params_mirror_the_queue():
  """Admission copies a request's `ColumnParams` from the same-named queue fields."""
  _, _, ls = _state()
  for f in dataclasses.fields(ColumnParams):
    col, q = getattr(ls.cols.params, f.name), getattr(ls.queue, f.name)
    assert (col.dtype, col.shape[1:]) == (q.dtype, q.shape[1:]), f.name
  record = ColumnParams.of_request(ls.queue, 0)
  # A copy of the queue's entry, so bit for bit; the packed default itself within float tolerance.
  assert float(record.top_p) == float(ls.queue.top_p[0]) and int(record.logprobs) == 1
  assert float(record.top_p) == pytest.approx(1.0)


def test_swap_moves_every_column_leaf():
  _, _, ls = _state()
  s = ls.cols.used.shape[0]
  marked = jax.tree.map(
      lambda a: (jnp.arange(s) + 1).astype(a.dtype).reshape((s,) + (1,) * (a.ndim - 1))
      * jnp.ones_like(a), ls.cols)
  swapped = paged_claims.swap(dataclasses.replace(ls, cols=marked), jnp.int32(0), jnp.int32(2))
  for (path, before), after in zip(jax.tree_util.tree_leaves_with_path(marked),
                                   jax.tree.leaves(swapped.cols)):
    np.testing.assert_array_equal(np.asarray(after)[[2, 1, 0]], np.asarray(before),
                                  err_msg=jax.tree_util.keystr(path))
  for before, after in zip(jax.tree.leaves(ls.out), jax.tree.leaves(swapped.out)):
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))

def test_put_and_update_write_one_column():
  _, _, ls = _state()
  rec = dataclasses.replace(columns.column(ls.cols, 1), used=jnp.int32(1), length=jnp.int32(5))
  cols = columns.put(ls.cols, 1, rec)
  assert np.asarray(cols.used).tolist() == [0, 1, 0]
  assert np.asarray(cols.length).tolist() == [0, 5, 0]
  cols = columns.put(cols, 3, rec)   # out of range: dropped
  assert np.asarray(cols.used).tolist() == [0, 1, 0]
  cols = columns.update(cols, 2, jnp.bool_(False), used=1)
  assert np.asarray(cols.used).tolist() == [0, 1, 0]
  cols = columns.update(cols, 2, jnp.bool_(True), used=1, params=ColumnParams.of_request(
      ls.queue, 0))
  assert np.asarray(cols.used).tolist() == [0, 1, 1]
  assert np.asarray(cols.params.logprobs).tolist() == [-1, -1, 1]
