"""Tensor-parallel placement: K/V split over their KV-head axis, control replicated.

With a `jax.sharding.Mesh`, every K/V array is a `NamedSharding` over axis 2 (KV
heads) along `kv_axis`; the control values and the Step are replicated. The
write and the attention run per shard under `jax.shard_map`, so no collective
ever moves cache-sized data: each device holds `n_kv_heads / axis_size` heads of
every column and serves the matching query heads (query head `h` uses KV head
`h // G`, and contiguous splits of both axes line up).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv._config import CacheConfig

def validate_mesh(config: CacheConfig, mesh, kv_axis: str) -> None:
  """Raises ValueError unless `kv_axis` names a mesh axis dividing every layer's heads."""
  if mesh is None:
    return
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh or None")
  if kv_axis not in mesh.axis_names:
    raise ValueError(f"kv_axis={kv_axis!r} is not an axis of the mesh {mesh.axis_names}")
  size = mesh.shape[kv_axis]
  for l, layer in enumerate(config.layers):
    if layer.n_kv_heads % size:
      raise ValueError(f"layers[{l}] n_kv_heads={layer.n_kv_heads} must be divisible by "
                       f"the {kv_axis!r} axis size {size}")


def kv_spec(kv_axis: str) -> P:
  """`[rows, columns, heads, dim]` split over heads."""
  return P(None, None, kv_axis, None)


def head_spec(kv_axis: str) -> P:
  """`[tokens, heads, dim]` (q, k, v, out) split over heads."""
  return P(None, kv_axis, None)


def kv_sharding(mesh, kv_axis: str) -> NamedSharding:
  return NamedSharding(mesh, kv_spec(kv_axis))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def first_device():
  """A sharding committing arrays to the first device, without a mesh.

  jax 0.12.1 deprecates the `SingleDeviceSharding` class for
  `make_single_device_sharding`, which jax 0.11.2 (the GPU machine's) lacks.
  """
  device = jax.devices()[0]
  make = getattr(jax.sharding, "make_single_device_sharding", None)
  return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


def place(x, mesh, spec: P):
  """`x` (a pytree) laid out as `spec` on `mesh`, inside or outside jit.

  Explicit-axis meshes (the default of `jax.make_mesh` in recent JAX) need
  `jax.sharding.reshard`; auto-axis meshes take a sharding constraint.
  """
  sharding = NamedSharding(mesh, spec)
  explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
  if explicit:
    return jax.tree.map(lambda a: jax.sharding.reshard(a, sharding), x)
  return jax.lax.with_sharding_constraint(x, sharding)


def per_shard(fn, mesh, kv_axis: str, *, head_vectors: int = 0):
  """Runs `fn(k_cache, v_cache, q, k, v, *head_vectors, *replicated_args) -> (k_cache,
  v_cache, out)` once per KV-head shard (identity when `mesh` is None); the first
  `head_vectors` arguments after v are `[n_kv_heads]` vectors (fp8 scales), split
  over heads like K/V."""
  if mesh is None:
    return fn
  kv, heads = kv_spec(kv_axis), head_spec(kv_axis)

  def wrapped(k_cache, v_cache, q, k, v, *rest):
    specs = ((kv, kv, heads, heads, heads) + (P(kv_axis),) * head_vectors
             + (P(),) * (len(rest) - head_vectors))
    args = jax.tree.map(lambda spec, x: place(x, mesh, spec), specs,
                        (k_cache, v_cache, q, k, v) + rest,
                        is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(kv, kv, heads),
                         check_vma=False)(*args)

  return wrapped
