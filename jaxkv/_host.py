"""`BatchedSequenceCache`: the host facade over the pure verbs (CONTRACT §10.5).

It holds the current `CacheState`, turns Python arguments into fixed-shape int32
arrays, runs the jitted pure verbs with the state donated, and maps statuses to
results: a refusal is `None`/`False` with the state unchanged; NO_DECLARATION,
BAD_POSITIONS, NOT_PREPARED and NOT_ATTENDED raise `StepError`. Flat growth happens here, on
the host, before the jitted prepare.
"""

from __future__ import annotations

import collections.abc
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import _verbs
from jaxkv._attend import attend as _pure_attend, static_validate_scale
from jaxkv._config import CacheConfig
from jaxkv._state import CacheState, Phase, Status, Step, StepError, flat_rows, init_state
from jaxkv._validate import static_validate_attend, static_validate_implementation

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_STEP_ERRORS = (Status.NO_DECLARATION, Status.BAD_POSITIONS, Status.NOT_PREPARED,
                Status.NOT_ATTENDED)


def _jit_verb(fn, **kwargs):
  """Jits a pure verb with the config static and the state donated (positionally)."""
  return jax.jit(fn, static_argnums=0, donate_argnums=1, **kwargs)


_seq_new = _jit_verb(_verbs.seq_new)
_seq_clone = _jit_verb(_verbs.seq_clone)
_seq_rm = _jit_verb(_verbs.seq_rm)
_rewind = _jit_verb(_verbs.rewind)
_clear = _jit_verb(_verbs.clear)
_declare_step = _jit_verb(_verbs.declare_step)
_prepare_step = _jit_verb(_verbs.prepare_step)
_commit_step = _jit_verb(_verbs.commit_step)
_attend = jax.jit(_pure_attend, static_argnums=(0, 2), donate_argnums=1,
                  static_argnames=("scale", "implementation", "mesh", "kv_axis"))
_rows_needed = jax.jit(_verbs.rows_needed, static_argnums=0)


def _allocate_rows(array, rows: int):
  """The one allocation behind flat growth; tests inject failures here."""
  return _verbs.grown_array(array, rows)


def _as_int(name: str, value) -> int:
  """A Python int from an int-like value, else TypeError naming the argument."""
  if isinstance(value, (bool, np.bool_)) or isinstance(value, float):
    raise TypeError(f"{name}={value!r} must be an int")
  try:
    return operator.index(value)
  except TypeError as e:
    raise TypeError(f"{name}={value!r} must be an int") from e


def _as_list(name: str, value) -> list:
  """The items of a sequence argument, else TypeError naming it."""
  # bytes would iterate as small ints; a str fails item by item, naming the item.
  # A dict would iterate its keys and a set in no defined order: neither is a
  # list of ids in step order, whatever its contents.
  if (isinstance(value, (bytes, bytearray, collections.abc.Mapping, collections.abc.Set))
      or not hasattr(value, "__iter__")):
    raise TypeError(f"{name}={value!r} must be a sequence (list, tuple or 1-D array); got "
                    f"{type(value).__name__}")
  return list(value)


def _as_array(name: str, value):
  """An array from an array (or nested list), else TypeError naming it.

  The dtype and shape are checked by `static_validate_attend` (a StepError).
  """
  if isinstance(value, (jax.Array, np.ndarray)):
    array = value
  elif isinstance(value, (list, tuple)):
    array = np.asarray(value)
  else:
    raise TypeError(f"{name} must be an array; got {type(value).__name__}")
  return jnp.asarray(array)


def _as_scale(scale):
  """A finite positive float or None; TypeError (wrong kind) or ValueError naming `scale`."""
  if scale is None:
    return None
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.number)):
    raise TypeError(f"scale={scale!r} must be a Python float or None")
  return static_validate_scale(scale)


def _clamp32(value: int) -> int:
  """Clamps to int32: out-of-range ids and positions stay invalid after the cast."""
  return min(max(value, _INT32_MIN), _INT32_MAX)


def _status(x) -> Status:
  return Status(int(x))


