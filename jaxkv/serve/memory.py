"""Cache sizing for serving: flat-row growth steps, K/V byte counts and size bounds."""

from __future__ import annotations

import math
from typing import Sequence

from jaxkv import CacheConfig, CacheState, _memory
from jaxkv.serve.requests import MAX_LOGIT_BIAS

# Flat growth rounds rows up to this multiple (capped at capacity), a multiple of every
# K/V tile the Mosaic GPU kernels use. They serve any row count, but read one that is not
# a multiple of 8 in one-atom column parts (under one tile, through a padded copy): slower.
ROW_MULTIPLE = 128


def _grown_rows(config: CacheConfig, current: int, needed: int) -> int:
  rows = max(needed, 2 * current)
  return min(config.max_flat_rows, -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE)


def bytes_in_use(config: CacheConfig, positions: Sequence[int]) -> int:
  """K+V bytes that sequences at `positions` occupy (a ring layer holds at most its rows)."""
  total = 0
  for l, layer in enumerate(config.layers):
    per_row = 2 * layer.n_kv_heads * layer.head_dim * config.kv_dtype.itemsize
    cap = config.ring_rows(l) if layer.policy.is_ring else None
    total += per_row * sum(p if cap is None else min(p, cap) for p in positions)
  return total


def storage_bytes(cache: CacheState) -> int:
  """Bytes allocated for K/V storage (all layers, all columns)."""
  return sum(int(math.prod(a.shape)) * a.dtype.itemsize for a in cache.k + cache.v)


# The loop's per-column vectors (prompt_len, length, fed, hold, limit, active, done,
# stopped, temperature, top_k, top_p, seed, sample_index, min_p, the three penalties,
# logprobs, lp_row, min_tokens, restrict, and the paged loop's parked, stamp, cached,
# last_use): 25 x 4 bytes per column, and MAX_LOGIT_BIAS (token, bias) slots of 8 bytes.
# The prefix cache's page hashes (`uint32[S, max_len / page_size]`) are at most a quarter of
# the token buffer with pages of 4 or more and are left out.
_PER_COLUMN_BYTES = 27 * 4 + 8 * MAX_LOGIT_BIAS   # with the grammar state and pending token


def loop_buffer_bytes(max_seqs: int, max_len: int, max_stop: int,
                      grammar_bytes: int = 0) -> tuple[int, str]:
  """`(bytes, formula)` of the serving loop's own buffers beside the cache.

  The token buffer `int32[max_seqs, max_len]` dominates; stop tokens are
  `int32[max_seqs, max_stop]`, plus a few int32/float32 vectors per column, plus
  the structured-output automata pool (`grammar_bytes`).
  """
  total = max_seqs * (4 * max_len + 4 * max_stop + _PER_COLUMN_BYTES) + grammar_bytes
  formula = (f"{max_seqs} columns (max_seqs) x (4 x {max_len} tokens (max_len) + "
             f"4 x {max_stop} stop tokens + {_PER_COLUMN_BYTES} bytes of per-column values)"
             + (f" + {grammar_bytes} bytes of grammar pool" if grammar_bytes else ""))
  return total, formula


def sampler_temp_bytes(max_seqs: int, max_len: int, vocab_size: int) -> int:
  """An upper estimate of the sampler's temporaries in the serving loop, in bytes.

  XLA holds about nine `[max_seqs, vocab]` 4-byte arrays at once (the logits adjusted, their
  order keys, masses, log-softmax, top candidates) and, for penalties, about four
  `[max_seqs, max_len]` ones (the history's clipped ids, masks and scatter indices). At 256
  sequences, 128k tokens and max_len 131,072 that is 1.6 GiB, which the default memory fraction's
  headroom was not sized for; `tests/jaxkv/test_sizing.py` checks the estimate bounds XLA's own
  memory analysis of `sample_rows`.
  """
  return 4 * max_seqs * (9 * vocab_size + 4 * max_len)


def check_engine_fits(config: CacheConfig, max_len: int, max_stop: int, *, mesh=None,
                      kv_axis: str = "tp", grammar_bytes: int = 0) -> None:
  """Raises ValueError, with the byte formula, unless an engine's buffers fit the device.

  Counts the cache (K/V at `initial_flat_rows`, split over `kv_axis` with a
  mesh, plus its control values) and the loop's buffers (`loop_buffer_bytes`).
  Call it before allocating either, e.g. in `Engine.__init__`.
  """
  shards = 1 if mesh is None else int(mesh.shape[kv_axis])
  device = None if mesh is None else mesh.devices.flat[0]
  kv, kv_text = _memory.kv_formula(config, config.initial_flat_rows)
  loop, loop_text = loop_buffer_bytes(config.max_seqs, max_len, max_stop, grammar_bytes)
  control = _memory.control_bytes(config)
  total = -(-kv // shards) + control + loop
  kv_text = kv_text if shards == 1 else f"({kv_text}) / {shards} shards"
  _memory.check_fits(total, what=f"an engine with max_len={max_len} on this cache",
                     formula=f"K/V {kv_text} + {control} control bytes + loop {loop_text}",
                     device=device)
