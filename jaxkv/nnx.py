"""Flax NNX adapter: `CachedAttention` over the pure jaxkv API.

The cache state is passed in and returned explicitly, never held in a mutable
Variable, so a model built from these modules can donate the state and carry it
through `jax.lax.while_loop`:

  state, status = jaxkv.pure.declare_step(config, state, seq_ids, n, blocks)
  state, status = jaxkv.pure.prepare_step(config, state)
  out, state = attention(x, state)     # every layer, in order
  state, status = jaxkv.pure.commit_step(config, state)   # check it: see below

A step whose state is not prepared, or that skipped a layer, is refused by
`commit_step` (NOT_PREPARED, NOT_ATTENDED) with the state unchanged; inside a
jitted loop that status is the one signal, so callers must check it (the
serving loop stops on it). Outside `jit`, `CachedAttention` raises at once.

Each token's RoPE position comes from the prepared Step (`state.step.positions`);
segments, owner blocks (§9) and ring windows come with it, so the module needs
no per-step bookkeeping. This is the only jaxkv module that imports Flax.

Tensor parallelism (docs/SCALING.md): with `mesh=`, `CachedAttention` splits
its q/k/v projections over their output (head) axis and `o_proj` over its
input axis along `kv_axis` (Megatron style, recorded as sharding metadata so
`nnx.get_partition_spec` sees it), and the cache layer is split the same way,
so each device projects, writes and attends over its own heads; one all-reduce
after `o_proj` joins the heads. `shard_state` places a model's state on a mesh.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import CacheConfig, CacheState, Phase, Status, StepError, pure
from jaxkv._attend import static_validate_scale
from jaxkv._gemm import linear_dot_general, resolve_gemm
from jaxkv.rope import RopeScaling, apply_rope, rope_inv_freq

__all__ = ["CachedAttention", "RMSNorm", "RopeScaling", "apply_rope", "bucketed",
           "merge_model", "rope_inv_freq", "row_parallel_sharding", "shard_state",
           "sharded_init", "split_model", "tp_size", "validate_tp"]


def split_model(model):
  """`(graphdef, params)` of an NNX model (`nnx.split`), for jitted functions elsewhere."""
  return nnx.split(model)


def merge_model(graphdef, params):
  """The model back from `split_model`'s parts (`nnx.merge`), inside a traced function."""
  return nnx.merge(graphdef, params)


def tp_size(mesh, kv_axis: str) -> int:
  """Size of the `kv_axis` mesh axis (1 without a mesh).

  Raises:
    TypeError: `mesh` is neither None nor a `jax.sharding.Mesh`.
    ValueError: `kv_axis` is not an axis of `mesh`.
  """
  if mesh is None:
    return 1
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh or None")
  if kv_axis not in mesh.axis_names:
    raise ValueError(f"kv_axis={kv_axis!r} is not an axis of the mesh {mesh.axis_names}")
  return int(mesh.shape[kv_axis])


def validate_tp(mesh, kv_axis: str, **sizes: int) -> None:
  """Raises ValueError naming the first of `sizes` the `kv_axis` axis does not divide."""
  n = tp_size(mesh, kv_axis)
  for name, size in sizes.items():
    if size % n:
      raise ValueError(f"{name}={size} must be divisible by the {kv_axis!r} axis size {n}")


def sharded_init(init, mesh, spec: tuple):
  """`init` with sharding metadata `spec` on `mesh` (unchanged without a mesh)."""
  if mesh is None:
    return init
  return nnx.with_partitioning(init, spec, mesh=mesh)


def row_parallel_sharding(mesh):
  """`out_sharding` of a matmul contracting a split axis (o_proj, down_proj).

  Explicit-axis meshes need it named (replicated output: XLA all-reduces the
  partial sums); auto-axis meshes and no mesh leave it to XLA (None).
  """
  if mesh is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
    return None
  return NamedSharding(mesh, P())


