"""`PromptScorer`: the log-probability of each prompt token given the ones before it.

What OpenAI's `echo` with `logprobs` returns, and what lm-evaluation-harness's
loglikelihood tasks read. The engine's loop computes logits for one row per
sequence (the next token's); scoring needs every prompt row's, so the prompt runs
through the engine's own model (the same parameters, kernels and numerics) on a
one-sequence cache of the scorer's, `width` tokens a step, and each step reduces
its `[width, vocab]` logits on the device to the chosen tokens' logprobs, their
ranks and the top `k`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import BatchedSequenceCache, CacheConfig
from jaxkv.serve.memory import ROW_MULTIPLE

# Steps of at most this many prompt tokens: each step's logits are `[width, vocab]` float32
# on the device (128k vocab: 128 MiB at 256).
MAX_WIDTH = 256


@dataclasses.dataclass(frozen=True)
class PromptLogprob:
  """One prompt token's log-probability given the tokens before it: the fields of a generated
  token's `TokenLogprob` (so the same formatters read both), and its rank.

  Attributes:
    token: the prompt token.
    logprob: its log-probability under the model's raw distribution.
    rank: 1 + how many tokens are strictly more likely.
    top: the `k` most likely `(token, logprob)` pairs, most likely first.
  """

  token: int
  logprob: float
  rank: int
  top: tuple[tuple[int, float], ...] = ()


def _score_step(graphdef, config, k, params, state, tokens, targets):
  """One step of the prompt through every layer; per row the target's logprob, its rank and
  the top `k`."""
  model = nnx.merge(graphdef, params)
  # The engine's model, pointed at the scorer's cache (the layout is static on each module).
  for _, module in nnx.iter_modules(model):
    if isinstance(getattr(module, "cache_config", None), CacheConfig):
      module.cache_config = config
  logits, state = model(tokens, state)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
  rank = 1 + jnp.sum(logp > chosen[:, None], axis=-1)
  top_logp, top_ids = jax.lax.top_k(logp, max(k, 1))
  return state, (chosen, rank, top_ids[:, :k], top_logp[:, :k])


_jit_score_step = jax.jit(_score_step, static_argnums=(0, 1, 2), donate_argnums=4)


class PromptScorer:
  """Scores prompts with an engine's model (one prompt at a time; thread-safe).

  Args:
    engine: the `Engine` whose model scores (its parameters are shared, not copied).
    width: prompt tokens per step (default: the engine's step width, at most `MAX_WIDTH`).

  The scorer's cache holds one sequence of the engine's `max_len` tokens, made on the
  first `score`; it stays allocated beside the engine's.
  """

  def __init__(self, engine, *, width: int | None = None):
    core = engine.core
    self.engine, self.max_len = engine, engine.max_len
    width = min(engine.config.step_width, MAX_WIDTH) if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
      raise ValueError(f"width={width!r} must be an int >= 1")
    self.width = width
    self.graphdef, self.params = core.graphdef, core.params
    # Rows in whole blocks of the Mosaic GPU kernels' row multiple, as the engine's flat rows.
    rows = -(-self.max_len // ROW_MULTIPLE) * ROW_MULTIPLE
    self.config = CacheConfig(engine.config.layers, capacity=rows, max_seqs=1,
                              max_write=width, kv_dtype=engine.config.kv_dtype)
    self.vocab_size = engine.vocab_size
    self._facade: BatchedSequenceCache | None = None
    self._lock = threading.Lock()

  def _place(self):
    device = self.engine.device
    return contextlib.nullcontext() if device is None else jax.default_device(device)

  def score(self, tokens: Sequence[int], k: int = 0) -> list[PromptLogprob]:
    """`tokens[1:]`'s log-probabilities, each given the tokens before it, with the top `k`.

    Raises:
      ValueError: `tokens` is empty or longer than the engine's `max_len`, a token is
        outside the vocabulary, or `k` is negative or over the vocabulary size.
    """
    tokens = [int(t) for t in tokens]
    if not 1 <= len(tokens) <= self.max_len:
      raise ValueError(f"the prompt has {len(tokens)} tokens; scoring takes 1 to "
                       f"max_len={self.max_len}")
    bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
    if bad is not None:
      raise ValueError(f"token {bad} is outside the vocabulary [0, {self.vocab_size})")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.vocab_size:
      raise ValueError(f"k={k!r} must be an int in [0, vocab_size={self.vocab_size}]")
    if len(tokens) == 1:
      return []
    with self._lock, self._place():
      facade = self._facade
      seq = None if facade is None else facade.seq_new()
      if seq is None:   # the first score, or a failure mid-prompt left it live: a fresh cache
        self._facade = facade = BatchedSequenceCache(self.config, mesh=self.engine.mesh,
                                                     kv_axis=self.engine.kv_axis)
        seq = facade.seq_new()
      try:
        parts = []
        # The last token is nobody's context: only tokens[:-1] run.
        for start in range(0, len(tokens) - 1, self.width):
          chunk = tokens[start:start + self.width]
          chunk = chunk[:len(tokens) - 1 - start]
          n = len(chunk)
          padded = np.zeros((self.width,), np.int32)
          padded[:n] = chunk
          targets = np.zeros((self.width,), np.int32)
          targets[:n] = tokens[start + 1:start + 1 + n]
          if not facade.declare_step([seq] * n):
            raise ValueError(f"the scorer's cache refused a step: {facade.last_status.name}")
          facade.prepare_step()
          out = facade.forward(functools.partial(
              _jit_score_step, self.graphdef, self.config, k, self.params,
              tokens=padded, targets=targets))
          parts.append(jax.tree.map(lambda x, n=n: x[:n], out))
        chosen, rank, top_ids, top_logp = (np.concatenate(x) for x in
                                           zip(*jax.device_get(parts)))
      finally:
        facade.seq_rm(seq)
    return [PromptLogprob(token=tokens[i + 1], logprob=float(chosen[i]), rank=int(rank[i]),
                          top=tuple(zip(top_ids[i].tolist(), top_logp[i].tolist())))
            for i in range(len(chosen))]
