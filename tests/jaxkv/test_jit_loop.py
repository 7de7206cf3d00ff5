"""Scenario 47 and issue 2: whole decode loops inside one `jax.jit` (CONTRACT §10.3).

Each loop runs over the pure API (`jaxkv.pure`) as a `lax.scan` or
`lax.while_loop` inside `jax.jit(loop, static_argnums=0, donate_argnums=1)`, and
is compared with a second cache driven step by step through the facade with the
same calls. Content follows the CONTRACT §11 *dependent model*: layer 0's q/k/v are
seeded per (tag, position); layer l+1's are fixed seeded linear maps of layer
l's output rows plus the token's own seeded content, written in jnp so the same
function runs inside and outside jit.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from oracle import tol

pure = jaxkv.pure

N_Q_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 8
N_LAYERS = 2
W = 4
OK = int(jaxkv.Status.OK)
ATOL = tol(jnp.float32)


def make_config(*, capacity=64, max_seqs=3, initial_capacity=64):
  """Scenario 47's layers: flat + ring(4), W = 4, float32 (ring R = 7)."""
  return jaxkv.CacheConfig(
      layers=(
          jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), N_KV_HEADS, HEAD_DIM),
          jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(4), N_KV_HEADS, HEAD_DIM),
      ),
      capacity=capacity,
      max_seqs=max_seqs,
      max_write=W,
      kv_dtype=jnp.float32,
      initial_capacity=initial_capacity,
  )


# ---------------------------------------------------------------------------
# The dependent model.

N_TAGS = 8
MAX_POS = 128
_MODEL_RNG = np.random.default_rng(47)
# [tag, position, layer, heads, dim] seeded token content.
TABLE_Q = _MODEL_RNG.standard_normal(
    (N_TAGS, MAX_POS, N_LAYERS, N_Q_HEADS, HEAD_DIM), dtype=np.float32)
