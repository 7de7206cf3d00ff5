"""`ModelRunner`: host-level, step-by-step driving of a model on its own cache.

The runner is a `jaxkv.BatchedSequenceCache` plus the model step: the facade
keeps the state, the sequence verbs, their refusals and the flat growth (rounded
to `ROW_MULTIPLE` rows for the Mosaic GPU kernels); the runner adds one jitted
model forward per step.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxkv import BatchedSequenceCache, CacheConfig, CacheState
from jaxkv._host import _as_list
from jaxkv.serve.core import _split_placed
from jaxkv.serve.engine import _model_mesh
from jaxkv.serve.memory import ROW_MULTIPLE


def _forward(graphdef, config, params, state, tokens):
  """Every layer of the model on the prepared `state`; `(state, logits)`."""
  from jaxkv.nnx import merge_model   # pylint: disable=g-import-not-at-top
  del config   # static: part of the jit key, so a model of another cache retraces
  model = merge_model(graphdef, params)
  logits, state = model(tokens, state)
  return state, logits


_jit_forward = jax.jit(_forward, static_argnums=(0, 1), donate_argnums=3)


def _token(i: int, value, vocab_size: int | None) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"tokens[{i}]={value!r} must be an int")
  value = int(value)
  high = vocab_size if vocab_size is not None else 2**31
  if not 0 <= value < high:
    raise ValueError(f"tokens[{i}]={value} must be in [0, "
                     f"{'vocab_size=' if vocab_size is not None else ''}{high})")
  return value


class ModelRunner:
  """Host-level, step-by-step driving of a model on its own cache.

  Each `step` declares the tokens, prepares (growing flat rows on the host if
  needed), runs the model's forward in one jitted call with the state donated,
  and commits. Sequence verbs are the facade's: a refusal returns None/False
  and changes nothing; ids must be Python or NumPy ints (TypeError otherwise).

  Args:
    model: an NNX model following the step protocol, with `cache_config` (and,
      to check token ids, `config.vocab_size`).
    mesh, kv_axis: as for `Engine` (default: the model's).
  """

  def __init__(self, model, *, mesh=None, kv_axis: str | None = None):
    config = getattr(model, "cache_config", None)
    if not isinstance(config, CacheConfig):
      raise ValueError(f"model={type(model).__name__} must have a CacheConfig `cache_config`")
    self.config = config
    self.mesh, self.kv_axis = _model_mesh(model, config, mesh, kv_axis)
    self.graphdef, self.params = _split_placed(model, self.mesh)
    self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    self.facade = BatchedSequenceCache(config, mesh=self.mesh, kv_axis=self.kv_axis,
                                       row_multiple=ROW_MULTIPLE)

  @property
  def cache(self) -> CacheState:
    """The current state; invalid after the next call (it is donated)."""
    return self.facade.state

  def seq_new(self) -> int | None:
    return self.facade.seq_new()

  def seq_clone(self, src, upto=None) -> int | None:
    return self.facade.seq_clone(src, upto)

  def seq_rm(self, seq_id) -> bool:
    return self.facade.seq_rm(seq_id)

  def rewind(self, seq_id, position) -> bool:
    return self.facade.rewind(seq_id, position)

  def pos(self, seq_id) -> int:
    """Committed length of `seq_id` (0 when not live).

    Raises:
      TypeError: not a Python or NumPy int.
      ValueError: not a column id, `0 <= seq_id < max_seqs`.
    """
    live = self.facade.is_live(seq_id)   # type check first
    if not 0 <= int(seq_id) < self.config.max_seqs:
      raise ValueError(f"seq_id={seq_id} must be in [0, max_seqs={self.config.max_seqs})")
    return self.facade.pos(seq_id) if live else 0

  def step(self, seq_ids: Sequence[int], tokens: Sequence[int], owner_blocks=None) -> np.ndarray:
    """Runs one step; returns the logits of the real tokens, `float32[n, vocab]`.

    Args:
      seq_ids: sequence of each step token (at most `W`).
      tokens: token id of each step token, in `[0, vocab_size)`.
      owner_blocks: optional `[(start, length), ...]` owner blocks (CONTRACT §9).

    Raises:
      TypeError: an id or token that is not an int, or `seq_ids`/`tokens` not a
        sequence (a dict, set, str or bytes is refused, not iterated).
      ValueError: `seq_ids` and `tokens` differ in length, a token is out of
        range, or the declaration is refused; nothing changes. Ids past int32
        (`np.int64(2**32)`) are refused, never wrapped onto a live id.
    """
    width = self.config.step_width
    seq_ids, tokens = _as_list("seq_ids", seq_ids), _as_list("tokens", tokens)
    n = len(seq_ids)
    if len(tokens) != n:
      raise ValueError(f"tokens has {len(tokens)} entries; seq_ids has {n}")
    if not 1 <= n <= width:
      raise ValueError(f"seq_ids must hold 1..W={width} entries; got {n}")
    padded = np.zeros((width,), np.int32)
    padded[:n] = [_token(i, t, self.vocab_size) for i, t in enumerate(tokens)]
    if not self.facade.declare_step(seq_ids, owner_blocks):
      raise ValueError(f"seq_ids={seq_ids} (owner_blocks={owner_blocks}) refused: "
                       f"{self.facade.last_status.name}")
    self.facade.prepare_step()
    logits = self.facade.forward(lambda state: _jit_forward(
        self.graphdef, self.config, self.params, state, padded))
    return np.asarray(logits[:n])
