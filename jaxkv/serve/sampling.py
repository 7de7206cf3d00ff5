"""Token sampling inside the jitted loop: greedy, temperature, top-k, top-p, per-row keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_NEG = float(np.finfo(np.float32).min)


def _sample_row(logits, temperature, top_k, top_p, key):
  """One token from `float32[V]` logits; greedy when `temperature == 0`."""
  vocab = logits.shape[-1]
  greedy = jnp.argmax(logits).astype(jnp.int32)
  scaled = logits / jnp.maximum(temperature, jnp.float32(1e-6))
  ordered = jnp.sort(scaled)[::-1]   # descending
  ranks = jnp.arange(vocab, dtype=jnp.int32)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_k = ranks < k
  probs = jax.nn.softmax(jnp.where(in_k, ordered, _NEG))
  # A token is kept while the mass of the tokens before it is below top_p (the first always is).
  keep = in_k & ((jnp.cumsum(probs) - probs) < top_p)
  threshold = ordered[jnp.maximum(keep.sum(dtype=jnp.int32) - 1, 0)]
  masked = jnp.where(scaled >= threshold, scaled, _NEG)
  drawn = jax.random.categorical(key, masked).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def sample(logits, temperature, top_k, top_p, keys):
  """Samples one token per row.

  Args:
    logits: `float32[S, V]`.
    temperature: `float32[S]` (0: greedy).
    top_k: `int32[S]` (0: all).
    top_p: `float32[S]`.
    keys: `[S]` typed PRNG keys.

  Returns:
    `int32[S]`. The sort is skipped entirely when every row is greedy.
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(
      jnp.any(temperature > 0),
      lambda: jax.vmap(_sample_row)(logits, temperature, top_k, top_p, keys),
      lambda: greedy)
