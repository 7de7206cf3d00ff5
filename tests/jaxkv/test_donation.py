"""Scenario 48 (CONTRACT §10.6): donated verbs update K/V in place.

Every jitted verb and the jitted decode loop of scenario 47 are compiled with
the state donated (`static_argnums=0, donate_argnums=1`) at the scenario-48
size, and each must satisfy the three §10.6 checks:

1. the compiled HLO has no `copy` (or `copy-start`) whose result shape equals a
   K/V array's shape;
2. `compiled.memory_analysis().alias_size_in_bytes` covers every K/V byte;
3. no "donated buffers were not usable" warning, at lowering or at a real call.

Negative controls compile K/V writes without donation and a donation nothing
can use, so each check is shown to be able to fail.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drivers import has_hopper_gpu
import jaxkv

pure = jaxkv.pure

# Scenario 48: layers flat + ring(4), capacity 64, max_seqs 7, W = 4, bfloat16.
# K/V shapes are [64, 8, 2, 8] (flat) and [min(64, 4 + 4 - 1) = 7, 8, 2, 8].
N_KV_HEADS = 2
N_Q_HEADS = 4
HEAD_DIM = 8
CONFIG = jaxkv.CacheConfig(
    layers=(
        jaxkv.LayerConfig(jaxkv.LayerPolicy.flat(), N_KV_HEADS, HEAD_DIM),
        jaxkv.LayerConfig(jaxkv.LayerPolicy.ring(4), N_KV_HEADS, HEAD_DIM),
    ),
    capacity=64,
    max_seqs=7,
    max_write=4,
    kv_dtype=jnp.bfloat16,
    initial_capacity=64,
)
W = CONFIG.max_write
KV_SHAPES = ((64, 8, 2, 8), (7, 8, 2, 8))
KV_BYTES = 2 * sum(int(np.prod(s)) for s in KV_SHAPES) * 2  # K and V, 2 bytes each.

IMPLEMENTATIONS = ["reference"] + (["mosaic_gpu"] if has_hopper_gpu() else [])

# One HLO instruction: `[ROOT] %name = <result shape> <opcode>(...`. The result
# shape may be a tuple (copy-start returns `(dst, src, context)`).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s(?P<op>[\w\-]+)\(")
_ARRAY_SHAPE = re.compile(r"\b\w+\[([\d,]*)\]")


def kv_sized_copies(hlo_text: str) -> list[str]:
  """HLO lines of `copy`/`copy-start` instructions producing a K/V-shaped array.

  Args:
    hlo_text: `compiled.as_text()`.

  Returns:
    The offending instruction lines (empty when the cache is updated in place).
  """
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match is None or match["op"] not in ("copy", "copy-start"):
      continue
    for dims in _ARRAY_SHAPE.findall(match["shape"]):
      shape = tuple(int(d) for d in dims.split(",") if d)
      if shape in KV_SHAPES:
        found.append(line.strip())
        break
  return found


def test_kv_sized_copies_parser():
  """The HLO parser recognises plain and asynchronous copies of K/V shapes."""
  text = "\n".join([
      "  %copy.3 = bf16[64,8,2,8]{3,2,1,0} copy(%p.1)",
      "  ROOT %copy.4 = bf16[7,8,2,8]{3,2,1,0} copy(%p.2)",
      "  %copy-start = (bf16[64,8,2,8]{3,2,1,0}, bf16[64,8,2,8]{3,2,1,0}, u32[]) "
      "copy-start(%p.1)",
      "  %copy.5 = s32[7]{0} copy(%p.3)",
      "  %fusion = bf16[64,8,2,8]{3,2,1,0} fusion(%copy.3), kind=kLoop",
  ])
  assert len(kv_sized_copies(text)) == 3


def _copy_state(state):
  """A private copy of every leaf, so donating it leaves the source alive."""
  return jax.tree.map(jnp.copy, state)


def _content(seed: int, n_rows: int = W):
  """Seeded float32 q, k, v for `n_rows` step tokens."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((n_rows, N_Q_HEADS, HEAD_DIM), dtype=np.float32)
  k = rng.standard_normal((n_rows, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
  v = rng.standard_normal((n_rows, N_KV_HEADS, HEAD_DIM), dtype=np.float32)
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _facade_step(cache, ids, seed):
  """declare, prepare, attend every layer, commit through the facade."""
  assert cache.declare_step(ids)
  cache.prepare_step()
  q, k, v = _content(seed, len(ids))
  for layer in range(len(CONFIG.layers)):
    cache.attend(layer, q, k, v)
  cache.commit_step()


@pytest.fixture(name="cache")
def fixture_cache():
  """Three sequences a, b, c (ids 0, 1, 2) at positions 9, 6, 1; ring wrapped."""
  cache = jaxkv.BatchedSequenceCache(CONFIG, implementation="reference")
  a, b, c = cache.seq_new(), cache.seq_new(), cache.seq_new()
  assert (a, b, c) == (0, 1, 2)
  _facade_step(cache, [a, a, a, b], 0)
  _facade_step(cache, [a, a, b, b], 1)
  _facade_step(cache, [a, a, b, c], 2)
  _facade_step(cache, [a, a, b, b], 3)
  assert [cache.pos(s) for s in (a, b, c)] == [9, 6, 1]
  return cache


def _status(value) -> int:
  return int(np.asarray(value))


def _assert_in_place(fn, state, *args):
  """Runs the three §10.6 checks for `fn(config, state, *args)`.

  Args:
    fn: a function of `(config, state, *args)` returning the new state first.
    state: a state in the phase `fn` needs; it is not consumed (copies are).
    *args: further traced arguments.

  Returns:
    The outputs of one real donated call, whose status the caller checks.
  """
  # (3) at a real call: the first lowering of this jit object happens here.
  donated = _copy_state(state)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    outputs = jax.jit(fn, static_argnums=0, donate_argnums=1)(CONFIG, donated, *args)
    jax.block_until_ready(outputs)
  messages = [str(w.message) for w in caught]
  assert not [m for m in messages if "donated" in m], messages
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))

  # (1) and (2) on a fresh lowering (filterwarnings=error also catches (3)).
  compiled = jax.jit(fn, static_argnums=0, donate_argnums=1).lower(
      CONFIG, _copy_state(state), *args).compile()
  copies = kv_sized_copies(compiled.as_text())
  assert not copies, copies
  alias_bytes = compiled.memory_analysis().alias_size_in_bytes
  assert alias_bytes >= KV_BYTES, (alias_bytes, KV_BYTES)
  return outputs


