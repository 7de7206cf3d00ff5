"""`EngineCore`: the one owner of an engine's `LoopState` and of the programs run over it.

It holds the model's parameters, the compiled loop entries (the general one and
the plain-greedy one, `loop.serve_loop`) and the loop state; every change to
the state is one of its verbs, each donating the state to a jitted program and
keeping what it returns:

- `start` allocates a fresh state for a packed queue (`state.init_loop_state`)
  and `drop` frees it; `grow_for` grows flat rows for the requests to come;
- `enter` runs one loop entry of at most `max_steps` steps; `step` runs one
  step with no host-synchronised control flow (dispatched ahead of the device)
  and `admit` the entry's retire / admit / fork block alone;
- `enqueue` and `abort_rows` append requests to the device queue and remove
  what aborted requests hold (`live_ops.py`), between entries;
- `snapshot` and `read` read the state back (a packed vector; any arrays of it, in one transfer).

Its clients (`Engine.run` in `offline.py`, the incremental API's `LiveQueue`
in `live.py`, and through it `AsyncEngine` and the HTTP front) decide what to
run and read; none of them holds or assigns the state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig, pure
from jaxkv._sharding import first_device, replicated
from jaxkv.serve import live_ops
from jaxkv.serve.loop import admit_block, serve_loop, serve_step
from jaxkv.serve.memory import _grown_rows
from jaxkv.serve.state import HostQueue, LoopState, init_loop_state


def _split_placed(model, mesh):
  """`(graphdef, params)`, the params placed on `mesh` by their sharding metadata."""
  from jaxkv.nnx import shard_state, split_model   # pylint: disable=g-import-not-at-top
  graphdef, params = split_model(model)
  return graphdef, (params if mesh is None else shard_state(params, mesh))


class EngineCore:
  """The loop state of one engine and the jitted verbs over it (module docstring).

  Args:
    model: the `StepModel` (already checked); its parameters are split off and
      placed (on `mesh` by their sharding metadata, or on `device`).
    config: the model's `CacheConfig`.
    widths: the step widths compiled into the loop.
    mesh, kv_axis, device: where the state lives (`Engine`'s arguments).
    prefix_cache: whether fresh states keep a prefix cache (paged storage).
    compiler_options: XLA options for the loop entries.
  """

  def __init__(self, model, config: CacheConfig, widths: Sequence[int], *, mesh, kv_axis: str,
               device, prefix_cache: bool, compiler_options: Mapping[str, object]):
    self.config, self.widths = config, tuple(widths)
    self.mesh, self.kv_axis, self.device = mesh, kv_axis, device
    self.prefix_cache = prefix_cache
    self.graphdef, self.params = _split_placed(model, mesh)
    if device is not None:
      self.params = jax.device_put(self.params, device)
    # The parameters travel as a flat list of arrays: flattening the model's nnx.State on
    # every loop entry is Python work per parameter, paid once per entry on the host.
    self._param_leaves, treedef = jax.tree.flatten(self.params)
    jit = functools.partial(jax.jit, donate_argnums=1,
                            compiler_options=dict(compiler_options) or None)
    # Looked up at construction, not import, so a test can wrap `serve_loop`
    # (chex.assert_max_traces). The static arguments are bound once: as jit static
    # arguments, the model's GraphDef would be hashed on every loop entry.
    loop_fn = serve_loop

    def entry(greedy):
      return jit(lambda leaves, ls, max_steps: loop_fn(
          self.graphdef, config, self.widths, jax.tree.unflatten(treedef, leaves), ls,
          max_steps, greedy=greedy))
    self._loop = entry(False)
    # A queue of plain greedy requests (the common offline case) runs a loop with no sampler
    # `lax.cond` (a host sync per step on a GPU); compiled on first use only.
    self._greedy_loop = entry(True)

    def one_step(which):
      return jit(lambda leaves, ls: step_fn(
          self.graphdef, config, self.widths, which, jax.tree.unflatten(treedef, leaves), ls))
    step_fn = serve_step
    self._steps = [one_step(w) for w in range(len(self.widths))]
    self._admit = jax.jit(functools.partial(admit_block, config), donate_argnums=0,
                          compiler_options=dict(compiler_options) or None)
    self._budgets: dict = {}   # max_steps -> its int32 scalar, made once (a dispatch each)
    self._state: LoopState | None = None

  @property
  def state(self) -> LoopState | None:
    """The current loop state (None before `start` and after `drop` or a failure); read only:
    the next verb donates it."""
    return self._state

  # ------------------------------------------------------------------ lifetime

  def start(self, host_queue: HostQueue, *, commit: bool = False) -> None:
    """A fresh loop state serving `host_queue`; the previous one is freed first (one cache at
    a time).

    Args:
      host_queue: the packed queue (`state.pack_queue`).
      commit: place the state on the engine's device now, as the loop's outputs are
        (jit keys its compiled code on whether each argument is committed: a state
        that later mixes committed and uncommitted arrays compiles the loop twice).
    """
    self._state = None
    state = init_loop_state(self.config, host_queue, num_widths=len(self.widths),
                            mesh=self.mesh, kv_axis=self.kv_axis,
                            prefix_cache=self.prefix_cache)
    self._state = self.place(state) if commit and self.mesh is None else state

  def drop(self) -> None:
    """Frees the loop state (its K/V go with it)."""
    self._state = None

  def grow_for(self, requests) -> None:
    """Grows flat rows once so that none of `requests` can hit NEEDS_ROWS in the loop."""
    config = self.config
    if not config.has_flat or config.page_size is not None:   # a paged pool never grows
      return
    ls = self._state
    current = next(ls.cache.k[l].shape[0] for l, layer in enumerate(config.layers)
                   if not layer.policy.is_ring)
    needed = max(len(r.prompt) + r.params.max_tokens - 1 for r in requests)
    if needed > current:
      # `pure.grow` runs on the host (it builds each grown layer in place on its devices).
      self._state = dataclasses.replace(
          ls, cache=pure.grow(config, ls.cache, _grown_rows(config, current, needed)))

  def place(self, tree):
    """`tree` committed where the loop state lives: replicated on the mesh, else on `device`
    or the first device."""
    if self.mesh is not None:
      return jax.device_put(tree, replicated(self.mesh))
    return jax.device_put(tree, first_device() if self.device is None else self.device)

  # ------------------------------------------------------------------ device verbs

  def apply(self, fn, *args) -> LoopState:
    """The state becomes `fn(state, *args)` (which may donate it); the new state.

    If `fn` raises, the state is gone (None): it may have been donated."""
    ls, self._state = self._state, None
    self._state = fn(ls, *args)
    return self._state

  def enter(self, max_steps: int, *, greedy: bool = False) -> LoopState:
    """One loop entry of at most `max_steps` steps; the new loop state.

    Args:
      max_steps: the entry's step budget.
      greedy: run the loop without the sampler (every request in the state is plain greedy).
    """
    budget = self._budgets.get(max_steps)
    if budget is None:
      budget = self._budgets[max_steps] = jnp.int32(max_steps)
    loop = self._greedy_loop if greedy else self._loop
    return self.apply(lambda ls: loop(self._param_leaves, ls, budget))

  def step(self, which: int):
    """One greedy step at width `widths[which]` (`loop.serve_step`): no loop and no branch, so
    on a GPU the call returns before the device runs it.

    Returns:
      A device scalar (the step counter after it) that is ready once the step has run.
    """
    fn = self._steps[which]
    ls, self._state = self._state, None
    self._state, marker = fn(self._param_leaves, ls)
    return marker

  def admit(self) -> LoopState:
    """The loop's retire / admit / fork block alone (`loop.admit_block`); the new loop state.

    It returns once the device has run it (its loops read their predicates back)."""
    return self.apply(self._admit)

  def enqueue(self, tokens, arrays: dict, num: int) -> None:
    """Appends `num` packed requests to the device queue (`live_ops.enqueue_batches`' batches)."""
    self.apply(live_ops.enqueue, *self.place((tokens, arrays, np.int32(num))))

  def abort_rows(self, column_rows, queue_rows) -> None:
    """Removes the columns writing to `column_rows` and the queued requests whose first output
    row is in `queue_rows` (both `bool[R]` host arrays; `live_ops.abort_rows`)."""
    self.apply(functools.partial(live_ops.abort_rows, self.config),
                *self.place((column_rows, queue_rows)))

  # ------------------------------------------------------------------ reading back

  def snapshot(self, window: int):
    """The packed read-back of the current state (`live_ops.snapshot`), a device array; read
    it with `live_ops.unpack_snapshot` while later verbs run."""
    return live_ops.snapshot(self._state, window)

  def read(self, pick):
    """`pick(state)` (a pytree of the state's arrays) on the host, in one transfer."""
    return jax.device_get(pick(self._state))

  def lower(self, ls: LoopState, max_steps: int, *, greedy: bool = False):
    """The `jax.stages.Lowered` loop entry `enter` would run on `ls` (for HLO inspection)."""
    loop = self._greedy_loop if greedy else self._loop
    return loop.lower(self._param_leaves, ls, jnp.int32(max_steps))
