"""Issue 6, part 4: identical inputs give bitwise-identical outputs and states (reference, CPU).

One seeded script of steps, forks, rewinds and removals runs three times: twice
through fresh facades and once through the jitted, donated pure verbs. Every
output and the final state (scratch column included) must agree bit for bit,
and serving a layer twice in one step must return the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import drivers as D
import jaxkv
from reliability import harness as H


def _bits(state) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(state)]


class _PureDriver:
  """The facade's verbs over the module-level jitted pure verbs (grows on NEEDS_ROWS)."""

  def __init__(self, config):
    self.config, self.state = config, jaxkv.init_state(config)

  def seq_new(self):
    self.state, status, s = D.p_seq_new(self.config, self.state)
    return int(s) if int(status) == 0 else None

  def seq_clone(self, src, upto):
    self.state, status, s = D.p_seq_clone(self.config, self.state, jnp.int32(src),
                                          jnp.int32(upto))
    return int(s) if int(status) == 0 else None

  def seq_rm(self, s):
    self.state, status = D.p_seq_rm(self.config, self.state, jnp.int32(s))
    return int(status) == 0

  def rewind(self, s, p):
    self.state, status = D.p_rewind(self.config, self.state, jnp.int32(s), jnp.int32(p))
    return int(status) == 0

  def declare_step(self, ids):
    width = self.config.max_write
    padded = np.full(width, self.config.max_seqs, np.int32)
    padded[:len(ids)] = ids
    self.state, status = D.p_declare(self.config, self.state, jnp.asarray(padded),
                                     jnp.int32(len(ids)), jnp.zeros((width, 2), jnp.int32))
    return int(status) == 0

  def prepare_step(self):
    self.state, status = D.p_prepare(self.config, self.state, None)
    if jaxkv.Status(int(status)) == jaxkv.Status.NEEDS_ROWS:
      needed = int(jaxkv.pure.rows_needed(self.config, self.state))
      rows = min(self.config.capacity, max(needed, 2 * H.flat_rows(self.config, self.state)))
      self.state = jaxkv.pure.grow(self.config, self.state, rows)
      self.state, status = D.p_prepare(self.config, self.state, None)
    assert int(status) == 0

  def attend(self, layer, q, k, v):
    n, width = q.shape[0], self.config.max_write
    pad = lambda x: jnp.asarray(np.concatenate(
        [x, np.zeros((width - n,) + x.shape[1:], x.dtype)]))
    self.state, out, status = D.p_attend(self.config, self.state, layer, pad(q), pad(k), pad(v))
    assert int(status) == 0
    return out[:n]

  def commit_step(self):
    self.state, status = D.p_commit(self.config, self.state)
    assert int(status) == 0


def _script(cache, entry, seed: int) -> list[bytes]:
  """A seeded mix of verbs; returns the bits of every output, in order."""
  config = entry.config
  rng = np.random.default_rng(seed)
  outputs = []
  for _ in range(3):
    cache.seq_new()
  for _ in range(25):
    live = [s for s in range(config.max_seqs) if bool(np.asarray(cache.state.live)[s])]
    action = rng.choice(["step"] * 5 + ["clone", "rewind", "rm", "new"])
    if not live or action == "new":
      outputs.append(repr(cache.seq_new()).encode())
      continue
    s = int(rng.choice(live))
    pos = int(np.asarray(cache.state.pos)[s])
    if action == "clone":
      outputs.append(repr(cache.seq_clone(s, int(rng.integers(0, pos + 2)))).encode())
    elif action == "rewind":
      outputs.append(repr(cache.rewind(s, int(rng.integers(0, pos + 1)))).encode())
    elif action == "rm":
      outputs.append(repr(cache.seq_rm(s)).encode())
    else:
      ids = [int(x) for x in rng.choice(live, size=rng.integers(1, config.max_write + 1))]
      if not cache.declare_step(ids):
        outputs.append(b"refused")
        continue
      cache.prepare_step()
      positions = np.asarray(cache.state.step.positions)[:len(ids)]
      for layer in range(config.num_layers):
        q, k, v = H.content(entry, layer, positions, [t + 1 for t in ids], rng)
        first = np.asarray(cache.attend(layer, q, k, v))
        again = np.asarray(cache.attend(layer, q, k, v))   # a layer served twice (CONTRACT §6.4)
        assert first.tobytes() == again.tobytes()
        outputs.append(first.tobytes())
      cache.commit_step()
  return outputs + _bits(cache.state)


@pytest.mark.parametrize("name", ["ring8+flat+ring2/W8/huge", "flat/W3/f16/gqa",
                                  "ring5+flat/W4"])
def test_repeated_runs_are_bitwise_identical(name):
  entry = H.POOL[name]
  runs = [_script(jaxkv.BatchedSequenceCache(entry.config, implementation="reference"), entry, 3)
          for _ in range(2)]
  runs.append(_script(_PureDriver(entry.config), entry, 3))
  assert len(runs[0]) == len(runs[1]) == len(runs[2])
  for i, (a, b, c) in enumerate(zip(*runs)):
    assert a == b, f"facade run 2 differs at item {i}"
    assert a == c, f"pure run differs from the facade at item {i}"