def shard_state(state, mesh):
  """`state` (an `nnx.State`) placed on `mesh` by its sharding metadata.

  Each leaf goes to `NamedSharding(mesh, nnx.get_partition_spec(...))`; a
  leaf without sharding metadata keeps its placement when it already lies on
  `mesh` (e.g. placed by `jaxkv.models.shard_params`) and is replicated
  otherwise (norms, embeddings).

  Args:
    state: an `nnx.State`, e.g. `nnx.state(model)` or `split_model(model)[1]`.
    mesh: a `jax.sharding.Mesh`.

  Returns:
    The placed state (same structure).
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh")
  leaves, treedef = jax.tree.flatten(state)
  specs = jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, P))
  if len(specs) != len(leaves):
    raise ValueError(f"state has {len(leaves)} leaves but {len(specs)} partition specs")

  def target(x, spec):
    if isinstance(spec, P) and spec != P():
      return NamedSharding(mesh, spec)
    current = getattr(x, "sharding", None)
    if isinstance(current, NamedSharding) and current.mesh == mesh:
      return current
    return NamedSharding(mesh, P())

  placed = [jax.device_put(x, target(x, spec)) for x, spec in zip(leaves, specs)]
  return jax.tree.unflatten(treedef, placed)


def _dtype_or_none(name, value):
  if value is None:
    return None
  try:
    return np.dtype(value)
  except TypeError as e:
    raise ValueError(f"{name}={value!r} is not a dtype") from e


def bucketed(fn, x, n_tokens, bucket: int | None):
  """`fn(x)` for `x [W, ...]`, computed on the first `bucket` rows when `n_tokens <= bucket`.

  A step's token axis is static (`W`), but a decode step often carries far
  fewer real tokens. Row-wise work (projections, MLPs) then runs on a smaller
  static bucket inside a `lax.cond`; rows `bucket..W-1` of the result are zeros
  (they are padding: `n_tokens <= bucket`). The cache never enters the branches,
  so no buffer is copied.

  Args:
    fn: a row-wise function `[T, ...] -> [T, ...]` (or a tuple of such arrays).
    x: `[W, ...]`.
    n_tokens: `int32[]` real tokens of the step (`state.step.n_tokens`).
    bucket: static row count, or None (always the full width).
  """
  width = x.shape[0]
  if bucket is None or bucket >= width:
    return fn(x)

  def small():
    pad = lambda y: jnp.pad(y, ((0, width - bucket),) + ((0, 0),) * (y.ndim - 1))
    return jax.tree.map(pad, fn(x[:bucket]))

  return jax.lax.cond(n_tokens <= bucket, small, lambda: fn(x))


class RMSNorm(nnx.Module):
  """RMS normalisation over the last axis, in float32.

  `offset = 0` is Llama's (`weight * x̂`, weight initialised to 1); `offset = 1`
  is Gemma's (`(1 + weight) * x̂`, weight initialised to 0).

  Args:
    features: size of the normalised axis.
    eps: added to the mean square.
    offset: 0.0 or 1.0.
    param_dtype: weight dtype.
    mesh: optional `jax.sharding.Mesh`; the weight is then replicated on it.
  """

  def __init__(self, features: int, *, eps: float = 1e-6, offset: float = 0.0,
               param_dtype=jnp.float32, mesh=None):
    if features < 1:
      raise ValueError(f"features={features} must be >= 1")
    if offset not in (0.0, 1.0):
      raise ValueError(f"offset={offset} must be 0.0 (Llama) or 1.0 (Gemma)")
    self.eps, self.offset = float(eps), float(offset)
    init = jnp.zeros if offset else jnp.ones
    weight = init((features,), param_dtype)
    if mesh is not None:   # replicated on the mesh, like the sharded weights around it
      weight = jax.device_put(weight, NamedSharding(mesh, P()))
    self.weight = nnx.Param(weight)

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    weight = self.weight[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
    if self.offset:
      return (normed * (self.offset + weight)).astype(x.dtype)
    # Llama casts back to the input dtype before the weight multiply.
    return weight.astype(x.dtype) * normed.astype(x.dtype)


class CachedAttention(nnx.Module):
  """Multi-head (GQA) self-attention over one jaxkv cache layer.

  `__call__(x, state)` projects `x` to q/k/v, applies RoPE at the prepared
  step's positions, writes K/V into the layer and attends with
  `jaxkv.pure.attend` (flat or ring per the config), then projects the output.
  The layer's `n_kv_heads` and `head_dim` come from the cache config.

  Args:
    cache_config: the `CacheConfig` (static).
    layer: this module's layer id in the cache.
    features: model width (input and output size).
    num_heads: query heads; a multiple of the layer's `n_kv_heads`.
    rope_theta: RoPE base.
    rope_scaling: optional `RopeScaling`.
    qk_norm: None, `"llama"` or `"gemma"`: RMS-normalise q and k per head before
      RoPE (Gemma 3 uses `"gemma"`).
    norm_eps: epsilon of the q/k norms.
    scale: softmax scale, a finite float > 0; None means `1/sqrt(head_dim)`.
    use_bias: biases on the q/k/v projections.
    dtype: computation dtype (None keeps the input's).
    param_dtype: parameter dtype.
    implementation: passed to `jaxkv.pure.attend` (None picks the kernels on a
      Hopper GPU, else the reference).
    bucket: optional static row count: steps with at most this many real tokens
      run the projections on `bucket` rows instead of `W` (see `bucketed`).
    gemm: the output projection's GEMM at decode widths (up to 128 rows): None picks
      `"mosaic_gpu"` (`pallas_kernels.skinny_gemm`) on a Hopper GPU without a mesh, else
      `"xla"`; `"interpret"` runs the kernel under the Mosaic GPU interpreter (CPU tests).
      Wider steps and shapes the kernel refuses always use XLA's (CONTRACT §10.8).
    mesh: optional `jax.sharding.Mesh` (auto or explicit axes): heads are split over
      `kv_axis` (q/k/v kernels over their outputs, `o_proj` over its inputs,
      the cache layer over its KV heads); pass the cache state built with the
      same `mesh` and `kv_axis` (`jaxkv.init_state(config, mesh=, kv_axis=)`).
    kv_axis: the mesh axis that splits heads.
    rngs: `nnx.Rngs` for the initial weights.

  Raises:
    ValueError: a bad argument (named), e.g. `num_heads` or the layer's
      `n_kv_heads` not divisible by the `kv_axis` axis size.
  """

  def __init__(self, cache_config: CacheConfig, layer: int, *, features: int, num_heads: int,
               rope_theta: float = 10000.0, rope_scaling: RopeScaling | None = None,
               qk_norm: str | None = None, norm_eps: float = 1e-6, scale: float | None = None,
               use_bias: bool = False, dtype=None, param_dtype=jnp.float32,
               implementation: str | None = None, bucket: int | None = None,
               gemm: str | None = None, mesh=None, kv_axis: str = "tp", rngs: nnx.Rngs):
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(f"cache_config={cache_config!r} must be a CacheConfig")
    if isinstance(layer, bool) or not isinstance(layer, int) or not (
        0 <= layer < cache_config.num_layers):
      raise ValueError(f"layer={layer!r} must be an int in [0, {cache_config.num_layers})")
    layer_config = cache_config.layers[layer]
    kv_heads, head_dim = layer_config.n_kv_heads, layer_config.head_dim
    if num_heads < 1 or num_heads % kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a positive multiple of layer {layer}'s "
                       f"n_kv_heads={kv_heads}")
    if features < 1:
      raise ValueError(f"features={features} must be >= 1")
    if qk_norm not in (None, "llama", "gemma"):
      raise ValueError(f"qk_norm={qk_norm!r} must be None, 'llama' or 'gemma'")
    if implementation not in (None, "reference", "mosaic_gpu", "interpret"):
      raise ValueError(f"implementation={implementation!r} must be None, 'reference', "
                       "'mosaic_gpu' or 'interpret'")
    if bucket is not None and not (isinstance(bucket, int) and bucket >= 1):
      raise ValueError(f"bucket={bucket!r} must be None or an int >= 1")
    rope_inv_freq(head_dim, rope_theta, rope_scaling)   # validates head_dim, theta
    validate_tp(mesh, kv_axis, num_heads=num_heads, n_kv_heads=kv_heads)
    self.gemm = resolve_gemm(gemm, mesh)
    self.mesh, self.kv_axis = mesh, kv_axis
    self.bucket = bucket
    self.cache_config, self.layer = cache_config, layer
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_heads, head_dim
    self.rope_theta, self.rope_scaling = float(rope_theta), rope_scaling
    self.scale = static_validate_scale(scale)
    self.dtype = _dtype_or_none("dtype", dtype)
    self.implementation = implementation
    kernel_init, bias_init = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()

    def linear(n_in, n_out, bias, split_inputs):
      # Megatron: q/k/v split over their outputs (heads), o_proj over its inputs.
      spec = (kv_axis, None) if split_inputs else (None, kv_axis)
      # o_proj's decode GEMM may run the skinny kernel; q/k/v stay one merged XLA GEMM.
      dot_general = linear_dot_general(self.gemm if split_inputs else "xla")
      return nnx.Linear(
          n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
          kernel_init=sharded_init(kernel_init, mesh, spec),
          bias_init=sharded_init(bias_init, mesh, (kv_axis,)), dot_general=dot_general,
          rngs=rngs)

    self.q_proj = linear(features, num_heads * head_dim, use_bias, False)
    self.k_proj = linear(features, kv_heads * head_dim, use_bias, False)
    self.v_proj = linear(features, kv_heads * head_dim, use_bias, False)
    self.o_proj = linear(num_heads * head_dim, features, False, True)
    if qk_norm is None:
      self.q_norm = self.k_norm = None
    else:
      offset = 1.0 if qk_norm == "gemma" else 0.0
      norm = lambda: RMSNorm(head_dim, eps=norm_eps, offset=offset, param_dtype=param_dtype,
                             mesh=mesh)
      self.q_norm, self.k_norm = norm(), norm()

  def __call__(self, x, state: CacheState):
    """One step of this layer.

    Args:
      x: `[W, features]` hidden states on the step's token axis (rows `n..W-1`
        are padding; their outputs are garbage).
      state: the `CacheState` with a prepared step; consumed (pass it on).

    Returns:
      `(out [W, features], new_state)`.

    The layer is marked served in `state.attended`. On a state that is not
    prepared nothing is written and `out` is garbage; traced (inside `jit`),
    that cannot raise, so the step's `commit_step` refuses with NOT_PREPARED
    (or NOT_ATTENDED for a layer skipped) and the caller must check its status.

    Raises:
      ValueError: at trace time, when `x` is not `[W, features]`.
      StepError: called outside `jit` on a state that is not PREPARED.
    """
    # The step's width: W, or less inside `pure.run_narrow`.
    width = state.step.seq_cols.shape[0]
    if x.ndim != 2 or x.shape[0] != width:
      raise ValueError(f"x must be [W={width}, features]; got x.shape={x.shape}")
    if not isinstance(state.phase, jax.core.Tracer) and int(state.phase) != Phase.PREPARED:
      raise StepError(f"CachedAttention layer {self.layer} needs a prepared step; phase is "
                      f"{Phase(int(state.phase)).name}", Status.NOT_PREPARED)
    if self.dtype is not None:
      x = x.astype(self.dtype)
    n_tokens = state.step.n_tokens
    if self.mesh is None:
      project = lambda h: jnp.concatenate([self.q_proj(h), self.k_proj(h), self.v_proj(h)], -1)
      qkv = bucketed(project, x, n_tokens, self.bucket)
      q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
      q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
    else:
      # Separate projections: concatenating head-split outputs would reshuffle them.
      project = lambda h: (self.q_proj(h), self.k_proj(h), self.v_proj(h))
      q, k, v = bucketed(project, x, n_tokens, self.bucket)
    q = q.reshape(width, self.num_heads, self.head_dim)
    k = k.reshape(width, self.num_kv_heads, self.head_dim)
    v = v.reshape(width, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    positions = state.step.positions
    inv_freq = rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    state, out, _ = pure.attend(self.cache_config, state, self.layer, q, k, v,
                                scale=self.scale, implementation=self.implementation,
                                mesh=self.mesh, kv_axis=self.kv_axis)
    o_proj = lambda h: self.o_proj(h, out_sharding=row_parallel_sharding(self.mesh))
    out = bucketed(o_proj, out.reshape(width, self.num_heads * self.head_dim), n_tokens,
                   self.bucket)
    return out, state
