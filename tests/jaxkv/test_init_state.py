"""A fresh loop state is made by compiled calls, every leaf in its own buffer (issue 11).

Made op by op, `init_loop_state` was ~100 dispatches (and `init_state` ~40) per
`Engine.run`, host work the GPU waited for before the loop started. Both now come
from cached jitted builders; the loop donates the state leaf by leaf, so no two
leaves may share a buffer, and the values must be those the contract names.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv import Phase, init_state, serve
from jaxkv.models import ModelConfig
from jaxkv.serve import state as state_module
from jaxkv.serve.state import init_loop_state, pack_queue

CFG = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8)


def _state(config, **kw):
  queue = pack_queue([(1, 2, 3), (4,)], [serve.SamplingParams(max_tokens=3, n=2),
                                         serve.SamplingParams(max_tokens=2)],
                     max_len=16, max_stop=4)
  return init_loop_state(config, queue, num_widths=2, **kw), queue


def _pointers(tree):
  return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) if x.size]


def test_fresh_loop_state_leaves_are_distinct_buffers_with_the_contract_values():
  for config, kw in ((CFG.cache_config(capacity=64, max_seqs=4, max_write=8), {}),
                     (dataclasses.replace(CFG.cache_config(capacity=64, max_seqs=4, max_write=8),
                                          page_size=8), {"prefix_cache": True})):
    ls, queue = _state(config, **kw)
    pointers = _pointers(ls)
    assert len(pointers) == len(set(pointers))
    assert all(not np.any(np.asarray(k)) for k in ls.cache.k + ls.cache.v)
    assert int(ls.cache.phase) == Phase.IDLE and not np.any(np.asarray(ls.cache.live))
    np.testing.assert_array_equal(np.asarray(ls.queue.prompt), queue.arrays["prompt"])
    assert int(ls.queue.count) == queue.count and int(ls.queue.next) == 0
    np.testing.assert_array_equal(np.asarray(ls.cols.hold), np.full(4, 16))
    np.testing.assert_array_equal(np.asarray(ls.out.first), np.full(queue.rows, -1))
    assert ls.cols.page_hash.shape == ((4, 2) if kw else (4, 0))
    if config.is_paged:
      assert np.all(np.asarray(ls.cache.page_table) == config.scratch_page)


def test_second_state_of_the_same_shapes_reuses_the_compiled_builders():
  config = CFG.cache_config(capacity=64, max_seqs=4, max_write=8)
  _state(config)
  fields = state_module._fresh_fields_fn.cache_info()   # pylint: disable=protected-access
  before = (fields.hits, fields.misses)
  a, _ = _state(config)
  b, _ = _state(config)
  after = state_module._fresh_fields_fn.cache_info()   # pylint: disable=protected-access
  assert (after.hits - before[0], after.misses - before[1]) == (2, 0)
  # Two states never share buffers either (each run donates its own).
  assert not set(_pointers(a)) & set(_pointers(b))
  fresh = init_state(config)
  assert not set(_pointers(fresh)) & set(_pointers(a.cache))