def test_state_has_scenario_48_shapes(cache):
  """The K/V leaves have the shapes the copy check looks for."""
  state = cache.state
  assert [tuple(x.shape) for x in state.k] == list(KV_SHAPES)
  assert [tuple(x.shape) for x in state.v] == list(KV_SHAPES)
  assert all(x.dtype == jnp.bfloat16 for x in state.k + state.v)


def test_prepare_step_in_place(cache):
  """pure.prepare_step on a declared 4-token step (ring wraps) copies no K/V."""
  assert cache.declare_step([0, 1, 2, 0])

  def prepare(config, state):
    return pure.prepare_step(config, state)

  new_state, status = _assert_in_place(prepare, cache.state)
  assert _status(status) == jaxkv.Status.OK
  assert _status(new_state.phase) == jaxkv.Phase.PREPARED


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layer", [0, 1], ids=["flat", "ring"])
def test_attend_in_place(cache, layer, implementation):
  """pure.attend writes the layer's K/V in place (padded 3-token step)."""
  assert cache.declare_step([0, 1, 0])
  cache.prepare_step()
  q, k, v = _content(7)

  def attend(config, state, q, k, v):
    return pure.attend(config, state, layer, q, k, v, implementation=implementation)

  _, out, status = _assert_in_place(attend, cache.state, q, k, v)
  assert _status(status) == jaxkv.Status.OK
  assert out.shape == (W, N_Q_HEADS, HEAD_DIM)


def test_commit_step_in_place(cache):
  """pure.commit_step copies no K/V."""
  _facade_step(cache, [0, 1], 5)
  assert cache.declare_step([0, 2])
  cache.prepare_step()
  q, k, v = _content(6, 2)
  for layer in range(len(CONFIG.layers)):   # a commit needs every layer attended
    cache.attend(layer, q, k, v)

  def commit(config, state):
    return pure.commit_step(config, state)

  new_state, status = _assert_in_place(commit, cache.state)
  assert _status(status) == jaxkv.Status.OK
  assert _status(new_state.phase) == jaxkv.Phase.COMMITTED


def test_seq_clone_in_place(cache):
  """pure.seq_clone copies one column's rows, never the whole cache."""

  def clone(config, state, src, upto):
    return pure.seq_clone(config, state, src, upto)

  new_state, status, new_id = _assert_in_place(
      clone, cache.state, jnp.int32(0), jnp.int32(8))
  assert _status(status) == jaxkv.Status.OK
  assert _status(new_id) == 3
  assert _status(new_state.pos[3]) == 8


def test_seq_rm_in_place(cache):
  """pure.seq_rm copies no K/V."""

  def rm(config, state, s):
    return pure.seq_rm(config, state, s)

  new_state, status = _assert_in_place(rm, cache.state, jnp.int32(1))
  assert _status(status) == jaxkv.Status.OK
  assert _status(new_state.live[1]) == 0


