"""Shared pieces of the reliability tests: a fixed config pool, content, the model (compiled pure verbs live in drivers.py).

Configs come from a small fixed pool so every jitted verb compiles once per
(config, flat row count) and process; hypothesis draws pool entries instead of
building fresh configs, which would recompile on every example.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np

import jaxkv
from model import CacheModel

flat = jaxkv.LayerPolicy.flat
ring = jaxkv.LayerPolicy.ring


@dataclasses.dataclass(frozen=True)
class PoolEntry:
  """One config of the pool plus how tests feed it.

  Attributes:
    config: the jaxkv.CacheConfig.
    n_q_heads: query heads of every layer (a multiple of each layer's KV heads).
    content: "probe" (float32 storage; exact position/sequence probe values) or
      "random" (normal q/k/v, compared with the model's float64 attention).
  """

  config: jaxkv.CacheConfig
  n_q_heads: int
  content: str


def _cfg(layers, **kw):
  return jaxkv.CacheConfig([jaxkv.LayerConfig(p, h, d) for p, h, d in layers], **kw)


POOL: dict[str, PoolEntry] = {
    # CONTRACT scenario 50's first config, probe content.
    "flat+ring3/W2": PoolEntry(_cfg(
        [(flat(), 1, 4), (ring(3), 1, 4)], capacity=24, max_seqs=3, max_write=2,
        kv_dtype=jnp.float32, initial_capacity=2), 2, "probe"),
    # One sequence, one token per step, window 1: the tightest ring.
    "ring1/W1/1seq": PoolEntry(_cfg(
        [(ring(1), 1, 4)], capacity=8, max_seqs=1, max_write=1,
        kv_dtype=jnp.float32, initial_capacity=8), 1, "probe"),
    # A huge budget (capacity 2**31 - 1): no NO_ROOM; flat rows grow by doubling.
    "ring8+flat+ring2/W8/huge": PoolEntry(_cfg(
        [(ring(8), 2, 4), (flat(), 2, 4), (ring(2), 2, 4)], capacity=2**31 - 1,
        max_seqs=8, max_write=8, kv_dtype=jnp.float32, initial_capacity=8), 4, "probe"),
    # A ring clamped to capacity (R = 6 < w + W - 1 = 7), bfloat16, random content.
    "ring4-clamped/W4/bf16": PoolEntry(_cfg(
        [(ring(4), 1, 4)], capacity=6, max_seqs=2, max_write=4,
        kv_dtype=jnp.bfloat16, initial_capacity=6), 1, "random"),
    # Flat only, GQA 4/2, float16, random content.
    "flat/W3/f16/gqa": PoolEntry(_cfg(
        [(flat(), 2, 4)], capacity=16, max_seqs=4, max_write=3,
        kv_dtype=jnp.float16, initial_capacity=16), 4, "random"),
    # CONTRACT scenario 50's second config, random float32 content.
    "ring5+flat/W4": PoolEntry(_cfg(
        [(ring(5), 1, 4), (flat(), 1, 4)], capacity=24, max_seqs=3, max_write=4,
        kv_dtype=jnp.float32, initial_capacity=2), 2, "random"),
    # Paged storage (CONTRACT §3.1), drawn like any other entry: pages of 2 under
    # scenario 50's first config, pages of 3 (not dividing capacity 16 or W 3), and
    # pages of 4 under a ring, with W 4 steps crossing page boundaries.
    "flat+ring3/W2/paged2": PoolEntry(_cfg(
        [(flat(), 1, 4), (ring(3), 1, 4)], capacity=24, max_seqs=3, max_write=2,
        kv_dtype=jnp.float32, page_size=2), 2, "probe"),
    "flat/W3/f16/gqa/paged3": PoolEntry(_cfg(
        [(flat(), 2, 4)], capacity=16, max_seqs=4, max_write=3,
        kv_dtype=jnp.float16, page_size=3), 4, "random"),
    "ring5+flat/W4/paged4": PoolEntry(_cfg(
        [(ring(5), 1, 4), (flat(), 1, 4)], capacity=24, max_seqs=3, max_write=4,
        kv_dtype=jnp.float32, page_size=4), 2, "probe"),
    # A per-sequence cap (CONTRACT §2 `max_seq_len`) well below capacity: steps are
    # refused with TOO_LONG, flat rows stop growing at 7; and the same cap over pages
    # of 3 (the table has ceil(7 / 3) = 3 slots per sequence, the pool 6 + 4 + 1 pages).
    "flat+ring3/W2/len7": PoolEntry(_cfg(
        [(flat(), 1, 4), (ring(3), 1, 4)], capacity=24, max_seqs=3, max_write=2,
        kv_dtype=jnp.float32, initial_capacity=2, max_seq_len=7), 2, "probe"),
    "flat/W3/f16/gqa/paged3/len7": PoolEntry(_cfg(
        [(flat(), 2, 4)], capacity=16, max_seqs=4, max_write=3,
        kv_dtype=jnp.float16, page_size=3, max_seq_len=7), 4, "random"),
    # Rings only, two windows, five sequences.
    "ring7+ring2/W5": PoolEntry(_cfg(
        [(ring(7), 1, 4), (ring(2), 1, 4)], capacity=40, max_seqs=5, max_write=5,
        kv_dtype=jnp.float32, initial_capacity=40), 1, "probe"),
}

POOL_NAMES = sorted(POOL)


def flat_rows(config, state) -> int:
  """F: rows of the first flat layer, 0 when every layer is a ring; max_seq_len (else
  capacity) when paged."""
  if config.page_size is not None:
    return config.max_seq_len or config.capacity
  for lc, k in zip(config.layers, state.k):
    if lc.policy.kind == "flat":
      return k.shape[0]
  return 0


def new_model(config) -> CacheModel:
  return CacheModel.for_config(config)


def stateful_runs(default: int, *, tests: int = 2, steps_per_run: float = 40.0) -> int:
  """Hypothesis runs for one stateful test: `default`, or more for JAXKV_RELIABILITY_EXAMPLES.

  JAXKV_RELIABILITY_EXAMPLES is the total number of rule steps wanted over the
  `tests` stateful tests; a run averages about `steps_per_run` steps (runs
  end early at random and on exhausted preconditions).
  """
  total = int(os.environ.get("JAXKV_RELIABILITY_EXAMPLES", "0"))
  return max(default, math.ceil(total / tests / steps_per_run))


# --------------------------------------------------------------------------- content


def content(entry: PoolEntry, layer: int, positions, tags, rng: np.random.Generator):
  """q [n, H_q, D], k, v [n, H_kv, D] float32 for tokens at `positions` with `tags`.

  Probe: K = 0, q = 1, V channel 0 = p + 1, channel 1 = (p + 1)**2, channel 2 =
  the sequence's tag, so each output row is the mean over exactly the visible
  positions, and a key of another sequence (another tag) shows in channel 2.
  """
  lc = entry.config.layers[layer]
  n = len(positions)
  if entry.content == "probe":
    q = np.ones((n, entry.n_q_heads, lc.head_dim), np.float32)
    k = np.zeros((n, lc.n_kv_heads, lc.head_dim), np.float32)
    v = np.zeros((n, lc.n_kv_heads, lc.head_dim), np.float32)
    p = np.asarray(positions, np.float32)[:, None]
    v[:, :, 0] = p + 1
    v[:, :, 1] = (p + 1) ** 2
    v[:, :, 2] = np.asarray(tags, np.float32)[:, None]
    return q, k, v
  q = rng.standard_normal((n, entry.n_q_heads, lc.head_dim), dtype=np.float32)
  k = rng.standard_normal((n, lc.n_kv_heads, lc.head_dim), dtype=np.float32)
  v = rng.standard_normal((n, lc.n_kv_heads, lc.head_dim), dtype=np.float32)
  return q, k, v


def assert_rows_match(got, want, checked, what: str) -> None:
  """Real output rows equal the model's float64 attention.

  The model rounds K/V to kv_dtype exactly as storage does, so only float32
  accumulation separates the two, whatever the storage dtype: float32 tolerance
  (1e-5 absolute, plus 1e-5 relative for probe values up to (p + 1)**2).
  """
  got = np.asarray(got)
  assert got.dtype == np.float32, got.dtype
  for t in np.nonzero(checked)[0]:
    assert np.all(np.isfinite(got[t])), f"{what}: row {t} not finite: {got[t]}"
    np.testing.assert_allclose(got[t], want[t], rtol=1e-5, atol=1e-5,
                               err_msg=f"{what}: row {t}")
