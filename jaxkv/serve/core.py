"""`EngineCore`: the one owner of an engine's `LoopState` and of the programs run over it.

It holds the model's parameters, the compiled loop entries (the general one and
the plain-greedy one, `loop.serve_loop`; shared with every other engine of the same
kind in the process, `_Programs`) and the loop state; every change to
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

Between verbs the state is kept packed (`packing.py`: the small arrays as one vector
per dtype), and the stepping verbs run on it as it is: a step call then hands the
runtime a few dozen arrays instead of a hundred more (`benchmarks/dispatch.py`).

Its clients (`Engine.run` in `offline.py`, the incremental API's `LiveQueue`
in `live.py`, and through it `AsyncEngine` and the HTTP front) decide what to
run and read; none of them holds or assigns the state.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig, pure
from jaxkv._sharding import first_device, replicated
from jaxkv.serve import live_ops
from jaxkv.serve.loop import admit_block, serve_loop, serve_step
from jaxkv.serve.memory import _grown_rows
from jaxkv.serve.packing import Packing
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
    speculative: the `SpeculativeConfig` the loop entries draft and verify with (static in
      them), or None.
  """

  def __init__(self, model, config: CacheConfig, widths: Sequence[int], *, mesh, kv_axis: str,
               device, prefix_cache: bool, compiler_options: Mapping[str, object],
               speculative=None):
    self.config, self.widths = config, tuple(widths)
    self.speculative = speculative
    self.mesh, self.kv_axis, self.device = mesh, kv_axis, device
    self.prefix_cache = prefix_cache
    self.graphdef, self.params = _split_placed(model, mesh)
    if device is not None:
      self.params = jax.device_put(self.params, device)
    # The parameters travel as a flat list of arrays: flattening the model's nnx.State on
    # every loop entry is Python work per parameter, paid once per entry on the host.
    self._param_leaves, treedef = jax.tree.flatten(self.params)
    # Looked up at construction, not import, so a test can wrap `serve_loop`
    # (chex.assert_max_traces).
    programs = _Programs.shared(serve_loop, serve_step, self.graphdef, treedef, config,
                                self.widths, speculative, compiler_options)
    self._programs = programs   # held: the shared programs live while an engine uses them
    self._loop, self._greedy_loop = programs.loop, programs.greedy_loop
    self._budgets: dict = {}   # max_steps -> its int32 scalar, made once (a dispatch each)
    # The state between verbs: packed (`packing.py`), with the programs over that packing.
    self._packed = None
    self._verbs: _Verbs | None = None

  @property
  def state(self) -> LoopState | None:
    """The current loop state (None before `start` and after `drop` or a failure); read only:
    the next verb donates it. Unpacked on the device for each access: the verbs below
    take the packed state."""
    if self._packed is None:
      return None
    return self._verbs.unpack(self._packed)

  @property
  def started(self) -> bool:
    """Whether a loop state exists (`start` ran, and no `drop` or failure since)."""
    return self._packed is not None

  def _set(self, ls: LoopState | None) -> None:
    """Keeps `ls`, packed (the programs over its packing made once per packing)."""
    if ls is None:
      self._packed = None
      return
    self._verbs = self._programs.verbs(Packing.of(ls, enabled=self.mesh is None))
    self._packed = self._verbs.pack(ls)

  def _run(self, fn, *args):
    """`self._packed = fn(packed, *args)`; None (the state gone: it may have been donated)
    if `fn` raises."""
    packed, self._packed = self._packed, None
    self._packed = fn(packed, *args)

  # ------------------------------------------------------------------ lifetime

  def start(self, host_queue: HostQueue, *, commit: bool = False) -> None:
    """A fresh loop state serving `host_queue`; the previous one is freed first (one cache at
    a time).

    Args:
      host_queue: the packed queue (`state.pack_queue`).
      commit: with a mesh, place the state on it now, as the loop's outputs are (jit
        keys its compiled code on whether each argument is committed: a state that
        later mixes committed and uncommitted arrays compiles the loop twice). Without
        one the state is always placed: packing commits its small arrays.
    """
    self._packed = None
    state = init_loop_state(self.config, host_queue, num_widths=len(self.widths),
                            mesh=self.mesh, kv_axis=self.kv_axis,
                            prefix_cache=self.prefix_cache)
    # Packing commits the small arrays; the large ones are committed with them, so the
    # state never mixes the two.
    self._set(self.place(state) if self.mesh is None or commit else state)

  def drop(self) -> None:
    """Frees the loop state (its K/V go with it)."""
    self._packed = None

  def grow_for(self, requests) -> None:
    """Grows flat rows once so that none of `requests` can hit NEEDS_ROWS in the loop."""
    config = self.config
    if not config.has_flat or config.page_size is not None:   # a paged pool never grows
      return
    ls = self.state
    current = next(ls.cache.k[l].shape[0] for l, layer in enumerate(config.layers)
                   if not layer.policy.is_ring)
    needed = max(len(r.prompt) + r.params.max_tokens - 1 for r in requests)
    if needed > current:
      # `pure.grow` runs on the host (it builds each grown layer in place on its devices).
      self._set(dataclasses.replace(
          ls, cache=pure.grow(config, ls.cache, _grown_rows(config, current, needed))))

  def place(self, tree):
    """`tree` committed where the loop state lives: replicated on the mesh, else on `device`
    or the first device."""
    if self.mesh is not None:
      return jax.device_put(tree, replicated(self.mesh))
    return jax.device_put(tree, first_device() if self.device is None else self.device)

  # ------------------------------------------------------------------ device verbs

  def apply(self, fn, *args) -> LoopState:
    """The state becomes `fn(state, *args)` (which may donate it); the new state.

    If `fn` raises, the state is gone (None): it may have been donated. (The verbs
    below run their programs on the packed state instead: one unpack and one pack less.)"""
    ls = self.state
    self._packed = None
    out = fn(ls, *args)
    self._set(out)
    return out

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
    # Entries are long (many steps a call): the loop takes the state unpacked.
    return self.apply(lambda ls: loop(self._param_leaves, ls, budget))

  def step(self, which: int, *, greedy: bool = True):
    """One step at width `widths[which]` (`loop.serve_step`): no loop and no branch, so on a
    GPU the call returns before the device runs it.

    Args:
      which: the width's index.
      greedy: every request in flight is plain greedy (the step without the sampler).

    Returns:
      A device scalar (the step counter after it) that is ready once the step has run.
    """
    fn = self._verbs.steps[which, greedy]
    packed, self._packed = self._packed, None
    self._packed, marker = fn(self._param_leaves, packed)
    return marker

  def admit(self) -> None:
    """The loop's retire / admit / fork block alone (`loop.admit_block`).

    It returns once the device has run it (its loops read their predicates back)."""
    self._run(self._verbs.admit)

  def enqueue(self, tokens, arrays: dict, num: int) -> None:
    """Appends `num` packed requests to the device queue (`live_ops.enqueue_batches`' batches)."""
    self._run(self._verbs.enqueue, *self.place((tokens, arrays, np.int32(num))))

  def set_grammar(self, pool) -> None:
    """The state's grammar pool becomes `pool` (host arrays of the same shapes: the placed
    automata, `grammars.GrammarPlacer.pool`); copied, so the host may change its arrays after."""
    self._run(self._verbs.set_grammar, *self.place((type(pool)(*(np.array(a) for a in pool)),)))

  def abort_rows(self, column_rows, queue_rows) -> None:
    """Removes the columns writing to `column_rows` and the queued requests whose first output
    row is in `queue_rows` (both `bool[R]` host arrays; `live_ops.abort_rows`)."""
    self._run(self._verbs.abort_rows, *self.place((column_rows, queue_rows)))

  # ------------------------------------------------------------------ reading back

  def snapshot(self, window: int):
    """The packed read-back of the current state (`live_ops.snapshot`), a device array; read
    it with `live_ops.unpack_snapshot` while later verbs run."""
    return self._verbs.snapshot(self._packed, window)

  def read(self, pick):
    """`pick(state)` (a pytree of the state's arrays) on the host, in one transfer."""
    return jax.device_get(pick(self.state))

  def lower(self, ls: LoopState, max_steps: int, *, greedy: bool = False):
    """The `jax.stages.Lowered` loop entry `enter` would run on `ls` (for HLO inspection)."""
    loop = self._greedy_loop if greedy else self._loop
    return loop.lower(self._param_leaves, ls, jnp.int32(max_steps))


