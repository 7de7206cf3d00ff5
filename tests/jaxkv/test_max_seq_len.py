"""`CacheConfig(max_seq_len=...)` (CONTRACT §2, §6.2): a per-sequence position cap.

A step that would take a live sequence past `max_seq_len` is refused with TOO_LONG and
changes nothing; a step that reaches it exactly is served (checked against the oracle).
The cap bounds the flat rows (columns grow to at most `max_seq_len` rows) and sizes the
page table (`ceil(max_seq_len / page_size)` slots), while the pool keeps its pages for
`capacity`. Both storages (the `storage` fixture).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from scenario_utils import Harness, assert_same_state, default_config, snapshot

pytestmark = pytest.mark.usefixtures("storage")

TOO_LONG = 14   # CONTRACT §10.4, restated


def _refused(cache, call):
  before = snapshot(cache.state)
  assert call() is False
  assert_same_state(before, snapshot(cache.state))
  assert int(cache.last_status) == TOO_LONG


def test_status_value_is_appended():
  assert int(jaxkv.Status.TOO_LONG) == TOO_LONG


@pytest.mark.parametrize("bad, error", [(0, ValueError), (33, ValueError), (-1, ValueError),
                                        (4.0, TypeError), (True, TypeError)])
def test_config_refuses_bad_values(bad, error):
  with pytest.raises(error, match="max_seq_len"):
    default_config(capacity=32, max_seq_len=bad)


def test_derived_sizes():
  config = default_config(capacity=32, max_seq_len=10, initial_capacity=32, page_size=None)
  assert (config.seq_len_limit, config.max_flat_rows, config.initial_flat_rows) == (10, 10, 10)
  paged = dataclasses.replace(config, page_size=3)
  # The table holds one sequence's positions; the pool still holds every live position.
  assert paged.max_pages_per_seq == 4 and paged.num_pages == 11 + 4 + 1
  wide = dataclasses.replace(paged, max_seq_len=None)
  assert wide.max_pages_per_seq == 11 and wide.num_pages == paged.num_pages
  assert wide.seq_len_limit == wide.max_flat_rows == 32


def test_steps_reach_the_cap_and_no_further():
  """Tokens up to position max_seq_len - 1 are served exactly; one more is refused."""
  h = Harness(default_config(capacity=32, max_seq_len=7, initial_capacity=2))
  cache = h.cache
  x, y = h.new(), h.new()
  h.step([x, x, x, y])
  h.step([x, x, x])
  assert (cache.pos(x), cache.pos(y)) == (6, 1)
  _refused(cache, lambda: cache.declare_step([x, x]))
  _refused(cache, lambda: cache.declare_step([y, x, y, x]))
  h.step([x, y, y])                  # x reaches the cap exactly
  assert cache.pos(x) == 7
  _refused(cache, lambda: cache.declare_step([x]))
  _refused(cache, lambda: cache.declare_step([y, y, y, y, y, y]))   # y at 3: 9 > 7
  h.step([y, y, y, y])               # y reaches the cap: 7
  # A refused declaration leaves an earlier one standing (CONTRACT §6.2).
  assert cache.rewind(x, 5) is True
  assert cache.declare_step([x, x]) is True
  _refused(cache, lambda: cache.declare_step([x, x, x]))
  assert int(cache.state.decl_n) == 2
  cache.prepare_step()
  # Forks inherit at most the source's positions, so they stay under the cap.
  f = cache.seq_clone(y)
  assert f is not None and cache.pos(f) == 7


def test_no_room_comes_first():
  """Both rules broken: NO_ROOM (rule 5) is reported before TOO_LONG (rule 6)."""
  h = Harness(default_config(capacity=8, max_seq_len=4, initial_capacity=8))
  cache = h.cache
  x = h.new()
  h.step([x] * 4)
  y = h.new()
  h.step([y] * 3)
  assert cache.declare_step([x, x]) is False and int(cache.last_status) == int(
      jaxkv.Status.NO_ROOM)
  assert cache.declare_step([x]) is False and int(cache.last_status) == TOO_LONG


def test_pure_refusal_is_jittable_and_changes_nothing():
  """The pure verb under jit: TOO_LONG, the state unchanged bitwise (every leaf)."""
  config = default_config(capacity=32, max_seq_len=5, initial_capacity=8)
  pure = jaxkv.pure
  state = jaxkv.init_state(config)
  state, _, x = pure.seq_new(config, state)
  ids = jnp.zeros((config.step_width,), jnp.int32).at[:].set(x)
  no_blocks = jnp.zeros((config.step_width, 2), jnp.int32)
  declare = jax.jit(pure.declare_step, static_argnums=0)
  state, status = declare(config, state, ids, jnp.int32(5), no_blocks)
  assert int(status) == 0
  before = snapshot(state)
  _, status = declare(config, state, ids, jnp.int32(6), no_blocks)
  assert int(status) == TOO_LONG
  assert_same_state(before, snapshot(state))


def test_growth_stops_at_the_cap():
  """Columns: the facade grows flat rows to at most max_seq_len; `grow` refuses past it."""
  config = default_config(capacity=64, max_seq_len=12, initial_capacity=2, page_size=None)
  h = Harness(config)
  cache = h.cache
  x = h.new()
  h.step([x] * 8)
  h.step([x] * 4)
  assert cache.pos(x) == 12
  rows = {a.shape[0] for a in cache.state.k}
  assert rows == {12}
  with pytest.raises(ValueError, match="max_seq_len=12"):
    jaxkv.pure.grow(config, jaxkv.init_state(config), 13)


def test_engine_max_len_must_fit_the_cap():
  """A request holds prompt + max_tokens - 1 positions: max_len may pass the cap by one."""
  from flax import nnx   # pylint: disable=g-import-not-at-top
  from jaxkv import serve
  from jaxkv.models import Decoder, ModelConfig
  cfg = ModelConfig.llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                          num_heads=2, num_kv_heads=1, head_dim=16)
  cache = cfg.cache_config(capacity=64, max_seqs=2, max_write=8, max_seq_len=20)
  model = Decoder(cfg, cache, rngs=nnx.Rngs(0))
  assert serve.Engine(model).max_len == 20
  assert serve.Engine(model, max_len=21).max_len == 21
  with pytest.raises(ValueError, match="max_len=22"):
    serve.Engine(model, max_len=22)
