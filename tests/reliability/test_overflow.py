"""Issue 6, part 3: index arithmetic stays correct when flat offsets exceed 2**31.

A cache of 65,536 rows x 257 columns x 8 heads x 128 has 17.2e9 elements per
K/V array, so any flattened int32 offset would overflow. Nothing here allocates
such a cache: the verbs are traced and lowered with `jax.ShapeDtypeStruct`s,
the index functions of `pallas_kernels/indexing.py` run on int32 scalars near
2**31 against Python-int truth, and positions near 2**31 are reached by forging
`pos`/`hw` of a ring-only cache (whose storage is a few rows) through the pure
state, then checked step by step against `tests/model.py`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import drivers as D
import jaxkv
from model import Status
import pallas_kernels
from pallas_kernels import indexing
from reliability import harness as H

pure = jaxkv.pure
flat, ring = jaxkv.LayerPolicy.flat, jaxkv.LayerPolicy.ring
S = jax.ShapeDtypeStruct
INT32_MAX = 2**31 - 1

# --------------------------------------------------------------------------- index functions


def _i32(x):
  return jnp.asarray(x, jnp.int32)


BIG = [0, 1, 2**30, 2**31 - 300, 2**31 - 9, 2**31 - 2]


@pytest.mark.parametrize("num_rows, window", [(8, 5), (11, 4), (65536, 65536 - 7),
                                              (2**30, 2**30 - 7)],
                         ids=["R8", "R11", "R65536", "R2**30"])
def test_ring_index_functions_near_int32_max(num_rows, window):
  """row_of, read_start, key_positions, in_read_range, ring_runs and floors equal int truth."""
  for pos0 in BIG:
    for q_len in (1, 3):
      end = pos0 + q_len
      if end > INT32_MAX:
        continue
      lo = max(0, pos0 - window + 1)
      assert int(indexing.read_start(_i32(pos0), window=window)) == lo
      assert int(indexing.row_of(_i32(pos0), num_rows=num_rows, window=window)) == pos0 % num_rows
      a, first, second = (int(x) for x in indexing.ring_runs(_i32(lo), _i32(end),
                                                             num_rows=num_rows))
      assert (a, first + second) == (lo % num_rows, end - lo)
      assert first == min(end - lo, num_rows - a)
      rows = np.unique(np.clip(np.array([0, 1, a, (a + 1) % num_rows, num_rows - 1,
                                         end % num_rows, (end - 1) % num_rows]), 0,
                               num_rows - 1)).astype(np.int32)
      key = indexing.key_positions(jnp.asarray(rows), _i32(lo), _i32(end), num_rows=num_rows,
                                   window=window)
      got = np.asarray(indexing.in_read_range(key, _i32(lo), _i32(end)))
      truth = [lo + (int(r) - lo) % num_rows for r in rows]
      assert got.tolist() == [lo <= p < end for p in truth], (pos0, rows)
      for r, p, inside in zip(rows, truth, got):
        if inside:
          assert int(key[list(rows).index(r)]) == p
      for query in range(pos0, end):
        for kp in {lo, max(lo, query - window + 1), query, end - 1}:
          visible = bool(indexing.is_visible(_i32(kp), _i32(query), _i32(lo), _i32(end),
                                             _i32(indexing.KIND_CAUSAL), window=window))
          assert visible == (lo <= kp <= query and kp >= query - window + 1 and kp < end)
  for hw in BIG + [INT32_MAX]:
    want = 0 if hw <= num_rows else hw - num_rows + window - 1
    assert int(indexing.ring_floor(_i32(hw), num_rows=num_rows, window=window)) == want
    assert int(indexing.floor(_i32(hw), [(num_rows, window)])) == want


@pytest.mark.parametrize("num_rows, window, lo, rows", [
    (2**31 - 1, 2**31 - 8, 0, [0, 1, 2]),            # ring(2**31 - 8), W = 8
    (2**31 - 1, 2**31 - 8, 5, [5, 6, 7, 8]),
    (2**30 + 7, 2**30, 0, [2**30 - 1, 2**30]),        # ring(2**30), W = 8
], ids=["R2**31-1-start", "R2**31-1-mid", "R2**30+7"])
def test_key_positions_of_rings_over_2_30_rows(num_rows, window, lo, rows):
  """Ring row r holds position lo + ((r - lo) mod R) (CONTRACT §7.2), also for R > 2**30.

  Bug: `indexing.key_positions` computes `(rows - lo + num_rows) % num_rows` in
  int32; `rows + num_rows` overflows once R > 2**30 (allowed: CONTRACT §2 only needs
  w + max_write - 1 < 2**31). With R = 2**31 - 1 and lo = 0, rows 0, 1, 2 map to
  positions 0, 2147483646, 0, so the reference attention drops position 1 and
  reads row 2 as position 0; with ring(2**30) (R = 2**30 + 7) rows 2**30 - 1 and
  2**30 map to 20 and 21. Suggested fix (pallas_kernels/indexing.py,
  `key_positions`): `d = rows - lo % num_rows; d = jnp.where(d < 0, d + num_rows, d)`,
  whose intermediates stay below R, then `lo + d`.
  """
  end = lo + max(rows) + 1 if lo == 0 else lo + len(rows)
  got = indexing.key_positions(jnp.asarray(rows, jnp.int32), _i32(lo), _i32(end),
                               num_rows=num_rows, window=window)
  assert np.asarray(got).tolist() == [lo + (r - lo) % num_rows for r in rows]


def test_tile_helpers_near_int32_max():
  """visible_key_range, run_tiling, tile_of_key and tile_span on a wrapped ring at 2**31 - 40."""
  num_rows, window, block, align = 11, 4, 4, 2
  pos0, q_len = 2**31 - 40, 8
  end, lo = pos0 + q_len, pos0 - window + 1
  a, first, second = indexing.ring_runs(_i32(lo), _i32(end), num_rows=num_rows)
  start, stop = indexing.visible_key_range(_i32(pos0), _i32(end - 1), _i32(lo), _i32(end),
                                           _i32(0), window=window)
  assert (int(start), int(stop)) == (lo, end)
  tile0, num_first, num_second = indexing.run_tiling(a, first, second, block=block, align=align)
  seen = []
  for t in range(int(num_first) + int(num_second)):
    tile_row, rows_start, rows_end, key0 = (int(x) for x in indexing.tile_span(
        _i32(t), _i32(lo), a, first, second, tile0, num_first, block=block))
    for r in range(rows_start, rows_end):
      key = key0 + r - rows_start
      assert key % num_rows == r and lo <= key < end
      assert int(indexing.tile_of_key(_i32(key), _i32(lo), a, first, tile0, num_first,
                                      block=block)) == t
      seen.append(key)
  assert sorted(seen) == list(range(lo, end))


# --------------------------------------------------------------------------- huge caches, lowered

HUGE = jaxkv.CacheConfig(
    [jaxkv.LayerConfig(flat(), 8, 128), jaxkv.LayerConfig(ring(4096), 8, 128)],
    capacity=65536, max_seqs=256, max_write=16, kv_dtype=jnp.bfloat16, initial_capacity=65536)


def _huge_state():
  state = jax.eval_shape(lambda: jaxkv.init_state(HUGE))
  assert state.k[0].shape == (65536, 257, 8, 128)
  assert np.prod(state.k[0].shape) > 2**34
  return state


def _lowered_text(fn, *args):
  return jax.jit(fn).trace(*args).lower().as_text()


def _ops(text, name):
  """Each `stablehlo.<name>` op of `text`, from its line to its type signature (`: (...)`)."""
  lines, out = text.splitlines(), []
  for i, line in enumerate(lines):
    if f'"stablehlo.{name}"' in line or f"stablehlo.{name} " in line:
      chunk = [line]
      while " : (" not in chunk[-1] and i + len(chunk) < len(lines):
        chunk.append(lines[i + len(chunk)])
      out.append("\n".join(chunk))
  return out


def _kv_reshapes(text, shape):
  """Lines reshaping or bitcasting a tensor of the cache's shape (a flattening would show here)."""
  dims = "x".join(str(d) for d in shape)
  return [line for line in text.splitlines()
          if re.search(r"stablehlo\.(reshape|bitcast_convert)", line) and f"tensor<{dims}x" in line]