def _named(name: str, fn):
  """`fn`, named `name` in jax's compile log, profiles and HLO (a lambda is `<lambda>` there)."""
  fn.__name__ = fn.__qualname__ = name
  return fn


class _Programs:
  """The jitted programs of one kind of engine: its loop entries, and per state packing its verbs.

  Engines built over an equal model structure (graph and parameter tree), `CacheConfig`, step
  widths, speculation and compiler options run the same programs, so they share one `_Programs`
  (`shared`): a second such engine in the process (a data-parallel replica, a re-created
  `jaxkv.LLM`, the next test of a module) traces and compiles nothing its first one did. The
  programs close over that key's values only, never over an engine, so they keep no
  parameters or states alive. They live while an engine holds them, and the last `KEEP`
  kinds used also after that (an engine made, run and dropped, then made again, compiles once).
  """

  KEEP = 4
  _live: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
  _recent: "collections.OrderedDict" = collections.OrderedDict()

  def __init__(self, loop_fn, step_fn, graphdef, treedef, config: CacheConfig,
               widths: tuple, speculative, compiler_options: Mapping[str, object]):
    self.config, self.speculative = config, speculative
    self.compiler_options = dict(compiler_options) or None
    unflatten = self.unflatten = functools.partial(jax.tree.unflatten, treedef)
    # The static arguments are bound once: as jit static arguments, the model's GraphDef
    # would be hashed on every loop entry.
    jit = functools.partial(jax.jit, donate_argnums=1, compiler_options=self.compiler_options)

    def entry(greedy):
      return jit(_named("greedy_loop" if greedy else "loop", lambda leaves, ls, max_steps: loop_fn(
          graphdef, config, widths, unflatten(leaves), ls, max_steps, greedy=greedy,
          speculative=speculative)))
    self.loop = entry(False)
    # A queue of plain greedy requests (the common offline case) runs a loop with no sampler
    # `lax.cond` (a host sync per step on a GPU); compiled on first use only.
    self.greedy_loop = entry(True)
    # Per width, the greedy step and the sampled one (`serve_step`'s `greedy`).
    self.step_fns = {(w, greedy): functools.partial(step_fn, graphdef, config, widths, w,
                                                    greedy=greedy, speculative=speculative)
                     for w in range(len(widths)) for greedy in (True, False)}
    self._verbs: dict = {}

  @classmethod
  def shared(cls, loop_fn, step_fn, graphdef, treedef, config, widths, speculative,
             compiler_options) -> "_Programs":
    """The live `_Programs` of this key, or a new one (private if the key is unhashable)."""
    try:
      key = (loop_fn, step_fn, graphdef, treedef, config, tuple(widths), speculative,
             tuple(sorted(dict(compiler_options).items())))
      hash(key)
    except TypeError:   # an unhashable compiler option's value: nothing to share by
      return cls(loop_fn, step_fn, graphdef, treedef, config, widths, speculative,
                 compiler_options)
    programs = cls._live.get(key)
    if programs is None:
      programs = cls._live[key] = cls(loop_fn, step_fn, graphdef, treedef, config, widths,
                                      speculative, compiler_options)
    cls._recent[key] = programs
    cls._recent.move_to_end(key)
    while len(cls._recent) > cls.KEEP:
      cls._recent.popitem(last=False)
    return programs

  def verbs(self, packing: Packing) -> "_Verbs":
    """The verbs over states of `packing`, made on first use."""
    verbs = self._verbs.get(packing)
    if verbs is None:
      verbs = self._verbs[packing] = _Verbs(self, packing)
    return verbs


