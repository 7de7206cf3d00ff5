"""Helpers for the fork, storage and owner-block scenarios (CONTRACT §11, 14–21 and 37–46).

They add to `scenario_utils` what those scenarios need: probe expectations
re-derived here from the CONTRACT §8 visibility table (never from `jaxkv` or
`pallas_kernels.indexing`), host-derived positions (§6.3), bit-level K/V views
and small drivers that feed probe content at the positions a step gets.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
from oracle import expected_probe
from oracle import tol
from scenario_utils import derived_positions
from scenario_utils import probe
from scenario_utils import run_step


def host_positions(cache, seq_ids, owner_blocks=None) -> list[int]:
  """Positions §6.3 and §9 derive: `pos(s)`, then one more per later token of `s`."""
  del owner_blocks  # a block continues its owner's count like any other run
  return derived_positions(cache.pos, seq_ids)


def probe_rows(positions):
  """Stacked probe q, k, v (float32 `[n, H, D]`) for tokens at `positions`."""
  parts = [probe(p) for p in positions]
  return tuple(np.stack([part[i] for part in parts]) for i in range(3))


def probe_step(cache, seq_ids, *, owner_blocks=None, T=None):
  """One `run_step` with probe content at the positions §6.3 derives.

  Returns:
    `(positions, outs)`: the host-derived positions and per-layer output rows.
  """
  positions = host_positions(cache, seq_ids)
  triple = probe_rows(positions)
  n_layers = len(cache.state.k)
  outs = run_step(cache, seq_ids, [triple] * n_layers, owner_blocks=owner_blocks, T=T)
  return positions, outs


def assert_probe(out, expected, what: str = "") -> None:
  """Asserts probe channels 0 and 1 of every head of `out` (`[n, H_q, D]`) equal `expected`.

  Args:
    out: attention output rows, one per query.
    expected: one `(ch0, ch1)` pair per row.
    what: context for the failure message.
  """
  out = np.asarray(out, np.float64)[..., :2]
  want = np.asarray(expected, np.float64)  # [n, 2]
  assert out.shape[0] == want.shape[0], what
  assert np.isfinite(out).all(), f"{what}: non-finite probe output"
  np.testing.assert_allclose(out, np.broadcast_to(want[:, None, :], out.shape),
                             rtol=tol(jnp.float32), atol=0, err_msg=what)


def assert_causal_probe(outs, positions, windows, what: str = "") -> None:
  """Checks every layer's rows of a causal probe step against §8."""
  for layer, window in enumerate(windows):
    assert_probe(outs[layer], [expected_probe(p, window) for p in positions],
                 f"{what} layer {layer} positions {positions}")


def advance(h, s, stop: int, width: int, what: str = "") -> np.ndarray:
  """Steps `s` of Harness `h` from `pos(s)` to `stop` in chunks of `width`.

  Every step is checked against `h`'s oracles, and with probe content also
  against the §8 expectations computed here.

  Returns:
    The last layer's output rows of the new tokens, concatenated.
  """
  rows = []
  while h.cache.pos(s) < stop:
    n = min(width, stop - h.cache.pos(s))
    positions = host_positions(h.cache, [s] * n)
    outs = h.step([s] * n)
    if h.content == "probe":
      assert_causal_probe(outs, positions, h.windows, f"{what} seq {s}")
    rows.append(outs[-1])
  assert h.cache.pos(s) == stop and rows, (h.cache.pos(s), stop)
  return np.concatenate(rows)


def state_copy(cache):
  """A private copy of the facade's current state (valid across later calls)."""
  return jax.tree.map(jnp.copy, cache.state)


def hw_of(cache, s) -> int:
  """`hw(s)` read from the state."""
  return int(np.asarray(cache.state.hw)[s])


def floor_of(config, state, s) -> int:
  """`jaxkv.pure.floor` as a Python int."""
  return int(jaxkv.pure.floor(config, state, jnp.int32(s)))


def bits(x) -> np.ndarray:
  """`x` as unsigned integers of its item size, for bitwise (NaN-equal) comparisons."""
  x = np.array(x, copy=True)
  return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))


def kv_bits(state, max_seqs: int) -> list[np.ndarray]:
  """Bit patterns of every K then every V array, sequence columns only (no scratch)."""
  return [bits(a)[:, :max_seqs] for a in tuple(state.k) + tuple(state.v)]


def step_fields(step) -> dict[str, list]:
  """The Step's fields as nested Python lists, checking each is int32."""
  out = {}
  for name in ("n_tokens", "n_segments", "seq_cols", "positions", "write_rows", "seq_info"):
    arr = np.asarray(getattr(step, name))
    assert arr.dtype == np.int32, (name, arr.dtype)
    out[name] = arr.tolist()
  return out


def prepared(cache, seq_ids, *, owner_blocks=None) -> dict[str, list]:
  """Declares (must be accepted) and prepares a step; returns its `step_fields`.

  The step is left PREPARED; a later `run_step`/`Harness.step` re-declares it
  (§6.1: a declaration in PREPARED drops the prepared step, committing nothing).
  """
  assert cache.declare_step(list(seq_ids), owner_blocks=owner_blocks) is True
  return step_fields(cache.prepare_step())


def nan_scratch(state, max_seqs: int):
  """`state` with the scratch column (`max_seqs`) of every K and V set to NaN."""
  def fill(a):
    return a.at[:, max_seqs].set(jnp.asarray(np.nan, a.dtype))
  return dataclasses.replace(state, k=tuple(fill(a) for a in state.k),
                             v=tuple(fill(a) for a in state.v))