class BatchedSequenceCache:
  """Many sequences' K/V in one cache, with the verbs of ExecuTorch's batched cache.

  Each call runs a jitted pure verb with the state donated, so a `CacheState` read
  from `state` is valid only until the next call (copy it with
  `jax.tree.map(jnp.copy, ...)` to keep it).

  Args:
    config: the `CacheConfig`.
    implementation: `None` (Mosaic GPU kernels on Hopper, else the reference),
      `"reference"`, `"mosaic_gpu"` or `"interpret"`.
    mesh: optional `jax.sharding.Mesh`: K/V are split over their KV-head axis
      along `kv_axis` (which must divide every layer's `n_kv_heads`), control
      values are replicated, and the kernels run per shard.
    kv_axis: the mesh axis that splits KV heads.
    row_multiple: flat growth rounds the new row count up to a multiple of this
      (capped at capacity); the Mosaic GPU kernels want multiples of 128.
  """

  def __init__(self, config: CacheConfig, *, implementation: str | None = None,
               mesh=None, kv_axis: str = "tp", row_multiple: int = 1):
    if not isinstance(config, CacheConfig):
      raise TypeError(f"config={config!r} must be a CacheConfig")
    static_validate_implementation(implementation)
    self._row_multiple = _as_int("row_multiple", row_multiple)
    if self._row_multiple < 1:
      raise ValueError(f"row_multiple={row_multiple} must be >= 1")
    self._config = config
    self._implementation = implementation
    self._mesh, self._kv_axis = mesh, kv_axis
    self._state = init_state(config, mesh=mesh, kv_axis=kv_axis)
    self._last_status: Status | None = None

  # Queries -----------------------------------------------------------------

  @property
  def last_status(self) -> Status | None:
    """The `Status` of the last `seq_new`/`seq_clone`/`seq_rm`/`rewind`/`declare_step`
    (None before any), so a caller can say why a `None`/`False` was refused."""
    return self._last_status

  def _record(self, status) -> Status:
    self._last_status = _status(status)
    return self._last_status

  @property
  def state(self) -> CacheState:
    """The current state; invalid after the next call (it is donated)."""
    return self._state

  @property
  def config(self) -> CacheConfig:
    return self._config

  def max_seqs(self) -> int:
    return self._config.max_seqs

  def capacity(self) -> int:
    return self._config.capacity

  def is_live(self, seq_id) -> bool:
    """Whether `seq_id` is a live sequence (False for any id out of range)."""
    seq_id = _as_int("seq_id", seq_id)
    return 0 <= seq_id < self._config.max_seqs and bool(self._state.live[seq_id])

  def pos(self, seq_id) -> int:
    """Committed length of `seq_id`; 0 for any id that is not live."""
    return int(self._state.pos[seq_id]) if self.is_live(seq_id) else 0

  def hw(self, seq_id) -> int:
    """High-water mark of `seq_id`; 0 for any id that is not live."""
    return int(self._state.hw[seq_id]) if self.is_live(seq_id) else 0

  def floor(self, seq_id) -> int:
    """Lowest length `rewind`/`seq_clone` accept for `seq_id` (CONTRACT §4.2)."""
    if not self.is_live(seq_id):
      return 0
    return int(_verbs.floor(self._config, self._state, seq_id))

  # Sequence verbs ----------------------------------------------------------

  def seq_new(self) -> int | None:
    """Makes the lowest free id live at position 0; None when every id is live."""
    self._state, status, seq_id = _seq_new(self._config, self._state)
    return int(seq_id) if self._record(status) == Status.OK else None

  def seq_clone(self, src, upto=None) -> int | None:
    """Forks `src`'s first `min(upto, pos(src))` positions; None on refusal."""
    src = _clamp32(_as_int("src", src))
    upto = _verbs.WHOLE if upto is None else _clamp32(_as_int("upto", upto))
    self._state, status, seq_id = _seq_clone(
        self._config, self._state, jnp.int32(src), jnp.int32(upto))
    return int(seq_id) if self._record(status) == Status.OK else None

  def seq_rm(self, seq_id) -> bool:
    """Removes a live sequence and releases its budget; False if not live."""
    seq_id = _clamp32(_as_int("seq_id", seq_id))
    self._state, status = _seq_rm(self._config, self._state, jnp.int32(seq_id))
    return self._record(status) == Status.OK

  def rewind(self, seq_id, position) -> bool:
    """Keeps positions `[0, position)`; False when not live, out of range or below the floor
    (or, paged, with no free page for its copy on write: CONTRACT §3.1)."""
    seq_id = _clamp32(_as_int("seq_id", seq_id))
    position = _clamp32(_as_int("position", position))
    self._state, status = _rewind(self._config, self._state, jnp.int32(seq_id),
                                  jnp.int32(position))
    return self._record(status) == Status.OK

  def clear(self) -> None:
    """Drops every sequence and the step; storage keeps its shape and bytes."""
    self._state, _ = _clear(self._config, self._state)

  # The step protocol -------------------------------------------------------

  def declare_step(self, seq_ids, owner_blocks=None) -> bool:
    """Declares the next step's tokens (CONTRACT §6.2, §9); False on refusal."""
    width = self._config.step_width
    ids = [_clamp32(_as_int(f"seq_ids[{i}]", s))
           for i, s in enumerate(_as_list("seq_ids", seq_ids))]
    blocks = self._block_rows(owner_blocks)
    if blocks is None:
      return False
    padded = np.full((width,), self._config.max_seqs, np.int32)
    padded[:min(len(ids), width)] = ids[:width]
    self._state, status = _declare_step(
        self._config, self._state, jnp.asarray(padded), jnp.int32(min(len(ids), _INT32_MAX)),
        jnp.asarray(blocks))
    return self._record(status) == Status.OK

  def _block_rows(self, owner_blocks):
    """`int32[W, 2]` block rows, or None when the blocks cannot be valid at all."""
    width = self._config.step_width
    rows = np.zeros((width, 2), np.int32)
    blocks = [] if owner_blocks is None else _as_list("owner_blocks", owner_blocks)
    if len(blocks) > width:
      return None   # at most one block per owner, each of >= 1 of <= W tokens
    for i, block in enumerate(blocks):
      try:
        start, length = block
      except (TypeError, ValueError) as e:
        raise TypeError(f"owner_blocks[{i}]={block!r} must be a (start, length) pair") from e
      start = _clamp32(_as_int(f"owner_blocks[{i}] start", start))
      length = _clamp32(_as_int(f"owner_blocks[{i}] length", length))
      # Length 0 marks an unused row in the pure API; a caller's empty block is
      # invalid, so it travels as -1.
      rows[i] = (start, length if length != 0 else -1)
    return rows

  def prepare_step(self, positions=None) -> Step:
    """Fixes positions and the Step, growing flat rows first if needed (CONTRACT §6.3).

    Returns:
      A copy of the prepared `Step` (`W`-sized int32 arrays): it stays valid
      after later calls, which donate the state it was read from.

    Raises:
      StepError: no declaration stands (IDLE/COMMITTED), or `positions` does not
        match the derived ones; nothing changes.
    """
    positions_arr = None if positions is None else self._positions_array(positions)
    self._state, status = _prepare_step(self._config, self._state, positions_arr)
    if _status(status) == Status.NEEDS_ROWS:
      self._grow_for_declaration()
      self._state, status = _prepare_step(self._config, self._state, positions_arr)
    self._raise_step_error(status, "prepare_step")
    # `state.step` is a leaf of the state the next verb donates (its buffers are
    # then deleted); the copy is a few W-sized arrays.
    return jax.tree.map(jnp.copy, self._state.step)

  def _positions_array(self, positions):
    phase = Phase(int(self._state.phase))
    if phase not in (Phase.DECLARED, Phase.PREPARED):
      raise StepError(f"prepare_step needs a declaration; phase is {phase.name}",
                      Status.NO_DECLARATION)
    n = int(self._state.decl_n)
    values = [_as_int(f"positions[{i}]", p)
              for i, p in enumerate(_as_list("positions", positions))]
    if len(values) != n or any(not _INT32_MIN <= p <= _INT32_MAX for p in values):
      raise StepError(f"positions must hold exactly n={n} int32 entries; got "
                      f"{len(values)}", Status.BAD_POSITIONS)
    padded = np.zeros((self._config.step_width,), np.int32)
    padded[:n] = values
    return jnp.asarray(padded)

  def _grow_for_declaration(self) -> None:
    """Grows every flat layer to `min(max_flat_rows, max(required, 2F))` rounded up
    to `row_multiple`, transactionally (`max_flat_rows`: `capacity`, or
    `max_seq_len` when set)."""
    required = int(_rows_needed(self._config, self._state))
    current = flat_rows(self._config, self._state)
    multiple = self._row_multiple
    rows = min(self._config.max_flat_rows, -(-max(required, 2 * current) // multiple) * multiple)
    # Looked up at call time, so a test that replaces `_allocate_rows` is honoured.
    self._state = _verbs.grow(self._config, self._state, rows,
                              allocate=lambda a, r: _allocate_rows(a, r))

  def attend(self, layer, q, k, v, scale=None):
    """Writes this layer's K/V for the step's real tokens, then attends (CONTRACT §6.4).

    Args:
      layer: layer id.
      q: `[T, H_q, D]`; k, v: `[T, n_kv_heads, D]`; `T` is `n` or `W`.
      scale: softmax scale; None means `1/sqrt(head_dim)`.

    Returns:
      `[T, H_q, D]` in `q.dtype`; with `T = W`, rows `n..W-1` are unspecified.

    Raises:
      StepError: not PREPARED, a bad layer id, or inconsistent shapes.
    """
    q, k, v = (_as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    scale = _as_scale(scale)
    self._check_attend(layer, q, k, v)
    num_tokens, width = q.shape[0], self._config.step_width
    if num_tokens != width:
      pad = lambda x: jnp.pad(x, ((0, width - num_tokens), (0, 0), (0, 0)))
      q, k, v = pad(q), pad(k), pad(v)
    self._state, out, status = _attend(self._config, self._state, int(layer), q, k, v,
                                       scale=scale,
                                       implementation=self._implementation,
                                       mesh=self._mesh, kv_axis=self._kv_axis)
    self._raise_step_error(status, "attend")
    return out[:num_tokens]

  def _check_attend(self, layer, q, k, v) -> None:
    """Validates an attend call on the host; raises StepError naming the problem."""
    phase = Phase(int(self._state.phase))
    if phase != Phase.PREPARED:
      raise StepError(f"attend needs a prepared step; phase is {phase.name}",
                      Status.NOT_PREPARED)
    n, width = int(self._state.step.n_tokens), self._config.step_width
    shapes_ok = all(x.ndim == 3 for x in (q, k, v))
    if not shapes_ok or not q.shape[0] == k.shape[0] == v.shape[0]:
      raise StepError(f"q, k and v must be rank 3 with one token count; got {q.shape=}, "
                      f"{k.shape=}, {v.shape=}", Status.NOT_PREPARED)
    if q.shape[0] not in (n, width):
      raise StepError(f"T={q.shape[0]} must be n={n} or W={width}", Status.NOT_PREPARED)
    try:
      static_validate_attend(self._config, layer, q, k, v, width=q.shape[0])
    except ValueError as e:
      raise StepError(str(e), Status.NOT_PREPARED) from e

  def commit_step(self) -> None:
    """Advances every causal segment's sequence (CONTRACT §6.5); a second commit is a no-op.

    Raises:
      StepError: no prepared step (IDLE or DECLARED: NOT_PREPARED), or a layer
        was not attended since `prepare_step` (NOT_ATTENDED); nothing changes.
    """
    self._state, status = _commit_step(self._config, self._state)
    self._raise_step_error(status, "commit_step")

  def forward(self, fn):
    """Serves the prepared step's layers with `fn`, then commits (CONTRACT §6.4, §6.5).

    For a model that attends through the pure API (`jaxkv.nnx.CachedAttention`)
    in one jitted forward: `fn(state) -> (state, out)` takes the PREPARED state
    (donate it) and returns the new state after attending every layer.

    Returns:
      `out`.

    Raises:
      StepError: no prepared step (nothing runs), or the commit is refused
        (NOT_ATTENDED: `fn` skipped a layer; the step stays prepared).
      TypeError: `fn` did not return `(CacheState, out)`.
    """
    phase = Phase(int(self._state.phase))
    if phase != Phase.PREPARED:
      raise StepError(f"forward needs a prepared step; phase is {phase.name}",
                      Status.NOT_PREPARED)
    result = fn(self._state)
    if not (isinstance(result, tuple) and len(result) == 2
            and isinstance(result[0], CacheState)):
      raise TypeError(f"fn must return (CacheState, out); got {type(result).__name__}")
    self._state, out = result
    self.commit_step()
    return out

  @staticmethod
  def _raise_step_error(status, verb: str) -> None:
    status = _status(status)
    if status in _STEP_ERRORS:
      raise StepError(f"{verb} refused", status)
    assert status == Status.OK, f"{verb} returned {status.name}"