class _Verbs:
  """The jitted programs of one `Packing`: each unpacks the state, runs the verb, packs it.

  Made once per packing (an engine's state keeps one packing unless its rows grow), so
  their compiled code is reused across states of one shape."""

  def __init__(self, programs: _Programs, packing: Packing):
    jit = functools.partial(jax.jit, compiler_options=programs.compiler_options)
    unpack, pack = packing.unpack, packing.pack
    # On the host, the large arrays are passed around as they are: a jitted program copies
    # every array it returns, and these hold the K/V.
    vectors, smalls = jax.jit(packing.vectors), jax.jit(packing.smalls)

    def pack_host(ls):
      kept, small = packing.split(ls)
      return kept, vectors(small)

    self.pack = pack_host
    self.unpack = lambda packed: packing.join(packed[0], smalls(packed[1]))

    unflatten = programs.unflatten   # not `programs`: no cycle keeps them alive past their engines

    def stepping(w, greedy, fn):
      def run(leaves, packed):
        ls, marker = fn(unflatten(leaves), unpack(packed))
        return pack(ls), marker
      return jit(_named(f"{'greedy' if greedy else 'sampled'}_step_w{w}", run), donate_argnums=1)

    def verb(name, fn):
      return jit(_named(name, lambda packed, *args: pack(fn(unpack(packed), *args))),
                 donate_argnums=0)

    self.steps = {key: stepping(*key, fn) for key, fn in programs.step_fns.items()}
    self.admit = verb("admit", functools.partial(admit_block, programs.config))
    self.enqueue = verb("enqueue", live_ops.enqueue)
    self.abort_rows = verb("abort_rows", functools.partial(live_ops.abort_rows, programs.config))
    self.set_grammar = verb("set_grammar", lambda ls, pool: dataclasses.replace(ls, grammar=pool))
    speculates = programs.speculative is not None
    self.snapshot = jit(_named("snapshot", lambda packed, window: live_ops.snapshot(
        unpack(packed), window, speculates)), static_argnums=1)
