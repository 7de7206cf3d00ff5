"""`Engine`: continuous batching over a request queue, the decode loop in one `jax.jit`."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import CacheConfig, Status
from jaxkv.serve.loop import (LoopState, _admit, _fork, _grow, _release, decode_loop,
                              init_loop_state)
from jaxkv.serve.memory import _grown_rows
from jaxkv.serve.requests import Completion, EngineStats, Request


def _model_mesh(model, config: CacheConfig, mesh, kv_axis):
  """`(mesh, kv_axis)`: the arguments, else the model's attributes; validated."""
  from jaxkv._sharding import validate_mesh   # pylint: disable=g-import-not-at-top
  model_mesh = getattr(model, "mesh", None)
  mesh = model_mesh if mesh is None else mesh
  kv_axis = kv_axis or getattr(model, "kv_axis", None) or "tp"
  if model_mesh is not None and mesh is not model_mesh and mesh != model_mesh:
    raise ValueError(f"mesh={mesh} differs from the model's mesh {model_mesh}")
  validate_mesh(config, mesh, kv_axis)
  return mesh, kv_axis


def _split_placed(model, mesh):
  """`(graphdef, params)`, the params placed on `mesh` by their sharding metadata."""
  from jaxkv.nnx import shard_state, split_model   # pylint: disable=g-import-not-at-top
  graphdef, params = split_model(model)
  return graphdef, (params if mesh is None else shard_state(params, mesh))


_jit_admit = jax.jit(_admit, static_argnums=0, donate_argnums=1)
_jit_fork = jax.jit(_fork, static_argnums=0, donate_argnums=1)
_jit_release = jax.jit(_release, static_argnums=0, donate_argnums=1)


