"""Static configuration: `LayerPolicy`, `LayerConfig`, `CacheConfig` (CONTRACT §2).

All three are frozen, hashable, value-compared dataclasses, so they can be static
`jit` arguments. `__post_init__` validates every field and raises `ValueError`
naming the field and its value (`TypeError` for the wrong kind of object).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fp8
from pallas_kernels import indexing

FLAT = "flat"
RING = "ring"
_MAX_INT32 = 2**31
_KV_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16)) + fp8.FP8_DTYPES


def _require_int(name: str, value: Any) -> None:
  if isinstance(value, jax.Array):
    raise TypeError(f"{name}={value!r} is an array; static config fields take Python ints")
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}={value!r} must be an int")


@dataclasses.dataclass(frozen=True, slots=True)
class LayerPolicy:
  """How a layer keeps history.

  Attributes:
    kind: `"flat"` (every position, `row = position`) or `"ring"` (a sliding window
      in `min(capacity, window + max_write - 1)` rows, `row = position % rows`).
    window: positions a ring query sees, itself included (`>= 1`); 0 for flat.
  """

  kind: str = FLAT
  window: int = 0

  def __post_init__(self):
    if self.kind not in (FLAT, RING):
      raise ValueError(f"kind={self.kind!r} must be 'flat' or 'ring'")
    _require_int("window", self.window)
    object.__setattr__(self, "window", int(self.window))
    if self.kind == RING and self.window < 1:
      raise ValueError(f"ring window={self.window} must be >= 1")
    if self.kind == FLAT and self.window != 0:
      raise ValueError(f"flat window={self.window} must be 0")

  @classmethod
  def flat(cls) -> "LayerPolicy":
    """A layer that keeps the whole history."""
    return cls(kind=FLAT, window=0)

  @classmethod
  def ring(cls, window: int) -> "LayerPolicy":
    """A sliding-window layer whose queries see `window` positions."""
    return cls(kind=RING, window=window)

  @property
  def is_ring(self) -> bool:
    return self.kind == RING


@dataclasses.dataclass(frozen=True, slots=True)
class LayerConfig:
  """One layer's policy and K/V geometry.

  Attributes:
    policy: a `LayerPolicy`.
    n_kv_heads: K/V heads of the layer (`>= 1`).
    head_dim: per-head dimension (`>= 1`).
  """

  policy: LayerPolicy
  n_kv_heads: int
  head_dim: int

  def __post_init__(self):
    if not isinstance(self.policy, LayerPolicy):
      raise TypeError(f"policy={self.policy!r} must be a LayerPolicy")
    for name in ("n_kv_heads", "head_dim"):
      value = getattr(self, name)
      _require_int(name, value)
      if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
      object.__setattr__(self, name, int(value))


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
  """The whole cache: layers, shared token budget, columns and step width.

  Attributes:
    layers: one `LayerConfig` per layer (position = layer id); stored as a tuple.
    capacity: shared token budget of all live sequences; also the flat row
      ceiling. `1 <= capacity < 2**31`.
    max_seqs: number of sequence columns (`>= 1`); column `max_seqs` is scratch.
    max_write: most tokens one step carries (the static step width `W`),
      `1 <= max_write <= capacity`: a step holds at most `capacity` tokens (its
      room check), so a wider one could never be declared and would only size
      the step arrays (and a ring's rows) past what the cache can hold.
    kv_dtype: storage dtype, canonicalised to a NumPy dtype (float32, bfloat16,
      float16, or the fp8 formats float8_e4m3fn and float8_e5m2, stored with one
      float32 scale per layer and KV head for K and for V: CONTRACT §3.2).
    initial_capacity: flat rows allocated at construction (`> 0`; clamped to
      `max_flat_rows`). None (the default) allocates `max_flat_rows` (the
      `capacity`, or `max_seq_len` when set), so a jitted loop never meets
      NEEDS_ROWS; it is resolved to that int here. The trade-off: unpaged flat
      layers then hold `max_flat_rows x (max_seqs + 1)` rows per layer from the
      start. A smaller value asks for growth: the facade grows on the host, but
      a pure loop must then grow (`jaxkv.pure.grow`) before entering the jit or
      stop on NEEDS_ROWS. Ignored by paged flat layers, whose pool is
      allocated whole.
    page_size: None (the default) stores each flat layer as columns
      `[rows, max_seqs + 1, H, D]`; an int `1 <= page_size <= capacity` stores
      each flat layer as a pool of `num_pages` pages `[num_pages, page_size, H, D]`
      addressed through the state's page table (CONTRACT §3.1). It need not
      divide `capacity`. Ring layers keep their per-sequence rows either way.
    max_seq_len: None (the default: `capacity`) or the most positions one
      sequence may hold, `1 <= max_seq_len <= capacity`. A step that would take
      a sequence past it is refused (TOO_LONG). It bounds the flat rows (columns
      grow to at most `max_seq_len` rows) and sizes the page table
      (`ceil(max_seq_len / page_size)` slots per sequence), which sizes the
      attention kernels' key splits: a cache of long `capacity` and short
      sequences reads and merges less per step when it says so.
  """

  layers: tuple[LayerConfig, ...]
  capacity: int
  max_seqs: int
  max_write: int
  kv_dtype: Any = jnp.bfloat16
  initial_capacity: int | None = None
  page_size: int | None = None
  max_seq_len: int | None = None

  def __post_init__(self):
    if isinstance(self.layers, LayerConfig) or not hasattr(self.layers, "__iter__"):
      raise TypeError(f"layers={self.layers!r} must be a sequence of LayerConfig")
    layers = tuple(self.layers)
    if not layers:
      raise ValueError(f"layers={layers} must hold at least one LayerConfig")
    for i, layer in enumerate(layers):
      if not isinstance(layer, LayerConfig):
        raise TypeError(f"layers[{i}]={layer!r} must be a LayerConfig")
    object.__setattr__(self, "layers", layers)
    for name in ("capacity", "max_seqs", "max_write", "initial_capacity"):
      value = getattr(self, name)
      if name == "initial_capacity" and value is None:
        continue   # resolved to max_flat_rows below, once max_seq_len is known
      _require_int(name, value)
      if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
      object.__setattr__(self, name, int(value))
    if self.capacity >= _MAX_INT32:
      raise ValueError(f"capacity={self.capacity} must be < 2**31")
    if self.max_write > self.capacity:
      raise ValueError(f"max_write={self.max_write} must be <= capacity={self.capacity}: a step "
                       "carries at most capacity tokens")
    if self.max_seqs >= _MAX_INT32 - 1:
      raise ValueError(f"max_seqs={self.max_seqs} must be < 2**31 - 1")
    for i, layer in enumerate(layers):
      if layer.policy.window + self.max_write - 1 >= _MAX_INT32:
        raise ValueError(f"layers[{i}] window={layer.policy.window} + "
                         f"max_write={self.max_write} - 1 must be < 2**31")
    try:
      dtype = np.dtype(self.kv_dtype)
    except TypeError as e:
      raise ValueError(f"kv_dtype={self.kv_dtype!r} is not a dtype") from e
    if dtype not in _KV_DTYPES:
      raise ValueError(f"kv_dtype={dtype} must be float32, bfloat16, float16, float8_e4m3fn or "
                       "float8_e5m2")
    object.__setattr__(self, "kv_dtype", dtype)
    if self.max_seq_len is not None:
      _require_int("max_seq_len", self.max_seq_len)
      object.__setattr__(self, "max_seq_len", int(self.max_seq_len))
      if not 1 <= self.max_seq_len <= self.capacity:
        raise ValueError(f"max_seq_len={self.max_seq_len} must be in [1, capacity={self.capacity}]")
    if self.initial_capacity is None:
      object.__setattr__(self, "initial_capacity", self.max_flat_rows)
    if self.page_size is not None:
      _require_int("page_size", self.page_size)
      object.__setattr__(self, "page_size", int(self.page_size))
      if not 1 <= self.page_size <= self.capacity:
        raise ValueError(f"page_size={self.page_size} must be in [1, capacity={self.capacity}]")
      if not self.has_flat:
        raise ValueError(f"page_size={self.page_size} needs a flat layer; every layer is a "
                         "ring (rings keep their per-sequence rows)")

  @property
  def step_width(self) -> int:
    """`W = max_write`: the static token width of every step."""
    return self.max_write

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  @property
  def scratch_col(self) -> int:
    """Column `max_seqs`: padded writes land there, nothing reads it."""
    return self.max_seqs

  @property
  def seq_len_limit(self) -> int:
    """Most positions one sequence may hold: `max_seq_len`, else `capacity`."""
    return self.capacity if self.max_seq_len is None else self.max_seq_len

  @property
  def max_flat_rows(self) -> int:
    """The flat rows' ceiling: `seq_len_limit` (no sequence reads a row past it)."""
    return self.seq_len_limit

  @property
  def initial_flat_rows(self) -> int:
    """Flat rows at construction: `min(initial_capacity, max_flat_rows)`."""
    return min(self.initial_capacity, self.max_flat_rows)

  @property
  def is_paged(self) -> bool:
    """Whether flat layers live in a page pool (`page_size` is set)."""
    return self.page_size is not None

  @property
  def max_pages_per_seq(self) -> int:
    """Page-table entries per sequence: `ceil(seq_len_limit / page_size)` (0 unpaged)."""
    return -(-self.seq_len_limit // self.page_size) if self.is_paged else 0

  @property
  def num_pages(self) -> int:
    """Pages of the pool: `ceil(capacity / page_size) + max_seqs + 1` (0 unpaged).

    Live sequences hold at most `capacity` positions, so `sum ceil(pos_s / P)`
    is at most `capacity / P + max_seqs` pages (one partial page each); the last
    page is the scratch page. No verb can therefore be refused for want of pages.
    """
    return -(-self.capacity // self.page_size) + self.max_seqs + 1 if self.is_paged else 0

  @property
  def scratch_page(self) -> int:
    """Page `num_pages - 1`: padded writes and refused copies land there; nothing reads it."""
    return self.num_pages - 1

  @property
  def is_fp8(self) -> bool:
    """Whether K/V are stored in fp8 with per-head scales (`CacheState.k_scale`, CONTRACT §3.2)."""
    return fp8.is_fp8(self.kv_dtype)

  @property
  def has_flat(self) -> bool:
    return any(not layer.policy.is_ring for layer in self.layers)

  def ring_rows(self, layer: int) -> int:
    """Rows of ring layer `layer`: `min(capacity, window + max_write - 1)`."""
    policy = self.layers[layer].policy
    if not policy.is_ring:
      raise ValueError(f"layer={layer} is flat; ring_rows needs a ring layer")
    return indexing.ring_num_rows(policy.window, self.max_write, self.capacity)

  def window(self, layer: int) -> int | None:
    """The ring window of `layer`, or None for a flat layer."""
    policy = self.layers[layer].policy
    return policy.window if policy.is_ring else None

  def rings(self) -> tuple[tuple[int, int], ...]:
    """`(num_rows, window)` of every ring layer, for the floor rule."""
    return tuple((self.ring_rows(l), layer.policy.window)
                 for l, layer in enumerate(self.layers) if layer.policy.is_ring)

  def is_paged_layer(self, layer: int) -> bool:
    """Whether layer `layer` lives in the page pool (a flat layer of a paged config)."""
    return self.is_paged and not self.layers[layer].policy.is_ring

  def layer_shape(self, layer: int, flat_rows: int) -> tuple[int, int, int, int]:
    """`[rows, max_seqs + 1, n_kv_heads, head_dim]` of layer `layer`, or the pool
    `[num_pages, page_size, n_kv_heads, head_dim]` of a paged flat layer (which
    ignores `flat_rows`)."""
    cfg = self.layers[layer]
    if self.is_paged_layer(layer):
      return (self.num_pages, self.page_size, cfg.n_kv_heads, cfg.head_dim)
    rows = self.ring_rows(layer) if cfg.policy.is_ring else flat_rows
    return (rows, self.max_seqs + 1, cfg.n_kv_heads, cfg.head_dim)