TABLE_K = _MODEL_RNG.standard_normal(
    (N_TAGS, MAX_POS, N_LAYERS, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
TABLE_V = _MODEL_RNG.standard_normal(
    (N_TAGS, MAX_POS, N_LAYERS, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
_IN = N_Q_HEADS * HEAD_DIM
# Linear maps from layer l's flattened output row to layer l+1's q/k/v
# (index 0 unused); scaled so activations stay O(1).
MAP_Q = _MODEL_RNG.standard_normal((N_LAYERS, _IN, N_Q_HEADS * HEAD_DIM),
                                   dtype=np.float32) / np.float32(np.sqrt(_IN))
MAP_K = _MODEL_RNG.standard_normal((N_LAYERS, _IN, N_KV_HEADS * HEAD_DIM),
                                   dtype=np.float32) / np.float32(np.sqrt(_IN))
MAP_V = _MODEL_RNG.standard_normal((N_LAYERS, _IN, N_KV_HEADS * HEAD_DIM),
                                   dtype=np.float32) / np.float32(np.sqrt(_IN))


def layer_inputs(layer: int, tags, positions, prev_out):
  """q, k, v of `layer` for tokens `(tags, positions)` under the dependent model.

  Args:
    layer: static layer id.
    tags: int32[T] content tag of each token.
    positions: int32[T] position of each token.
    prev_out: `[T, H_q, D]` float32 output of `layer - 1` (None for layer 0).

  Returns:
    q `[T, H_q, D]`, k and v `[T, H_kv, D]`, float32.
  """
  tags = jnp.asarray(tags, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  q = jnp.asarray(TABLE_Q)[tags, positions, layer]
  k = jnp.asarray(TABLE_K)[tags, positions, layer]
  v = jnp.asarray(TABLE_V)[tags, positions, layer]
  if layer == 0:
    return q, k, v
  rows = prev_out.reshape(prev_out.shape[0], _IN)
  hi = jax.lax.Precision.HIGHEST
  q = q + jnp.matmul(rows, jnp.asarray(MAP_Q[layer]), precision=hi).reshape(q.shape)
  k = k + jnp.matmul(rows, jnp.asarray(MAP_K[layer]), precision=hi).reshape(k.shape)
  v = v + jnp.matmul(rows, jnp.asarray(MAP_V[layer]), precision=hi).reshape(v.shape)
  return q, k, v


# ---------------------------------------------------------------------------
# Drivers shared by the tests.


def facade_step(cache, ids, tags, blocks=None):
  """One facade step with dependent-model content (`T = n` rows per layer).

  Args:
    cache: the facade.
    ids: sequence id of each token.
    tags: content tag of each token.
    blocks: owner blocks, or None.

  Returns:
    float32 `[L, n, H_q, D]`: every layer's output rows.
  """
  assert cache.declare_step(list(ids), owner_blocks=blocks)
  step = cache.prepare_step()
  positions = np.asarray(step.positions)[:len(ids)]
  out, outs = None, []
  for layer in range(N_LAYERS):
    q, k, v = layer_inputs(layer, np.asarray(tags, np.int32), positions, out)
    out = cache.attend(layer, q, k, v)
    outs.append(np.asarray(out))
  cache.commit_step()
  return np.stack(outs)


class PureVerbs:
  """The pure API with the config bound; usable inside jit or eagerly."""

  def __init__(self, config):
    self.config = config

  def seq_new(self, state):
    return pure.seq_new(self.config, state)

  def seq_clone(self, state, src, upto):
    return pure.seq_clone(self.config, state, src, upto)

  def seq_rm(self, state, s):
    return pure.seq_rm(self.config, state, s)

  def rewind(self, state, s, position):
    return pure.rewind(self.config, state, s, position)

  def declare_step(self, state, seq_ids, n, blocks):
    return pure.declare_step(self.config, state, seq_ids, n, blocks)

  def prepare_step(self, state):
    return pure.prepare_step(self.config, state)

  def attend(self, state, layer, q, k, v):
    return pure.attend(self.config, state, layer, q, k, v)

  def commit_step(self, state):
    return pure.commit_step(self.config, state)


def _seq_new(config, state):
  return pure.seq_new(config, state)


def _seq_clone(config, state, src, upto):
  return pure.seq_clone(config, state, src, upto)


def _seq_rm(config, state, s):
  return pure.seq_rm(config, state, s)


def _rewind(config, state, s, position):
  return pure.rewind(config, state, s, position)


def _declare_step(config, state, seq_ids, n, blocks):
  return pure.declare_step(config, state, seq_ids, n, blocks)


def _prepare_step(config, state):
  return pure.prepare_step(config, state)


def _attend(config, state, layer, q, k, v):
  return pure.attend(config, state, layer, q, k, v)


def _commit_step(config, state):
  return pure.commit_step(config, state)


class JittedVerbs(PureVerbs):
  """Each pure verb jitted on its own (state donated) and allowed one trace.

  `attend` has the layer id static, so it may trace once per layer.
  """

  def __init__(self, config):
    super().__init__(config)

    def jit(fn, n=1, static=(0,)):
      return jax.jit(chex.assert_max_traces(fn, n=n), static_argnums=static,
                     donate_argnums=1)

    self._fns = {
        "seq_new": jit(_seq_new),
        "seq_clone": jit(_seq_clone),
        "seq_rm": jit(_seq_rm),
        "rewind": jit(_rewind),
        "declare_step": jit(_declare_step),
        "prepare_step": jit(_prepare_step),
        "attend": jit(_attend, n=N_LAYERS, static=(0, 2)),
        "commit_step": jit(_commit_step),
    }

  def seq_new(self, state):
    return self._fns["seq_new"](self.config, state)

  def seq_clone(self, state, src, upto):
    return self._fns["seq_clone"](self.config, state, src, upto)

  def seq_rm(self, state, s):
    return self._fns["seq_rm"](self.config, state, s)

  def rewind(self, state, s, position):
    return self._fns["rewind"](self.config, state, s, position)

  def declare_step(self, state, seq_ids, n, blocks):
    return self._fns["declare_step"](self.config, state, seq_ids, n, blocks)

  def prepare_step(self, state):
    return self._fns["prepare_step"](self.config, state)

  def attend(self, state, layer, q, k, v):
    return self._fns["attend"](self.config, state, layer, q, k, v)

  def commit_step(self, state):
    return self._fns["commit_step"](self.config, state)


def pure_step(verbs, state, seq_ids, n, blocks, tags):
  """declare, prepare, attend every layer, commit through `verbs`.

  Args:
    verbs: a `PureVerbs`.
    state: the current state (consumed).
    seq_ids: int32[W] ids, entries >= n ignored.
    n: int32 token count.
    blocks: int32[W, 2] owner blocks (length 0 = unused row).
    tags: int32[W] content tags, or a function of the prepared `Step` giving them.

  Returns:
    `(state, outs, statuses)`: outs `[L, W, H_q, D]` (rows >= n unspecified),
    statuses int32[L + 3] (declare, prepare, attend per layer, commit).
  """
  state, s_declare = verbs.declare_step(state, seq_ids, n, blocks)
  state, s_prepare = verbs.prepare_step(state)
  if callable(tags):
    tags = tags(state.step)
  # A copy: with separately jitted verbs, `attend` donates the state it reads.
  positions = jnp.copy(state.step.positions)
  statuses = [s_declare, s_prepare]
  out, outs = None, []
  for layer in range(N_LAYERS):
    q, k, v = layer_inputs(layer, tags, positions, out)
    state, out, status = verbs.attend(state, layer, q, k, v)
    outs.append(out)
    statuses.append(status)
  state, s_commit = verbs.commit_step(state)
  statuses.append(s_commit)
  return state, jnp.stack(outs), jnp.stack([jnp.asarray(s, jnp.int32) for s in statuses])


def live_rows(state, layer: int, s: int) -> np.ndarray:
  """Rows of `layer` that hold sequence `s`'s positions `[max(0, pos - R), pos)`."""
  rows = state.k[layer].shape[0]
  pos = int(np.asarray(state.pos)[s])
  if layer == 0:  # flat
    return np.arange(pos)
  return np.arange(max(0, pos - rows), pos) % rows


def assert_states_agree(actual, expected):
  """Control values equal; live K/V agree within each sequence's positions."""
  for name in ("live", "pos", "hw", "held", "phase"):
    np.testing.assert_array_equal(np.asarray(getattr(actual, name)),
                                  np.asarray(getattr(expected, name)), err_msg=name)
  live = np.asarray(expected.live)
  for layer in range(N_LAYERS):
    for s in np.flatnonzero(live):
      rows = live_rows(expected, layer, int(s))
      for kv in ("k", "v"):
        np.testing.assert_allclose(
            np.asarray(getattr(actual, kv)[layer])[rows, s],
            np.asarray(getattr(expected, kv)[layer])[rows, s],
            atol=ATOL, rtol=0, err_msg=f"{kv}[{layer}] column {s}")


# ---------------------------------------------------------------------------
# Scenario 47.

X, Y, Z = 0, 1, 2
TAG_X, TAG_Y, TAG_Z, TAG_Y_REWOUND = 0, 1, 2, 3
N_ITERS = 12
REWIND_AT = 6


def prefilled_cache(config, prefill=((X,) * 4, (X, Y, Y, Y), (Z,))):
  """A facade cache with x, y, z prefilled (by default 5, 3 and 1 tokens)."""
  cache = jaxkv.BatchedSequenceCache(config, implementation="reference")
  assert [cache.seq_new() for _ in range(3)] == [X, Y, Z]
  tags = {X: TAG_X, Y: TAG_Y, Z: TAG_Z}
  for ids in prefill:
    facade_step(cache, ids, [tags[s] for s in ids])
  return cache


def _initial_tags(config):
  """Content tag of each column; the scratch column's entry tags padding."""
  tags = np.zeros(config.max_seqs + 1, np.int32)
  tags[[X, Y, Z]] = TAG_X, TAG_Y, TAG_Z
  return jnp.asarray(tags)


def _iteration(verbs, state, col_tags, i):
  """Scenario 47's iteration `i`: step [x, y, z] (one padded token); at 6 rewind y."""
  config = verbs.config
  seq_ids = jnp.array([X, Y, Z, config.max_seqs], jnp.int32)
  blocks = jnp.zeros((W, 2), jnp.int32)
  state, outs, statuses = pure_step(
      verbs, state, seq_ids, jnp.int32(3), blocks, lambda step: col_tags[step.seq_cols])

  def rewind_y(args):
    state, col_tags = args
    state, status = verbs.rewind(state, jnp.int32(Y), state.pos[Y] - 1)
    return state, col_tags.at[Y].set(TAG_Y_REWOUND), jnp.asarray(status, jnp.int32)

  def keep(args):
    state, col_tags = args
    return state, col_tags, jnp.int32(OK)

  state, col_tags, s_rewind = jax.lax.cond(i == REWIND_AT, rewind_y, keep, (state, col_tags))
  return state, col_tags, outs, jnp.concatenate([statuses, s_rewind[None]])


def scan_loop_47(config, state, col_tags):
  """Twelve scenario-47 iterations as one `lax.scan` over the pure API."""
  verbs = PureVerbs(config)

  def body(carry, i):
    state, col_tags = carry
    state, col_tags, outs, statuses = _iteration(verbs, state, col_tags, i)
    return (state, col_tags), (outs, statuses)

  (state, _), (outs, statuses) = jax.lax.scan(
      body, (state, col_tags), jnp.arange(N_ITERS, dtype=jnp.int32))
  return state, outs, statuses


def facade_iterations_47(cache, start, stop, tags=None, declare_next=False):
  """Scenario-47 iterations `[start, stop)` through the facade.

  Returns:
    `(outs, tags)`: outs `[stop - start, L, 3, H_q, D]`; tags by sequence.
  """
  tags = dict(tags or {X: TAG_X, Y: TAG_Y, Z: TAG_Z})
  outs = []
  for i in range(start, stop):
    outs.append(facade_step(cache, [X, Y, Z], [tags[X], tags[Y], tags[Z]]))
    if i == REWIND_AT:
      assert cache.rewind(Y, cache.pos(Y) - 1)
      tags[Y] = TAG_Y_REWOUND
  if declare_next:
    assert cache.declare_step([X, Y, Z])
  return np.stack(outs) if outs else np.zeros((0,)), tags


def test_scenario_47_scan_loop_matches_facade():
  """Scenario 47: 12 scan iterations in one jit equal the facade step by step."""
  chex.clear_trace_counter()
  config = make_config()
  loop = jax.jit(chex.assert_max_traces(scan_loop_47, n=1),
                 static_argnums=0, donate_argnums=1)
  cache_jit = prefilled_cache(config)
  cache_ref = prefilled_cache(config)

  state, outs, statuses = loop(config, cache_jit.state, _initial_tags(config))
  expected_outs, _ = facade_iterations_47(cache_ref, 0, N_ITERS)

  np.testing.assert_array_equal(np.asarray(statuses), OK)
  np.testing.assert_allclose(np.asarray(outs)[:, :, :3], expected_outs, atol=ATOL, rtol=0)
  assert_states_agree(state, cache_ref.state)
  assert np.asarray(state.pos).tolist() == [17, 14, 13]

  # A second run with other values (other prefill lengths) reuses the trace.
  cache_other = prefilled_cache(config, prefill=((X, X), (Y, Y, Y, Z), (Y,)))
  _, _, statuses = loop(config, cache_other.state, _initial_tags(config))
  np.testing.assert_array_equal(np.asarray(statuses), OK)


def while_loop_47(config, state, col_tags, start):
  """Scenario-47 iterations from `start` as a `lax.while_loop`.

  Stops before iteration 12 or at the first non-OK status; a stopped iteration
  keeps the state prepare left (its declaration standing) and is not counted.

  Returns:
    `(state, col_tags, i, status, outs)`: `i` is the first iteration not done,
    `status` the status that stopped it (OK when all were done), outs
    `[12, L, W, H_q, D]` (zero for iterations not done).
  """
  verbs = PureVerbs(config)
  seq_ids = jnp.array([X, Y, Z, config.max_seqs], jnp.int32)
  blocks = jnp.zeros((W, 2), jnp.int32)
  outs = jnp.zeros((N_ITERS, N_LAYERS, W, N_Q_HEADS, HEAD_DIM), jnp.float32)

  def cond(carry):
    _, _, i, status, _ = carry
    return (i < N_ITERS) & (status == OK)

  def body(carry):
    state, col_tags, i, _, outs = carry
    state, s_declare = verbs.declare_step(state, seq_ids, jnp.int32(3), blocks)
    state, s_prepare = verbs.prepare_step(state)
    status = jnp.where(s_declare != OK, s_declare, s_prepare).astype(jnp.int32)

    def rest(args):
      state, col_tags, outs = args
      positions = state.step.positions
      tags = col_tags[state.step.seq_cols]
      out, layer_outs, statuses = None, [], []
      for layer in range(N_LAYERS):
        q, k, v = layer_inputs(layer, tags, positions, out)
        state, out, s = verbs.attend(state, layer, q, k, v)
        layer_outs.append(out)
        statuses.append(jnp.asarray(s, jnp.int32))
      state, s = verbs.commit_step(state)
      statuses.append(jnp.asarray(s, jnp.int32))
      outs = outs.at[i].set(jnp.stack(layer_outs))

      def rewind_y(args):
        state, col_tags = args
        state, s = verbs.rewind(state, jnp.int32(Y), state.pos[Y] - 1)
        return state, col_tags.at[Y].set(TAG_Y_REWOUND), jnp.asarray(s, jnp.int32)

      def keep(args):
        return args[0], args[1], jnp.int32(OK)

      state, col_tags, s = jax.lax.cond(i == REWIND_AT, rewind_y, keep, (state, col_tags))
      statuses.append(s)
      statuses = jnp.stack(statuses)
      first_bad = statuses[jnp.argmax(statuses != OK)]
      return state, col_tags, outs, first_bad

    def stop(args):
      state, col_tags, outs = args
      return state, col_tags, outs, status

    state, col_tags, outs, status = jax.lax.cond(
        status == OK, rest, stop, (state, col_tags, outs))
    i = jnp.where(status == OK, i + 1, i)
    return state, col_tags, i, status, outs

  return jax.lax.while_loop(
      cond, body, (state, col_tags, jnp.asarray(start, jnp.int32), jnp.int32(OK), outs))


def test_scenario_47_while_loop_needs_rows_then_grows():
  """Scenario 47 variant: NEEDS_ROWS at iteration 3 (F = 8), grow, resume."""
  chex.clear_trace_counter()
  config = make_config(initial_capacity=8)
  # One trace per flat row count F: 8, then 32 after `pure.grow`.
  loop = jax.jit(chex.assert_max_traces(while_loop_47, n=2),
                 static_argnums=0, donate_argnums=1)
  cache_jit = prefilled_cache(config)
  cache_ref = prefilled_cache(config)

  state, col_tags, i, status, outs = loop(
      config, cache_jit.state, _initial_tags(config), jnp.int32(0))
  expected_outs, tags = facade_iterations_47(cache_ref, 0, 3, declare_next=True)

  assert int(i) == 3
  assert int(status) == jaxkv.Status.NEEDS_ROWS
  # x reaches 8 after three iterations; the iteration-3 step needs row 8.
  assert int(pure.rows_needed(config, state)) == 9
  assert state.k[0].shape[0] == 8
  np.testing.assert_allclose(np.asarray(outs)[:3, :, :3], expected_outs, atol=ATOL, rtol=0)
  # The state equals the facade's after 3 steps plus the iteration-3 declaration.
  expected = cache_ref.state
  assert int(state.phase) == int(expected.phase) == jaxkv.Phase.DECLARED
  for name in ("live", "pos", "hw", "held", "decl_ids", "decl_block", "decl_n"):
    np.testing.assert_array_equal(np.asarray(getattr(state, name)),
                                  np.asarray(getattr(expected, name)), err_msg=name)
  for kv in ("k", "v"):
    for layer in range(N_LAYERS):
      actual_kv = np.asarray(getattr(state, kv)[layer])
      expected_kv = np.asarray(getattr(expected, kv)[layer])
      assert actual_kv.shape == expected_kv.shape
      np.testing.assert_allclose(actual_kv[:, :config.max_seqs],
                                 expected_kv[:, :config.max_seqs], atol=ATOL, rtol=0)

  state = pure.grow(config, state, 32)
  assert state.k[0].shape[0] == 32
  state, _, i, status, outs_resumed = loop(config, state, col_tags, i)
  expected_rest, _ = facade_iterations_47(cache_ref, 3, N_ITERS, tags=tags)

  assert int(i) == N_ITERS
  assert int(status) == OK
  np.testing.assert_allclose(np.asarray(outs_resumed)[3:, :, :3], expected_rest,
                             atol=ATOL, rtol=0)
  assert_states_agree(state, cache_ref.state)


# ---------------------------------------------------------------------------
# Issue 2: three sequences with prefill, 16 decode steps, a fork, a rewind and
# an owner block, as a script run three ways.

OP_NONE, OP_NEW, OP_CLONE, OP_REWIND, OP_RM = range(5)
N_HANDLES = 4
HX, HY, HZ, HF = range(N_HANDLES)  # x, y, z and a fork slot.


def _script_rows():
  """The script: (op, a, b, c, handles, blocks, tags) per iteration.

  op NEW makes handle a; CLONE makes handle b from handle a with upto c (-1 for
  the whole sequence); REWIND moves handle a back by c; RM removes handle a.
  A row with handles runs one step after its op.
  """
  tag = {HX: 0, HY: 1, HZ: 2, HF: 3}
  rows = [(OP_NEW, HX, 0, 0, (), None, {}), (OP_NEW, HY, 0, 0, (), None, {}),
          (OP_NEW, HZ, 0, 0, (), None, {})]

  def step(handles, op=(OP_NONE, 0, 0, 0), blocks=None, tags=None):
    tags = tags or {}
    rows.append(op + (tuple(handles), blocks, tags))

  xyz = (HX, HY, HZ)
  xyzf = (HX, HY, HZ, HF)
  # Prefill: x 6, y 4, z 3 (padded steps included).
  step((HX,) * 4)
  step((HX, HY, HY, HY))
  step((HZ, HZ, HY))
  step((HX, HZ))
  # 16 decode steps.
  step(xyz)
  step(xyz)
  step((HZ, HY, HX))
  step(xyzf, op=(OP_CLONE, HX, HF, -1))  # fork of x at 9 (ring wrapped).
  step(xyzf)
  step((HF, HX))
  step(xyzf, op=(OP_REWIND, HY, 0, 2), tags={HY: 4})  # y rolls back 2, new tokens.
  step((HX, HY, HY, HZ))
  step((HX, HZ, HZ, HZ), blocks=[(1, 3)], tags={HZ: 5})  # z drafts an owner block.
  step(xyzf)
  step((HY, HX, HF, HZ))
  step(xyz, op=(OP_RM, HF, 0, 0))
  step(xyz)
  step(xyzf, op=(OP_CLONE, HY, HF, 13), tags={HF: 6})  # partial fork of y (at 14).
  step(xyzf)
  step(xyz)
  # Resolve per-step tags: a tag override lasts from its row on, except the
  # owner block's draft tag, which applies to that row only.
  resolved = []
  for op, a, b, c, handles, blocks, overrides in rows:
    row_tag = dict(tag)
    row_tag.update(overrides)
    if blocks is None:
      tag.update(overrides)
    resolved.append((op, a, b, c, handles, blocks, [row_tag[h] for h in handles]))
  return resolved


SCRIPT = _script_rows()


def _script_arrays():
  """SCRIPT as int32 arrays with a leading iteration axis (for `lax.scan`)."""
  n_rows = len(SCRIPT)
  arrays = {
      "op": np.zeros(n_rows, np.int32), "a": np.zeros(n_rows, np.int32),
      "b": np.zeros(n_rows, np.int32), "c": np.zeros(n_rows, np.int32),
      "n": np.zeros(n_rows, np.int32), "handles": np.zeros((n_rows, W), np.int32),
      "blocks": np.zeros((n_rows, W, 2), np.int32), "tags": np.zeros((n_rows, W), np.int32),
  }
  for r, (op, a, b, c, handles, blocks, tags) in enumerate(SCRIPT):
    arrays["op"][r], arrays["a"][r], arrays["b"][r], arrays["c"][r] = op, a, b, c
    arrays["n"][r] = len(handles)
    arrays["handles"][r, :len(handles)] = handles
    arrays["tags"][r, :len(handles)] = tags
    for j, (start, length) in enumerate(blocks or []):
      arrays["blocks"][r, j] = start, length
  return {name: jnp.asarray(value) for name, value in arrays.items()}


def run_script_facade(config):
  """The script through the facade. Returns (cache, outs per step)."""
  cache = jaxkv.BatchedSequenceCache(config, implementation="reference")
  ids = {}
  outs = []
  for op, a, b, c, handles, blocks, tags in SCRIPT:
    if op == OP_NEW:
      ids[a] = cache.seq_new()
      assert ids[a] is not None
    elif op == OP_CLONE:
      ids[b] = cache.seq_clone(ids[a], None if c < 0 else c)
      assert ids[b] is not None
    elif op == OP_REWIND:
      assert cache.rewind(ids[a], cache.pos(ids[a]) - c)
    elif op == OP_RM:
      assert cache.seq_rm(ids.pop(a))
    if handles:
      outs.append(facade_step(cache, [ids[h] for h in handles], tags, blocks))
  return cache, outs


def _padded_step_args(config, ids, blocks):
  seq_ids = np.full(W, config.max_seqs, np.int32)
  seq_ids[:len(ids)] = ids
  block_arr = np.zeros((W, 2), np.int32)
  for j, (start, length) in enumerate(blocks or []):
    block_arr[j] = start, length
  return jnp.asarray(seq_ids), jnp.int32(len(ids)), jnp.asarray(block_arr)


def run_script_jitted_verbs(config, verbs):
  """The script through separately jitted pure verbs driven from the host."""
  state = jaxkv.init_state(config)
  ids = {}
  outs, statuses = [], []
  for op, a, b, c, handles, blocks, tags in SCRIPT:
    if op == OP_NEW:
      state, status, new_id = verbs.seq_new(state)
      ids[a] = int(new_id)
    elif op == OP_CLONE:
      upto = pure.WHOLE if c < 0 else c
      state, status, new_id = verbs.seq_clone(state, jnp.int32(ids[a]), jnp.int32(upto))
      ids[b] = int(new_id)
    elif op == OP_REWIND:
      target = int(np.asarray(state.pos)[ids[a]]) - c
      state, status = verbs.rewind(state, jnp.int32(ids[a]), jnp.int32(target))
    elif op == OP_RM:
      state, status = verbs.seq_rm(state, jnp.int32(ids.pop(a)))
    else:
      status = OK
    statuses.append(int(status))
    if handles:
      seq_ids, n, block_arr = _padded_step_args(config, [ids[h] for h in handles], blocks)
      tag_arr = np.zeros(W, np.int32)
      tag_arr[:len(tags)] = tags
      state, step_outs, step_statuses = pure_step(
          verbs, state, seq_ids, n, block_arr, jnp.asarray(tag_arr))
      outs.append(np.asarray(step_outs)[:, :len(handles)])
      statuses.extend(np.asarray(step_statuses).tolist())
  return state, outs, statuses


def scan_script(config, state, script):
  """The whole script as one `lax.scan` over the pure API (ops via `lax.switch`)."""
  verbs = PureVerbs(config)
  ok = jnp.int32(OK)

  def op_none(state, handle_ids, row):
    return state, handle_ids, ok

  def op_new(state, handle_ids, row):
    state, status, new_id = verbs.seq_new(state)
    return state, handle_ids.at[row["a"]].set(jnp.asarray(new_id, jnp.int32)), jnp.asarray(
        status, jnp.int32)

  def op_clone(state, handle_ids, row):
    upto = jnp.where(row["c"] < 0, jnp.int32(pure.WHOLE), row["c"])
    state, status, new_id = verbs.seq_clone(state, handle_ids[row["a"]], upto)
    return state, handle_ids.at[row["b"]].set(jnp.asarray(new_id, jnp.int32)), jnp.asarray(
        status, jnp.int32)

  def op_rewind(state, handle_ids, row):
    s = handle_ids[row["a"]]
    state, status = verbs.rewind(state, s, state.pos[s] - row["c"])
    return state, handle_ids, jnp.asarray(status, jnp.int32)

  def op_rm(state, handle_ids, row):
    state, status = verbs.seq_rm(state, handle_ids[row["a"]])
    return state, handle_ids, jnp.asarray(status, jnp.int32)

  def body(carry, row):
    state, handle_ids = carry
    state, handle_ids, s_op = jax.lax.switch(
        row["op"], [op_none, op_new, op_clone, op_rewind, op_rm], state, handle_ids, row)

    def do_step(state):
      real = jnp.arange(W, dtype=jnp.int32) < row["n"]
      seq_ids = jnp.where(real, handle_ids[row["handles"]], jnp.int32(config.max_seqs))
      return pure_step(verbs, state, seq_ids, row["n"], row["blocks"], row["tags"])

    def no_step(state):
      return (state, jnp.zeros((N_LAYERS, W, N_Q_HEADS, HEAD_DIM), jnp.float32),
              jnp.full((N_LAYERS + 3,), OK, jnp.int32))

    state, outs, statuses = jax.lax.cond(row["n"] > 0, do_step, no_step, state)
    return (state, handle_ids), (outs, jnp.concatenate([s_op[None], statuses]))

  handle_ids = jnp.full((N_HANDLES,), -1, jnp.int32)
  (state, _), (outs, statuses) = jax.lax.scan(body, (state, handle_ids), script)
  return state, outs, statuses


def _issue2_config():
  # Four columns (x, y, z and a fork); capacity 128 allocated up front, so
  # nothing grows and every verb keeps one shape.
  return make_config(capacity=128, max_seqs=4, initial_capacity=128)


def test_issue2_script_in_one_jit_matches_facade():
  """Prefill, 16 decodes, a fork, a rewind and an owner block in one jit."""
  chex.clear_trace_counter()
  config = _issue2_config()
  cache, expected_outs = run_script_facade(config)
  loop = jax.jit(chex.assert_max_traces(scan_script, n=1),
                 static_argnums=0, donate_argnums=1)

  state, outs, statuses = loop(config, jaxkv.init_state(config), _script_arrays())

  np.testing.assert_array_equal(np.asarray(statuses), OK)
  step_rows = [r for r, row in enumerate(SCRIPT) if row[4]]
  outs = np.asarray(outs)
  for expected, r in zip(expected_outs, step_rows, strict=True):
    n = len(SCRIPT[r][4])
    np.testing.assert_allclose(outs[r, :, :n], expected, atol=ATOL, rtol=0,
                               err_msg=f"script row {r}")
  assert_states_agree(state, cache.state)

  # Same trace for a second run (fresh state, same shapes).
  state, _, statuses = loop(config, jaxkv.init_state(config), _script_arrays())
  np.testing.assert_array_equal(np.asarray(statuses), OK)


def test_issue2_jitted_verbs_trace_once_and_match_facade():
  """Each jitted pure verb traces once over the 20 varied steps of the script.

  The steps mix sequences (spanned twice, reordered), pad (n = 2, 3 of W = 4),
  wrap the ring (R = 7, positions past 20), fork, rewind, remove and draft an
  owner block; every status is OK and the outputs equal the facade's.
  """
  chex.clear_trace_counter()
  config = _issue2_config()
  cache, expected_outs = run_script_facade(config)

  state, outs, statuses = run_script_jitted_verbs(config, JittedVerbs(config))

  assert statuses == [OK] * len(statuses)
  assert sum(1 for row in SCRIPT if row[4]) == 20  # 4 prefill + 16 decode steps
  assert len(outs) == len(expected_outs) == 20
  for s, (actual, expected) in enumerate(zip(outs, expected_outs, strict=True)):
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=0, err_msg=f"step {s}")
  assert_states_agree(state, cache.state)
  pos = np.asarray(state.pos)
  assert pos.max() > state.k[1].shape[0] * 2  # The ring wrapped more than once.
