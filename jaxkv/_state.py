"""The cache state pytree, the step encoding and the status codes (CONTRACT §7, §10.2–§10.4)."""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp

from jaxkv._config import CacheConfig
from jaxkv._memory import check_state_fits
from jaxkv._sharding import kv_sharding, replicated, validate_mesh
from pallas_kernels import indexing


class Status(enum.IntEnum):
  """Result of a pure verb, returned as int32. Values are stable; new codes are appended."""

  OK = 0
  NOT_LIVE = 1
  NO_ROOM = 2
  NO_FREE_ID = 3
  EMPTY = 4
  TOO_WIDE = 5
  BAD_BLOCKS = 6
  BAD_TARGET = 7
  BELOW_FLOOR = 8
  NO_DECLARATION = 9
  BAD_POSITIONS = 10
  NEEDS_ROWS = 11
  NOT_PREPARED = 12
  NOT_ATTENDED = 13
  TOO_LONG = 14


class Phase(enum.IntEnum):
  """Step phase (CONTRACT §6.1)."""

  IDLE = 0
  DECLARED = 1
  PREPARED = 2
  COMMITTED = 3


class StepError(ValueError):
  """An ill-formed step: no declaration, positions that do not continue, wrong phase."""

  def __init__(self, message: str, status: Status):
    super().__init__(f"{message} ({status.name})")
    self.status = status


def _array_fields(cls):
  """Registers a frozen dataclass whose fields are all pytree leaves."""
  names = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


@_array_fields
@dataclasses.dataclass(frozen=True, slots=True)
class Step:
  """The arrays `prepare_step` builds for one step; every layer reads them.

  All fields are int32 of static shape; `W` is the step width, `L` the layer count.

  Attributes:
    n_tokens: `[]` real tokens `n`; tokens `n..W-1` are padding.
    n_segments: `[]` real rows of `seq_info`.
    seq_cols: `[W]` column of each token; padding -> `max_seqs` (scratch).
    positions: `[W]` logical position of each token; padding -> 0.
    write_rows: `[L, W]` row of each token per layer (flat: position; ring:
      position mod rows); padding -> 0.
    seq_info: `[W, 5]` segment table `(q_start, q_len, col, pos0, kind)`; rows
      `[0, n_segments)` are real, in step order; padded rows are
      `[n, 0, max_seqs, 0, 0]`.

  Example (`max_seqs = 4`, `W = 8`, `a` = column 0 at 5, `b` = column 1 at 0,
  `declare_step([a, a, b, a])`)::

    positions = [5, 6, 0, 7, 0, 0, 0, 0]
    seq_cols  = [0, 0, 1, 0, 4, 4, 4, 4]
    seq_info  = [[0, 2, 0, 5, 0], [2, 1, 1, 0, 0], [3, 1, 0, 7, 0],
                 [4, 0, 4, 0, 0] x 5]
  """

  n_tokens: jax.Array
  n_segments: jax.Array
  seq_cols: jax.Array
  positions: jax.Array
  write_rows: jax.Array
  seq_info: jax.Array


