"""`ModelRunner`: host-level, step-by-step driving of a model on its own cache."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig, Status, init_state, pure
from jaxkv.serve.engine import _model_mesh, _split_placed
from jaxkv.serve.loop import _first_bad
from jaxkv.serve.memory import _grown_rows


def _run_step(graphdef, config, params, cache, tokens):
  from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
  model = merge_model(graphdef, params)
  cache, st_prepare = pure.prepare_step(config, cache)
  logits, cache = model(tokens, cache)
  cache, st_commit = pure.commit_step(config, cache)
  return cache, logits, _first_bad(st_prepare, st_commit)


_RUNNER_VERBS = {name: jax.jit(getattr(pure, name), static_argnums=0, donate_argnums=1)
                 for name in ("seq_new", "seq_clone", "seq_rm", "rewind", "declare_step")}
_jit_rows_needed = jax.jit(pure.rows_needed, static_argnums=0)
_jit_run_step = jax.jit(_run_step, static_argnums=(0, 1), donate_argnums=3)


class ModelRunner:
  """Host-level, step-by-step driving of a model on its own cache.

  Each `step` is one declare (jitted), an optional host-side flat growth, and one
  jitted prepare → model → commit with the cache donated. Refused sequence verbs
  return None/False as on `jaxkv.BatchedSequenceCache`.

  Args:
    model: an NNX model following the step protocol, with `cache_config`.
    mesh, kv_axis: as for `Engine` (default: the model's).
  """

  def __init__(self, model, *, mesh=None, kv_axis: str | None = None):
    config = getattr(model, "cache_config", None)
    if not isinstance(config, CacheConfig):
      raise ValueError(f"model={type(model).__name__} must have a CacheConfig `cache_config`")
    self.config = config
    self.mesh, self.kv_axis = _model_mesh(model, config, mesh, kv_axis)
    self.graphdef, self.params = _split_placed(model, self.mesh)
    self.cache = init_state(config, mesh=self.mesh, kv_axis=self.kv_axis)
    self._seq_new, self._seq_clone = _RUNNER_VERBS["seq_new"], _RUNNER_VERBS["seq_clone"]
    self._seq_rm, self._rewind = _RUNNER_VERBS["seq_rm"], _RUNNER_VERBS["rewind"]
    self._declare = _RUNNER_VERBS["declare_step"]
    self._rows_needed = _jit_rows_needed
    self._step = _jit_run_step

  def seq_new(self) -> int | None:
    self.cache, status, seq_id = self._seq_new(self.config, self.cache)
    return int(seq_id) if int(status) == Status.OK else None

  def seq_clone(self, src: int, upto: int | None = None) -> int | None:
    upto = pure.WHOLE if upto is None else upto
    self.cache, status, seq_id = self._seq_clone(self.config, self.cache, jnp.int32(src),
                                                 jnp.int32(upto))
    return int(seq_id) if int(status) == Status.OK else None

  def seq_rm(self, seq_id: int) -> bool:
    self.cache, status = self._seq_rm(self.config, self.cache, jnp.int32(seq_id))
    return int(status) == Status.OK

  def rewind(self, seq_id: int, position: int) -> bool:
    self.cache, status = self._rewind(self.config, self.cache, jnp.int32(seq_id),
                                      jnp.int32(position))
    return int(status) == Status.OK

  def pos(self, seq_id: int) -> int:
    return int(self.cache.pos[seq_id]) if int(self.cache.live[seq_id]) else 0

  def step(self, seq_ids: Sequence[int], tokens: Sequence[int], owner_blocks=None) -> np.ndarray:
    """Runs one step; returns the logits of the real tokens, `float32[n, vocab]`.

    Args:
      seq_ids: sequence of each step token (at most `W`).
      tokens: token id of each step token.
      owner_blocks: optional `[(start, length), ...]` owner blocks (SPEC §9).

    Raises:
      ValueError: `seq_ids` and `tokens` differ in length, or the declaration
        is refused (the status is named).
    """
    config, width = self.config, self.config.step_width
    n = len(seq_ids)
    if len(tokens) != n:
      raise ValueError(f"tokens has {len(tokens)} entries; seq_ids has {n}")
    if not 1 <= n <= width:
      raise ValueError(f"seq_ids must hold 1..W={width} entries; got {n}")
    ids = np.full((width,), config.max_seqs, np.int32)
    ids[:n] = seq_ids
    toks = np.zeros((width,), np.int32)
    toks[:n] = tokens
    blocks = np.zeros((width, 2), np.int32)
    for i, (start, length) in enumerate(owner_blocks or ()):
      blocks[i] = (start, length)
    self.cache, status = self._declare(config, self.cache, jnp.asarray(ids), jnp.int32(n),
                                       jnp.asarray(blocks))
    if int(status) != Status.OK:
      raise ValueError(f"seq_ids={list(seq_ids)} (owner_blocks={owner_blocks}) refused: "
                       f"{Status(int(status)).name}")
    needed = int(self._rows_needed(config, self.cache))
    if config.has_flat:
      current = next(self.cache.k[l].shape[0] for l, layer in enumerate(config.layers)
                     if not layer.policy.is_ring)
      if needed > current:
        self.cache = pure.grow(config, self.cache, _grown_rows(config, current, needed))
    self.cache, logits, status = self._step(self.graphdef, config, self.params, self.cache,
                                            jnp.asarray(toks))
    if int(status) != Status.OK:
      raise RuntimeError(f"step failed: {Status(int(status)).name}")
    return np.asarray(logits[:n])