@pytest.mark.parametrize("verb", ["attend-flat", "attend-ring", "seq_clone", "prepare_step",
                                  "commit_step", "rewind", "seq_rm"])
def test_verbs_lower_at_17e9_elements_without_flattening(verb):
  """Every verb traces and lowers for [65536, 257, 8, 128] K/V; K/V are indexed per dimension.

  The lowered StableHLO must not reshape a cache-shaped tensor (a flattened
  view would need 64-bit offsets); gathers and scatters on it carry one index
  per dimension they address.
  """
  state = _huge_state()
  i32 = S((), jnp.int32)
  width = HUGE.max_write
  if verb.startswith("attend"):
    layer = 0 if verb == "attend-flat" else 1
    q = S((width, 16, 128), jnp.bfloat16)
    kv = S((width, 8, 128), jnp.bfloat16)
    fn = lambda s, q, k, v: pure.attend(HUGE, s, layer, q, k, v, implementation="reference")
    args = (state, q, kv, kv)
  elif verb == "seq_clone":
    fn, args = (lambda s, a, b: pure.seq_clone(HUGE, s, a, b)), (state, i32, i32)
  elif verb == "rewind":
    fn, args = (lambda s, a, b: pure.rewind(HUGE, s, a, b)), (state, i32, i32)
  elif verb == "seq_rm":
    fn, args = (lambda s, a: pure.seq_rm(HUGE, s, a)), (state, i32)
  elif verb == "prepare_step":
    fn, args = (lambda s: pure.prepare_step(HUGE, s)), (state,)
  else:
    fn, args = (lambda s: pure.commit_step(HUGE, s)), (state,)
  text = _lowered_text(fn, *args)
  for shape in {state.k[0].shape, state.k[1].shape}:
    assert not _kv_reshapes(text, shape), _kv_reshapes(text, shape)[:3]
  for shape in {state.k[0].shape, state.k[1].shape}:
    dims = "x".join(str(d) for d in shape)
    for op in _ops(text, "gather") + _ops(text, "scatter") + _ops(text, "dynamic_slice"):
      if f"tensor<{dims}x" in op.splitlines()[-1]:
        # Coordinates are int32 per addressed dimension (each dim < 2**31), never
        # an offset into a flattened view (no reshape above).
        assert re.search(r"tensor<(\d+x)*i32>", op.splitlines()[-1]), op