def test_rewind_in_place(cache):
  """pure.rewind copies no K/V."""

  def rewind(config, state, s, position):
    return pure.rewind(config, state, s, position)

  new_state, status = _assert_in_place(rewind, cache.state, jnp.int32(0), jnp.int32(8))
  assert _status(status) == jaxkv.Status.OK
  assert _status(new_state.pos[0]) == 8


def _decode_loop(config, state, q, k, v):
  """Scenario 47's loop: 12 steps of [a, b, c] (one padded token), rewind at 6."""
  seq_ids = jnp.array([0, 1, 2, config.max_seqs], jnp.int32)
  blocks = jnp.zeros((config.max_write, 2), jnp.int32)

  def body(state, i):
    statuses = []
    state, status = pure.declare_step(config, state, seq_ids, jnp.int32(3), blocks)
    statuses.append(status)
    state, status = pure.prepare_step(config, state)
    statuses.append(status)
    out = q
    for layer in range(len(config.layers)):
      state, out, status = pure.attend(config, state, layer, out, k, v)
      statuses.append(status)
    state, status = pure.commit_step(config, state)
    statuses.append(status)

    def rewind_b(state):
      state, status = pure.rewind(config, state, jnp.int32(1), state.pos[1] - 1)
      return state, status

    def keep(state):
      return state, jnp.asarray(jaxkv.Status.OK, jnp.int32)

    state, status = jax.lax.cond(i == 6, rewind_b, keep, state)
    statuses.append(status)
    return state, jnp.stack([jnp.asarray(s, jnp.int32) for s in statuses])

  return jax.lax.scan(body, state, jnp.arange(12, dtype=jnp.int32))


def test_decode_loop_in_place(cache):
  """The jitted scan of scenario 47 updates the cache in place (loop carry)."""
  q, k, v = _content(11)
  new_state, statuses = _assert_in_place(_decode_loop, cache.state, q, k, v)
  assert np.all(np.asarray(statuses) == jaxkv.Status.OK)
  # 12 steps of one token each; b rewound once.
  assert np.asarray(new_state.pos)[:3].tolist() == [21, 17, 13]


def test_negative_control_without_donation(cache):
  """Without donation the same write shows a cache-sized copy and no aliasing.

  This is what the checks above would see if a verb dropped donation, so they
  are not vacuous.
  """
  assert cache.declare_step([0, 1, 0])
  cache.prepare_step()
  q, k, v = _content(7)

  def attend(config, state, q, k, v):
    return pure.attend(config, state, 0, q, k, v, implementation="reference")

  compiled = jax.jit(attend, static_argnums=0).lower(
      CONFIG, cache.state, q, k, v).compile()
  assert kv_sized_copies(compiled.as_text())
  assert compiled.memory_analysis().alias_size_in_bytes < KV_BYTES

  compiled = jax.jit(_decode_loop, static_argnums=0).lower(
      CONFIG, cache.state, q, k, v).compile()
  assert kv_sized_copies(compiled.as_text())
  assert compiled.memory_analysis().alias_size_in_bytes < KV_BYTES


def test_negative_control_unusable_donation(cache):
  """A donated state whose K/V no output can reuse raises the warning check (3)."""

  def reads_only(config, state):
    return state.pos + jnp.sum(state.k[0]).astype(jnp.int32)

  with pytest.warns(UserWarning, match="donated buffers were not usable"):
    jax.jit(reads_only, static_argnums=0, donate_argnums=1).lower(CONFIG, cache.state)


def _facade_calls(cache):
  """(name, call) pairs of accepted facade verbs, in an order that is valid."""
  q, k, v = _content(13, 2)
  return [
      ("seq_new", cache.seq_new),
      ("declare_step", lambda: cache.declare_step([0, 3])),
      ("prepare_step", cache.prepare_step),
      ("attend(0)", lambda: cache.attend(0, q, k, v)),
      ("attend(1)", lambda: cache.attend(1, q, k, v)),
      ("commit_step", cache.commit_step),
      ("seq_clone", lambda: cache.seq_clone(0, 9)),
      ("rewind", lambda: cache.rewind(0, 9)),
      ("seq_rm", lambda: cache.seq_rm(4)),
      ("clear", cache.clear),
  ]


def test_facade_donates_its_state(cache):
  """After each accepted facade verb, the previous state's K/V leaves are deleted.

  Only K/V are required: jit drops inputs a computation never reads (`clear`
  replaces `live`/`pos`/`hw` without reading them), and such an input is then
  neither donated nor deleted, which costs no copy.
  """
  for name, call in _facade_calls(cache):
    old = cache.state
    result = call()
    if name not in ("commit_step", "clear"):  # These return None (§10.5).
      assert result is not None and result is not False, name
    deleted = [leaf.is_deleted() for leaf in old.k + old.v]
    assert all(deleted), (name, deleted)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(cache.state)), name
