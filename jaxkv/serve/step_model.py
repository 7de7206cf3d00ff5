"""`StepModel`: what a model must offer to be served by `Engine` (and driven by `ModelRunner`).

A step model is a Flax NNX module with

- `cache_config`: the `jaxkv.CacheConfig` of its cache (one layer per attention layer);
- `vocab_size`: the size of its token vocabulary (ids are checked against it);
- `__call__(tokens, state, *, rows)`: one cache step. `tokens` is `int32[w]`
  (the step's width: `W`, or less inside `jaxkv.pure.run_narrow`), `state` a
  `CacheState` whose step is prepared, `rows` `int32[R]` step-token indices.
  It returns `(logits float32[R, vocab_size], new_state)`: the logits of the
  tokens at `rows`, and the state after every layer's `jaxkv.pure.attend`.

`jaxkv.models.Decoder` follows it. `check_step_model` checks a model once,
abstractly (`jax.eval_shape`, nothing is computed), so a model that breaks the
protocol is refused at construction with the broken part named, not with a
shape error from inside the jitted loop.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig, CacheState, init_state, pure


@runtime_checkable
class StepModel(Protocol):
  cache_config: CacheConfig
  vocab_size: int

  def __call__(self, tokens, state: CacheState, *, rows=None): ...


def check_step_model(model, *, width: int | None = None) -> tuple[CacheConfig, int]:
  """Checks `model` against the `StepModel` protocol; returns `(cache_config, vocab_size)`.

  Raises:
    TypeError: a missing or mistyped attribute, or a step whose outputs are
      not `(float32[R, vocab_size], CacheState)` of the input state's structure.
  """
  name = type(model).__name__
  config = getattr(model, "cache_config", None)
  if not isinstance(config, CacheConfig):
    raise TypeError(f"model={name} must have a `cache_config` that is a jaxkv.CacheConfig; "
                    f"got {type(config).__name__}")
  vocab = getattr(model, "vocab_size", None)
  if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or vocab < 1:
    raise TypeError(f"model={name} must have an int `vocab_size` >= 1; got {vocab!r}")
  if not callable(model):
    raise TypeError(f"model={name} must be callable as model(tokens, state, rows=rows)")
  width = config.step_width if width is None else width
  from jaxkv.nnx import merge_model, split_model   # pylint: disable=g-import-not-at-top
  graphdef, params = split_model(model)

  def one_step(params, state):
    state, _, _ = pure.seq_new(config, state)
    ids = jnp.full((config.step_width,), config.max_seqs, jnp.int32).at[0].set(0)
    state, _ = pure.declare_step(config, state, ids, jnp.int32(1),
                                 jnp.zeros((config.step_width, 2), jnp.int32))
    state, _ = pure.prepare_step(config, state)
    rows = jnp.zeros((config.max_seqs,), jnp.int32)
    m = merge_model(graphdef, params)
    return pure.run_narrow(config, state, width,
                           lambda s: m(jnp.zeros((width,), jnp.int32), s, rows=rows))

  state = jax.eval_shape(lambda: init_state(config))
  try:
    logits, new_state, _ = jax.eval_shape(one_step, params, state)
  except Exception as e:   # pylint: disable=broad-except  (any failure: name the protocol)
    raise TypeError(f"model={name} does not follow the step protocol "
                    f"(model(tokens int32[{width}], state, rows=int32[{config.max_seqs}])): "
                    f"{type(e).__name__}: {e}") from e
  want = (config.max_seqs, int(vocab))
  if getattr(logits, "shape", None) != want or getattr(logits, "dtype", None) != jnp.float32:
    raise TypeError(f"model={name} must return float32{list(want)} logits for "
                    f"rows=int32[{config.max_seqs}]; got {logits}")
  if jax.tree.structure(new_state) != jax.tree.structure(state):
    raise TypeError(f"model={name} must return the CacheState it was given (updated)")
  return config, int(vocab)