class Engine:
  """Continuous batching over a request queue, the decode loop in one `jax.jit`.

  Args:
    model: an NNX model following the step protocol (see the module docstring),
      with a `cache_config` attribute.
    max_len: longest prompt + max_tokens of any request (the per-column token
      buffer); default `min(capacity, 4096)`.
    max_steps: most steps per loop entry (bounds the time between host visits).
    max_stop_tokens: most stop tokens per request.
    mesh: optional `jax.sharding.Mesh` for tensor parallelism; default the
      model's `mesh` attribute (`jaxkv.models.Decoder(..., mesh=)`). The
      cache's K/V are split over `kv_axis`, the parameters are placed by their
      sharding metadata (`jaxkv.nnx.shard_state`), the rest is replicated, and
      the same jitted loop runs on the mesh.
    kv_axis: the mesh axis splitting KV heads; default the model's `kv_axis`
      attribute, else `"tp"`.
  """

  def __init__(self, model, *, max_len: int | None = None, max_steps: int = 4096,
               max_stop_tokens: int = 8, mesh=None, kv_axis: str | None = None):
    config = getattr(model, "cache_config", None)
    if not isinstance(config, CacheConfig):
      raise ValueError(f"model={type(model).__name__} must have a CacheConfig `cache_config`")
    self.config = config
    self.mesh, self.kv_axis = _model_mesh(model, config, mesh, kv_axis)
    self.max_len = min(config.capacity, 4096) if max_len is None else int(max_len)
    if self.max_len < 2:
      raise ValueError(f"max_len={self.max_len} must be >= 2")
    if max_steps < 1:
      raise ValueError(f"max_steps={max_steps} must be >= 1")
    if max_stop_tokens < 1:
      raise ValueError(f"max_stop_tokens={max_stop_tokens} must be >= 1")
    self.max_steps, self.max_stop = int(max_steps), int(max_stop_tokens)
    self.graphdef, self.params = _split_placed(model, self.mesh)
    # Looked up here, not at import, so a test can wrap `decode_loop` (chex.assert_max_traces).
    self._loop = jax.jit(decode_loop, static_argnums=(0, 1), donate_argnums=3)
    self._admit, self._fork, self._release = _jit_admit, _jit_fork, _jit_release
    self.state: LoopState | None = None
    self.stats = EngineStats()

  def _check(self, request: Request) -> None:
    p = request.params
    total = len(request.prompt) + p.max_tokens
    if total > self.max_len:
      raise ValueError(f"request {request.request_id!r}: prompt ({len(request.prompt)}) + "
                       f"max_tokens ({p.max_tokens}) must be <= max_len={self.max_len}")
    if p.n > self.config.max_seqs:
      raise ValueError(f"request {request.request_id!r}: n={p.n} must be <= "
                       f"max_seqs={self.config.max_seqs}")
    if p.n * (total - 1) > self.config.capacity:
      raise ValueError(f"request {request.request_id!r} needs {p.n * (total - 1)} cache rows; "
                       f"capacity={self.config.capacity}")
    if len(p.stop_tokens) > self.max_stop:
      raise ValueError(f"request {request.request_id!r}: {len(p.stop_tokens)} stop_tokens; "
                       f"at most max_stop_tokens={self.max_stop}")

  def run(self, requests: Sequence[Request], *,
          on_progress: Callable[[EngineStats, list[Completion]], None] | None = None
          ) -> list[Completion]:
    """Serves every request; returns completions ordered by (request order, sample index).

    Args:
      requests: the queue, admitted first come first served.
      on_progress: called after every loop entry with the running stats and the
        completions finished since the last call.

    Raises:
      ValueError: a request that can never fit (see `Engine`'s arguments).
      RuntimeError: the cache refused a step (a bug: admission reserves room).
    """
    requests = [r if r.request_id is not None else dataclasses.replace(r, request_id=i)
                for i, r in enumerate(requests)]
    for r in requests:
      self._check(r)
    order = {r.request_id: i for i, r in enumerate(requests)}
    if len(order) != len(requests):
      raise ValueError("request_id values must be unique")
    config = self.config
    self.stats = stats = EngineStats()
    started = time.perf_counter()
    self.state = ls = init_loop_state(config, self.max_len, self.max_stop, mesh=self.mesh,
                                      kv_axis=self.kv_axis)
    queue = list(requests)
    columns: dict[int, tuple[Request, int]] = {}   # column -> (request, sample index)
    reserved: dict[int, int] = {}                   # column -> cache rows reserved
    pending_forks: dict[int, Request] = {}          # column -> request still to fork
    results: list[Completion] = []
    while queue or columns:
      ls = self._admit_waiting(ls, queue, columns, reserved, pending_forks)
      ls = self._grow_if_needed(ls, reserved)
      ls = self._loop(self.graphdef, config, self.params, ls, jnp.int32(self.max_steps))
      stats.loop_entries += 1
      host = jax.device_get({k: getattr(ls, k) for k in (
          "done", "stopped", "length", "fed", "hold", "active", "prompt_len", "steps",
          "step_tokens", "occupancy", "status")})
      if int(host["status"]) != Status.OK:
        raise RuntimeError(f"the cache refused a step: {Status(int(host['status'])).name}")
      stats.steps, stats.step_tokens = int(host["steps"]), int(host["step_tokens"])
      stats.occupancy = int(host["occupancy"])
      stats.peak_rows = max(stats.peak_rows, int(host["fed"][host["active"] == 1].sum()))
      finished = [c for c in columns if host["done"][c]]
      new_results = []
      if finished:
        tokens = np.asarray(jax.device_get(ls.tokens))
        for c in finished:
          request, index = columns.pop(c)
          reserved.pop(c)
          start, end = int(host["prompt_len"][c]), int(host["length"][c])
          new_results.append(Completion(request.request_id, index, request.prompt,
                                        tokens[c, start:end].tolist(),
                                        "stop" if host["stopped"][c] else "length"))
          stats.generated += end - start
        collected = np.zeros((config.max_seqs,), bool)
        collected[finished] = True   # a fixed-shape mask: no new compilation per count
        ls = dataclasses.replace(ls, done=jnp.where(jnp.asarray(collected), 0, ls.done))
      for c in [c for c in pending_forks
                if host["fed"][c] >= host["hold"][c] and host["hold"][c] < self.max_len]:
        ls = self._fork_column(ls, c, pending_forks.pop(c), columns, reserved)
      results.extend(new_results)
      stats.seconds = time.perf_counter() - started
      if on_progress is not None:
        on_progress(stats, new_results)
      if not columns and queue and not self._can_admit(queue[0], columns, reserved):
        raise RuntimeError("a queued request cannot be admitted into an empty engine")
    self.state = ls
    stats.seconds = time.perf_counter() - started
    return sorted(results, key=lambda c: (order[c.request_id], c.index))

  def _needs(self, request: Request) -> tuple[int, int]:
    """(columns, rows) a request reserves: each sample holds prompt + max_tokens - 1."""
    p = request.params
    return p.n, p.n * (len(request.prompt) + p.max_tokens - 1)

  def _can_admit(self, request, columns, reserved) -> bool:
    cols, rows = self._needs(request)
    return (len(columns) + cols <= self.config.max_seqs
            and sum(reserved.values()) + rows <= self.config.capacity)

  def _admit_waiting(self, ls, queue, columns, reserved, pending_forks):
    while queue and self._can_admit(queue[0], columns, reserved):
      request = queue.pop(0)
      p = request.params
      prompt_len = len(request.prompt)
      fork = p.n > 1 and prompt_len > 1
      copies = 1 if fork else p.n
      for index in range(copies):
        prompt = np.zeros((self.max_len,), np.int32)
        prompt[:prompt_len] = request.prompt
        stops = np.full((self.max_stop,), -1, np.int32)
        stops[:len(p.stop_tokens)] = p.stop_tokens
        ls, status, seq_id = self._admit(
            self.config, ls, jnp.asarray(prompt), jnp.int32(prompt_len),
            jnp.int32(prompt_len + p.max_tokens),
            jnp.int32(prompt_len - 1 if fork else self.max_len), jnp.float32(p.temperature),
            jnp.int32(p.top_k), jnp.float32(p.top_p), jnp.int32(p.seed), jnp.int32(index),
            jnp.asarray(stops))
        if int(status) != Status.OK:
          raise RuntimeError(f"seq_new refused: {Status(int(status)).name}")
        seq_id = int(seq_id)
        columns[seq_id] = (request, index)
        reserved[seq_id] = (prompt_len + p.max_tokens - 1) * (p.n if fork else 1)
        if fork:
          pending_forks[seq_id] = request
    return ls

  def _fork_column(self, ls, src, request, columns, reserved):
    """Clones a prefilled prompt into its `n - 1` sibling samples."""
    per_sample = reserved[src] // request.params.n
    reserved[src] = per_sample
    for index in range(1, request.params.n):
      ls, status, seq_id = self._fork(self.config, ls, jnp.int32(src), jnp.int32(index))
      if int(status) != Status.OK:
        raise RuntimeError(f"seq_clone refused: {Status(int(status)).name}")
      columns[int(seq_id)] = (request, index)
      reserved[int(seq_id)] = per_sample
    return self._release(self.config, ls, jnp.int32(src))

  def _grow_if_needed(self, ls, reserved):
    """Grows flat rows on the host so no admitted sequence can hit NEEDS_ROWS in the loop."""
    config = self.config
    if not config.has_flat or not reserved:
      return ls
    current = next(ls.cache.k[l].shape[0] for l, layer in enumerate(config.layers)
                   if not layer.policy.is_ring)
    needed = max(reserved.values())
    if needed <= current:
      return ls
    return _grow(config, ls, _grown_rows(config, current, needed))