def test_kv_write_reference_at_17e9_elements_computes_indices_per_dimension():
  """kv_write_reference's scatter addresses (row, column) pairs, never a flat row*C+col offset."""
  cache = S((65536, 257, 8, 128), jnp.bfloat16)
  new = S((16, 8, 128), jnp.bfloat16)
  idx = S((16,), jnp.int32)
  text = _lowered_text(pallas_kernels.kv_write_reference, cache, cache, new, new, idx, idx,
                       S((), jnp.int32))
  assert not _kv_reshapes(text, (65536, 257, 8, 128))
  scatters = [op for op in _ops(text, "scatter") if "65536x257x8x128" in op]
  assert len(scatters) == 2, text
  for op in scatters:
    assert "scatter_dims_to_operand_dims = [0, 1]" in op, op
    assert "tensor<16x2xi32>" in op, op   # one (row, column) pair per token
  # No row stride (257 * 8 * 128 = 263168 elements) appears: nothing flattens (row, column).
  assert "dense<263168>" not in text


@pytest.mark.parametrize("window", [None, 4096], ids=["flat", "ring4096"])
def test_mosaic_gpu_kernels_lower_for_cuda_at_17e9_elements(window):
  """Both Mosaic GPU kernels lower for CUDA on CPU with [65536, 257, 8, 128] bf16 K/V.

  The kernels address K/V as `ref.at[rows, col, head]` (per-dimension TMA
  coordinates, each < 2**31), so no flat offset is formed in Python; lowering
  at this size proves the shapes are accepted end to end.
  """
  cache = S((65536, 257, 8, 128), jnp.bfloat16)
  write = jax.jit(pallas_kernels.kv_write, donate_argnums=(0, 1)).trace(
      cache, cache, S((16, 8, 128), jnp.bfloat16), S((16, 8, 128), jnp.bfloat16),
      S((16,), jnp.int32), S((16,), jnp.int32), S((), jnp.int32))
  text = write.lower(lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @(\w+)", text) == ["mosaic_gpu_v2"]
  attend = jax.jit(lambda q, k, v, info, n: pallas_kernels.varlen_attention(
      q, k, v, info, n, window=window, scale=0.1)).trace(
          S((16, 16, 128), jnp.bfloat16), cache, cache, S((16, 5), jnp.int32),
          S((), jnp.int32))
  text = attend.lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# --------------------------------------------------------------------------- positions near 2**31


NEAR = jaxkv.CacheConfig([jaxkv.LayerConfig(ring(5), 1, 4), jaxkv.LayerConfig(ring(2), 1, 4)],
                         capacity=INT32_MAX, max_seqs=3, max_write=4, kv_dtype=jnp.float32,
                         initial_capacity=8)


def _content(s: int, positions, layer: int):
  """K = 0, V0 = (p mod 1009) + 1, V1 = 100 s + layer: exact means, a sequence tag per row."""
  n = len(positions)
  q = np.ones((n, 1, 4), np.float32)
  k = np.zeros((n, 1, 4), np.float32)
  v = np.zeros((n, 1, 4), np.float32)
  v[:, 0, 0] = np.asarray(positions, np.int64) % 1009 + 1
  v[:, 0, 1] = 100 * s + layer
  return q, k, v


def _forged(starts: dict[int, int]):
  """A pure state and a model whose sequences sit at `starts` (pos = hw), history resident."""
  model = H.new_model(NEAR)
  state = jaxkv.init_state(NEAR)
  ks = [np.zeros(a.shape, np.float32) for a in state.k]
  vs = [np.zeros(a.shape, np.float32) for a in state.v]
  live = np.zeros(NEAR.max_seqs, np.int32)
  pos = np.zeros(NEAR.max_seqs, np.int32)
  for s, p in starts.items():
    model.seq_new()
    model._pos[s] = model._hw[s] = p
    live[s], pos[s] = 1, p
    for layer in range(NEAR.num_layers):
      rows = ks[layer].shape[0]
      for kp in range(max(0, p - rows), p):
        _, k, v = _content(s, [kp], layer)
        ks[layer][kp % rows, s], vs[layer][kp % rows, s] = k[0], v[0]
        model.hist[s][layer][kp] = (k[0].astype(np.float64), v[0].astype(np.float64))
  state = jaxkv.CacheState(
      k=tuple(jnp.asarray(a) for a in ks), v=tuple(jnp.asarray(a) for a in vs),
      live=jnp.asarray(live), pos=jnp.asarray(pos), hw=jnp.asarray(pos),
      held=jnp.asarray(pos.astype(np.int64).sum(), jnp.int32), phase=state.phase,
      decl_ids=state.decl_ids, decl_block=state.decl_block, decl_n=state.decl_n,
      attended=state.attended, step=state.step)
  return state, model


def test_steps_near_int32_max_match_the_model():
  """Sequences at 2**31 - 40 take steps, rewinds, forks and blocks until the budget is spent.

  Positions, ring rows (p mod R), floors, held and NO_ROOM are computed near
  2**31 - 1 and compared with the model after every call; every output row
  is exact (probe-like content).
  """
  top = INT32_MAX - 30 - 40
  state, model = _forged({0: top, 1: 40})
  rng = np.random.default_rng(0)
  ids_of = lambda: [int(x) for x in rng.choice([s for s in range(3) if model.live[s]],
                                               size=rng.integers(1, 5))]
  for i in range(60):
    action = rng.choice(["step", "step", "step", "rewind", "clone", "block"])
    if action == "rewind":
      s = int(rng.choice([s for s in range(3) if model.live[s]]))
      target = int(rng.choice([model.floor(s) - 1, model.floor(s), model.pos(s) - 1]))
      want = model.rewind(s, target)
      state, got = D.p_rewind(NEAR, state, jnp.int32(s), jnp.int32(target))
      assert Status(int(got)) == want
    elif action == "clone":
      s = int(rng.choice([s for s in range(3) if model.live[s]]))
      if model.live[2]:
        want = model.seq_rm(2)
        state, got = D.p_seq_rm(NEAR, state, jnp.int32(2))
        assert Status(int(got)) == want
      upto = int(rng.choice([model.floor(s) - 1, model.floor(s), INT32_MAX]))
      want, _ = model.seq_clone(s, None if upto == INT32_MAX else upto)
      state, got, _ = D.p_seq_clone(NEAR, state, jnp.int32(s), jnp.int32(upto))
      assert Status(int(got)) == want, (s, upto)
    else:
      ids = ids_of()
      blocks = [(len(ids) - 1, 1)] if action == "block" else []
      state = _near_step(state, model, ids, blocks)
    _check_control(state, model)
  assert model.held > INT32_MAX - 10, model.held   # the budget really ran out near 2**31


def _near_step(state, model, ids, blocks):
  width = NEAR.max_write
  want = model.declare_step(ids, blocks)
  padded = np.full(width, NEAR.max_seqs, np.int32)
  padded[:len(ids)] = ids
  rows = np.zeros((width, 2), np.int32)
  for i, block in enumerate(blocks):
    rows[i] = block
  state, got = D.p_declare(NEAR, state, jnp.asarray(padded), jnp.int32(len(ids)),
                           jnp.asarray(rows))
  assert Status(int(got)) == want, (ids, blocks)
  if want != Status.OK:
    return state
  assert model.prepare_step(grow=False) == Status.OK
  state, got = D.p_prepare(NEAR, state, None)
  assert Status(int(got)) == Status.OK
  positions = model.step["positions"]
  assert max(positions) < INT32_MAX
  for layer in range(NEAR.num_layers):
    parts = [_content(s, [p], layer) for s, p in zip(ids, positions)]
    q, k, v = (np.concatenate(x) for x in zip(*parts))
    _, expected, checked = model.attend(layer, q, k, v)
    pad = lambda x: np.concatenate([x, np.full((width - len(ids),) + x.shape[1:], np.nan,
                                               np.float32)])
    state, out, got = D.p_attend(NEAR, state, layer, *(jnp.asarray(pad(x)) for x in (q, k, v)))
    assert Status(int(got)) == Status.OK
    assert np.asarray(state.step.write_rows[layer])[:len(ids)].tolist() == model.write_rows(layer)
    H.assert_rows_match(np.asarray(out)[:len(ids)], expected, checked,
                        f"near 2**31 layer {layer} positions {positions}")
  assert model.commit_step() == Status.OK
  state, got = D.p_commit(NEAR, state)
  assert Status(int(got)) == Status.OK
  return state


def _check_control(state, model):
  got = dict(live=np.asarray(state.live).tolist(), pos=np.asarray(state.pos).tolist(),
             hw=np.asarray(state.hw).tolist(), held=int(state.held), phase=int(state.phase))
  assert got == model.control()
  assert D.floors(NEAR, state) == [model.floor(s) for s in range(NEAR.max_seqs)]
