"""`jaxkv.serve.sizing.plan_serving`: sizes from a memory budget, re-derived here by hand.

The fixture model (tests/fixtures/hf_llama: 2 flat layers, 2 KV heads of dim 8,
max_position_embeddings 128) in float32 costs 2 layers x 2 (K, V) x 2 heads x 8
x 4 bytes = 256 bytes per position; a page of 64 positions over both layers
16,384 bytes. The expected numbers below follow the documented rules with that
arithmetic, not the library's helpers.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.serve import sizing
from jaxkv.models import ModelConfig, hf

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
CONFIG = hf.read_config(os.path.join(FIXTURES, "hf_llama"))
POSITION_BYTES = 2 * 2 * 2 * 8 * 4
PAGE_BYTES = 64 * POSITION_BYTES
F32 = dict(dtype=jnp.float32, kv_dtype=jnp.float32, weights_bytes=CONFIG.num_params * 4)


def _paged_expectation(budget: int, max_len: int, max_write: int) -> tuple[int, int]:
  """`(max_seqs, capacity)` by the documented rules for a K/V budget of `budget` bytes."""
  seqs = max(1, min(256, max_write, budget // POSITION_BYTES // min(max_len, 2048)))
  pages = budget // PAGE_BYTES - seqs - 1   # the pool: ceil(capacity / 64) + max_seqs + 1 pages
  ceiling = -(-seqs * max_len // 64) * 64
  return seqs, min(pages * 64, ceiling)


def _temporaries(seqs: int, width: int) -> int:
  """The sampler's `[S, V]` and `[S, max_len]` temporaries (9 and 4 of 4 bytes) and one step's
  float32 activations (8 x hidden + 3 x intermediate + vocab per token) at max_len 128."""
  return (4 * seqs * (9 * CONFIG.vocab_size + 4 * 128)
          + 4 * width * (8 * CONFIG.hidden_size + 3 * CONFIG.intermediate_size + CONFIG.vocab_size))


@pytest.mark.parametrize("budget", [4 << 20, 64 << 20])
def test_paged_sizes_from_kv_cache_memory(budget):
  plan = sizing.plan_serving(CONFIG, kv_cache_memory=budget, **F32)
  seqs, capacity = _paged_expectation(budget, 128, sizing.DEFAULT_MAX_WRITE)
  assert (plan.max_seqs, plan.capacity, plan.token_capacity) == (seqs, capacity, capacity)
  assert (plan.storage, plan.page_size, plan.prefix_caching) == ("paged", 64, True)
  assert (plan.max_len, plan.max_len_source) == (128, "checkpoint max_position_embeddings")
  pages = -(-capacity // 64) + seqs + 1
  assert plan.kv_bytes == pages * PAGE_BYTES <= budget
  cc = plan.cache_config
  assert (cc.page_size, cc.max_seq_len, cc.max_seqs, cc.capacity) == (64, 128, seqs, capacity)


def test_tensor_parallel_shards_multiply_the_per_device_budget():
  plan = sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, shards=2, **F32)
  seqs, capacity = _paged_expectation(2 * (4 << 20), 128, sizing.DEFAULT_MAX_WRITE)
  assert (plan.max_seqs, plan.capacity, plan.kv_budget_bytes) == (seqs, capacity, 8 << 20)
  assert plan.budget_source.startswith("2 devices x (")


def test_the_budget_caps_max_seqs_at_the_step_width_and_256():
  plan = sizing.plan_serving(CONFIG, kv_cache_memory=64 << 20, max_write=16, **F32)
  assert plan.max_seqs == 16
  plan = sizing.plan_serving(CONFIG, kv_cache_memory=1 << 30, max_write=4096, **F32)
  assert plan.max_seqs == 256 and plan.capacity == 256 * 128   # every column full, no more


def test_columns_take_as_many_sequences_as_fit():
  # 1171 positions: the rule's first guess is 9 sequences, but 9 + 1 (scratch) columns of 128
  # rows cost 327,680 bytes > 300,000; 8 + 1 cost 294,912.
  plan = sizing.plan_serving(CONFIG, kv_cache_memory=300_000, page_size=None, **F32)
  assert (plan.storage, plan.page_size, plan.prefix_caching) == ("columns", None, False)
  assert plan.max_seqs == 8 and plan.capacity == 8 * 128
  assert plan.kv_bytes == 9 * 128 * POSITION_BYTES
  assert plan.cache_config.initial_flat_rows == 128   # allocated whole


class _Device:
  """A device reporting `bytes_limit`, as a GPU does."""
  platform, device_kind = "gpu", "Fake GPU"

  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    return {"bytes_limit": self.limit, "bytes_in_use": 123}


def test_gpu_memory_utilization_counts_weights_and_loop_buffers():
  limit, util, weights = 13 << 20, 0.5, 3 << 20   # 3.5 MiB left: the pool, not the columns, binds
  plan = sizing.plan_serving(CONFIG, dtype=jnp.float32, kv_dtype=jnp.float32,
                             weights_bytes=weights, gpu_memory_utilization=util,
                             device=_Device(limit), max_write=64)
  seqs = min(256, 64, (int(util * limit) - weights) // POSITION_BYTES // 128)
  assert plan.max_seqs == seqs == 64 and plan.capacity < seqs * 128
  # tokens, stops, per-column values, bias; the grammar pool: states, masks, transitions
  vocab = CONFIG.vocab_size
  loop = (seqs * (4 * 128 + 4 * 8 + 27 * 4 + 8 * 64)
          + 20 * 4096 + 4 * 256 * -(-vocab // 32) + 8 * min(1 << 18, max(1 << 14, 16 * vocab)) + 4 * 16 * vocab)
  loop += _temporaries(seqs, 64)
  spare = int(util * limit) - weights - loop - plan.kv_bytes
  assert 0 <= spare < PAGE_BYTES + (1 << 16)   # one more page would not fit (control values)
  assert "0.5 x 13,631,488 bytes (Fake GPU bytes_limit)" in plan.budget_source
  # Without a memory figure (a CPU) the device counts as CPU_DEVICE_BYTES.
  cpu = sizing.plan_serving(CONFIG, gpu_memory_utilization=util, **F32)
  assert f"{util} x {sizing.CPU_DEVICE_BYTES:,} bytes" in cpu.budget_source


def test_tensor_parallel_budgets_leave_the_loop_buffers_on_every_device():
  """With shards=2 each device holds the weights given (per device), its own copy of the loop
  buffers and control values, and half the K/V: the K/V budget is twice what one device has
  left after those, not twice its share less one copy of the loop buffers."""
  limit, util, weights, seqs, shards = 8 << 20, 0.5, 3 << 20, 32, 2
  plan = sizing.plan_serving(CONFIG, dtype=jnp.float32, kv_dtype=jnp.float32,
                             weights_bytes=weights, gpu_memory_utilization=util,
                             device=_Device(limit), max_write=64, max_seqs=seqs, shards=shards)
  left = int(util * limit) - weights   # per device
  # tokens, stops, per-column values, bias; the grammar pool: states, masks, transitions
  vocab = CONFIG.vocab_size
  loop = (seqs * (4 * 128 + 4 * 8 + 27 * 4 + 8 * 64)
          + 20 * 4096 + 4 * 256 * -(-vocab // 32) + 8 * min(1 << 18, max(1 << 14, 16 * vocab)) + 4 * 16 * vocab)
  loop += _temporaries(seqs, 64)
  control = 1 << 16   # at most, per device
  assert shards * (left - loop - control) <= plan.kv_budget_bytes <= shards * (left - loop)
  assert plan.kv_bytes // shards + loop <= left   # what one device holds fits it
  subtracted = int(plan.budget_source.split(" - ")[-1].split(" bytes of loop")[0].replace(",", ""))
  assert loop <= subtracted <= loop + control, plan.budget_source
  assert plan.budget_source.startswith(f"{shards} devices x ({util} x {limit:,} bytes")


def test_kv_cache_memory_wins_over_gpu_memory_utilization():
  alone = sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, **F32)
  both = sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, gpu_memory_utilization=0.01,
                             device=_Device(64 << 20), **F32)
  assert both == alone


def test_max_len_comes_from_the_argument_or_the_checkpoint():
  plan = sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, max_len=100, **F32)
  assert (plan.max_len, plan.max_len_source, plan.cache_config.max_seq_len) == (
      100, "max_len argument", 100)
  flags = sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, max_len=100, flags=True, **F32)
  assert flags.max_len_source == "--max-len"
  big = dataclasses.replace(CONFIG, max_position_embeddings=131072)
  plan = sizing.plan_serving(big, kv_cache_memory=64 << 30, **F32)
  assert plan.max_len == 131072   # no silent cap
  with pytest.raises(ValueError, match="no max_position_embeddings: give max_len"):
    sizing.plan_serving(ModelConfig.llama(), kv_cache_memory=1 << 20, **F32)


def test_refusals_name_the_argument_and_the_numbers():
  with pytest.raises(ValueError, match=r"max_len=100 \(max_len argument\) does not fit: one "
                                       r"sequence of max_len needs 25,600 bytes"):
    sizing.plan_serving(CONFIG, kv_cache_memory=10_000, max_len=100, **F32)
  with pytest.raises(ValueError, match=r"--max-len=128 \(checkpoint max_position_embeddings\) "
                                       r"does not fit.*--kv-cache-memory=10,000 bytes"):
    sizing.plan_serving(CONFIG, kv_cache_memory=10_000, flags=True, **F32)
  with pytest.raises(ValueError, match="max_seqs=200 sequences of max_len=128"):
    sizing.plan_serving(CONFIG, kv_cache_memory=1 << 20, max_seqs=200, page_size=None, **F32)
  with pytest.raises(ValueError, match=r"--gpu-memory-utilization=1.5 must be in \(0, 1\]"):
    sizing.plan_serving(CONFIG, gpu_memory_utilization=1.5, flags=True, **F32)
  with pytest.raises(ValueError, match="no memory is left for the K/V cache"):
    sizing.plan_serving(CONFIG, dtype=jnp.float32, kv_dtype=jnp.float32,
                        weights_bytes=1 << 30, device=_Device(1 << 20))
  with pytest.raises(TypeError, match="page_size=1.5 must be an int"):
    sizing.plan_serving(CONFIG, kv_cache_memory=1 << 20, page_size=1.5, **F32)


def test_a_model_of_ring_layers_only_is_sized_in_columns():
  config = hf.read_config(os.path.join(FIXTURES, "hf_mistral"))
  plan = sizing.plan_serving(config, kv_cache_memory=1 << 20, max_write=16, **F32)
  assert plan.storage == "columns" and plan.page_size is None and not plan.prefix_caching


def test_startup_lines_say_what_was_chosen():
  plan = sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, model="ckpt", **F32)
  text = "\n".join(plan.lines())
  for part in ("model: ckpt", "dtype: float32", "K/V dtype float32", "paged, page size 64",
               "prefix caching on", f"{plan.kv_bytes:,} bytes", f"{plan.capacity:,} tokens",
               "max_len: 128 (checkpoint max_position_embeddings)",
               f"{plan.max_seqs} sequences at once"):
    assert part in text, part
  assert np.isclose(plan.capacity / plan.max_len, float(text.split("holds ")[1].split("x")[0]),
                    atol=0.01)


def test_max_len_past_the_checkpoint_context_and_a_step_past_the_device_are_refused():
  """Positions the checkpoint was never trained for, and a step width whose activations
  alone exceed the device, are refused before anything is allocated, naming the flag."""
  with pytest.raises(ValueError, match=r"--max-len=129 is past the checkpoint's "
                                       r"max_position_embeddings=128; give at most 128"):
    sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, max_len=129, flags=True, **F32)
  assert sizing.plan_serving(CONFIG, kv_cache_memory=4 << 20, max_len=128, **F32).max_len == 128
  per_token = (8 * CONFIG.hidden_size + 3 * CONFIG.intermediate_size + CONFIG.vocab_size) * 4
  limit = 8 << 20
  fits = (limit - F32["weights_bytes"]) // per_token
  device = _Device(limit)
  sizing.plan_serving(CONFIG, kv_cache_memory=1 << 20, max_write=fits, device=device, **F32)
  with pytest.raises(ValueError, match=rf"--max-write={fits + 1} does not fit: one step of that "
                                       rf"many tokens needs about {(fits + 1) * per_token:,} bytes"):
    sizing.plan_serving(CONFIG, kv_cache_memory=1 << 20, max_write=fits + 1, device=device,
                        flags=True, **F32)


@pytest.mark.parametrize("rows, vocab, max_len", [(16, 2048, 4096), (32, 8192, 512)])
def test_the_sampler_estimate_bounds_xla_memory_analysis(rows, vocab, max_len):
  """XLA's own count of `sample_rows`'s temporaries, every stage on (penalties over the history,
  bias, bans, a grammar, logprobs, sampling), is within the sizing's estimate and not far below
  it: one geometry where the vocabulary dominates, one where the history does. The draw alone
  (`branches=False`) takes no more."""
  import jax   # pylint: disable=g-import-not-at-top
  from jaxkv.serve import memory, sampling   # pylint: disable=g-import-not-at-top
  from jaxkv.structured import pool as grammar_pool   # pylint: disable=g-import-not-at-top
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  pool = grammar_pool.empty_pool(vocab, *grammar_pool.default_capacity(vocab))

  def sample(logits, history, length, keys, banned, bias_ids, bias, pool, state, branches=True):
    p = sampling.RowParams.default(rows, temperature=0.7, repetition_penalty=1.1,
                                   presence_penalty=0.5, logprobs=3)
    return sampling.sample_rows(
        logits, p, keys, sampling=jnp.ones((rows,), bool), history=history,
        prompt_len=length // 2, length=length, banned=banned,
        bias=(bias_ids, bias, length % 2), num_logprobs=5, grammar=(pool, state, state, banned),
        branches=branches)

  args = (jax.ShapeDtypeStruct((rows, vocab), jnp.float32), i32(rows, max_len), i32(rows),
          jax.random.split(jax.random.key(0), rows), i32(rows, 8), i32(rows, 64),
          jax.ShapeDtypeStruct((rows, 64), jnp.float32),
          jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), pool), i32(rows))
  temp = jax.jit(sample).lower(*args).compile().memory_analysis().temp_size_in_bytes
  estimate = memory.sampler_temp_bytes(rows, max_len, vocab)
  assert temp <= estimate < 2 * temp, (temp, estimate)
  # The stepping server's sampled step (the draw alone, no branch) fits in what the loop's takes.
  draw = jax.jit(lambda *a: sample(*a, branches=False)).lower(*args).compile().memory_analysis()
  assert draw.temp_size_in_bytes <= temp, (draw.temp_size_in_bytes, temp)