@_array_fields
@dataclasses.dataclass(frozen=True, slots=True)
class CacheState:
  """The whole cache as an immutable pytree of arrays (CONTRACT §10.2).

  Every jitted verb donates it and returns every leaf; after a call the old state
  must not be used.

  Attributes:
    k, v: tuples of `L` arrays `[rows_l, max_seqs + 1, n_kv_heads_l, head_dim_l]`
      of `kv_dtype`. Flat layers share one row count `F`; ring layers have
      `min(capacity, window + max_write - 1)` rows. Column `max_seqs` is scratch.
    live, pos, hw: `int32[max_seqs]` liveness (0/1), committed length and
      high-water mark; non-live columns hold 0.
    held: `int32[]` sum of `pos` over live sequences.
    phase: `int32[]` a `Phase`.
    decl_ids: `int32[W]` standing declaration (`max_seqs` where unused).
    decl_block: `int32[W]` 1 where the declared token belongs to an owner block.
    decl_n: `int32[]` declared token count.
    attended: `int32[L]` 1 for each layer served (`attend`) since the step was
      prepared; `commit_step` refuses (NOT_ATTENDED) unless every entry is 1.
    step: the `Step`, meaningful in PREPARED and COMMITTED.
    page_table: paged storage only (else None): `int32[max_seqs + 1,
      max_pages_per_seq]`, entry `[c, j]` the pool page holding positions
      `[j * page_size, (j + 1) * page_size)` of column `c`; unheld entries and the
      whole scratch row hold `scratch_page` (CONTRACT §3.1).
    page_refs: paged storage only (else None): `int32[num_pages]`, how many
      page-table entries of live columns hold each page (0 = free; the scratch
      page stays 0 and is never handed out).
    k_scale, v_scale: fp8 storage only (else None): tuples of `L` arrays
      `float32[n_kv_heads_l]`, each layer's per-head scales of K and of V
      (0 = unset; set by the first write that meets the head, then fixed;
      CONTRACT §3.2).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  live: jax.Array
  pos: jax.Array
  hw: jax.Array
  held: jax.Array
  phase: jax.Array
  decl_ids: jax.Array
  decl_block: jax.Array
  decl_n: jax.Array
  attended: jax.Array
  step: Step
  page_table: jax.Array | None = None
  page_refs: jax.Array | None = None
  k_scale: tuple[jax.Array, ...] | None = None
  v_scale: tuple[jax.Array, ...] | None = None


def empty_step(config: CacheConfig) -> Step:
  """A Step with no real token: every row padded."""
  width, num_layers = config.step_width, config.num_layers
  pad_row = indexing.pad_segment_row(0, config.scratch_col)
  return Step(
      n_tokens=jnp.zeros((), jnp.int32),
      n_segments=jnp.zeros((), jnp.int32),
      seq_cols=jnp.full((width,), config.scratch_col, jnp.int32),
      positions=jnp.zeros((width,), jnp.int32),
      write_rows=jnp.zeros((num_layers, width), jnp.int32),
      seq_info=jnp.tile(pad_row[None, :], (width, 1)),
  )


@functools.lru_cache(maxsize=256)
def _zeros_fn(shape, dtype, sharding):
  # One compiled program per (shape, dtype, sharding): a fresh `jax.jit` of a
  # fresh lambda missed jax's cache and recompiled on every `init_state` (every
  # `Engine.run` on a mesh paid several compilations inside its timed serving).
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding):
  """A zero array created directly with `sharding` (no single-device staging copy)."""
  if sharding is None:
    return jnp.zeros(shape, dtype)
  return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


def init_state(config: CacheConfig, *, mesh=None, kv_axis: str = "tp") -> CacheState:
  """Zeroed storage with `F = initial_flat_rows`, zero control values, phase IDLE.

  With `config.page_size` set, every flat layer is a zeroed page pool instead, all
  pages free, and every page-table entry points at the scratch page.

  Args:
    config: the `CacheConfig`.
    mesh: optional `jax.sharding.Mesh`; K/V are then split over their KV-head
      axis along `kv_axis` and every control value is replicated.
    kv_axis: the mesh axis that splits KV heads.

  Raises:
    ValueError: `kv_axis` is not a mesh axis, or it does not divide some layer's
      `n_kv_heads`; or the state would not fit in the device's free memory
      (checked before allocating; the message gives the byte formula).
  """
  if not isinstance(config, CacheConfig):
    raise TypeError(f"config={config!r} must be a CacheConfig")
  validate_mesh(config, mesh, kv_axis)
  check_state_fits(config, config.initial_flat_rows,
                   shards=1 if mesh is None else int(mesh.shape[kv_axis]),
                   device=None if mesh is None else mesh.devices.flat[0])
  if mesh is None:
    # One compiled call makes every leaf: created op by op they were ~40 dispatches,
    # each a host round of work before the serving loop could start.
    return _fresh_state_fn(config)()
  kv = kv_sharding(mesh, kv_axis)
  state = _fresh_state(config, kv)
  control = jax.device_put(dataclasses.replace(state, k=(), v=()), replicated(mesh))
  return dataclasses.replace(control, k=state.k, v=state.v)


@functools.lru_cache(maxsize=32)
def _fresh_state_fn(config: CacheConfig):
  return jax.jit(functools.partial(_fresh_state, config, None))


def _fresh_state(config: CacheConfig, kv) -> CacheState:
  """The empty state's leaves (jittable with `kv` None); K/V sharded by `kv` if given."""
  shapes = [config.layer_shape(l, config.initial_flat_rows) for l in range(config.num_layers)]
  # Distinct buffers per leaf: the state is donated leaf by leaf (XLA gives every
  # output of a computation its own buffer, equal values included).
  zeros_i = lambda: jnp.zeros((config.max_seqs,), jnp.int32)
  # fp8: every scale unset (0) until a write meets its head (CONTRACT §3.2).
  scales = lambda: (tuple(jnp.zeros((layer.n_kv_heads,), jnp.float32) for layer in config.layers)
                    if config.is_fp8 else None)
  return CacheState(
      k=tuple(_zeros(s, config.kv_dtype, kv) for s in shapes),
      v=tuple(_zeros(s, config.kv_dtype, kv) for s in shapes),
      live=zeros_i(),
      pos=zeros_i(),
      hw=zeros_i(),
      held=jnp.zeros((), jnp.int32),
      phase=jnp.asarray(Phase.IDLE, jnp.int32),
      decl_ids=jnp.full((config.step_width,), config.max_seqs, jnp.int32),
      decl_block=jnp.zeros((config.step_width,), jnp.int32),
      decl_n=jnp.zeros((), jnp.int32),
      attended=jnp.zeros((config.num_layers,), jnp.int32),
      step=empty_step(config),
      page_table=(jnp.full((config.max_seqs + 1, config.max_pages_per_seq),
                           config.scratch_page, jnp.int32) if config.is_paged else None),
      page_refs=jnp.zeros((config.num_pages,), jnp.int32) if config.is_paged else None,
      k_scale=scales(),
      v_scale=scales(),
  )


def flat_rows(config: CacheConfig, state: CacheState) -> int:
  """`F`, the flat layers' row count (0 when every layer is a ring).

  Paged flat layers address every position below `max_flat_rows` (`capacity`,
  or `max_seq_len` when set) through the page table, so that is their logical
  row count (they never grow).
  """
  if config.is_paged:
    return config.max_flat_rows
  for l, layer in enumerate(config.layers):
    if not layer.policy.is_ring:
      return state.k[l].shape[0]
  return 0
