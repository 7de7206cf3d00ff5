"""Issue 6, part 2b: NaN and inf in one sequence's q/k/v are data, confined to that sequence.

Two facade caches run the same random steps; in one of them a victim
sequence's q, k or v rows carry NaN, inf or -inf in one step. Every other
sequence's outputs (that step and every later one) and storage columns must be
bitwise equal between the two caches, and equal to the model; the victim may
produce anything. No error is raised: non-finite values are data (CONTRACT §6.4).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from reliability import harness as H

CONFIGS = ["ring8+flat+ring2/W8/huge", "flat/W3/f16/gqa", "ring4-clamped/W4/bf16"]


def _columns(state, max_seqs):
  """Per layer, K and V as NumPy arrays (all columns, scratch included)."""
  return [(np.asarray(k), np.asarray(v)) for k, v in zip(state.k, state.v)]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("field", ["q", "k", "v"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_input_reaches_only_its_own_sequence(name, field, value):
  entry = H.POOL[name]
  config = entry.config
  rng = np.random.default_rng(7)
  clean = jaxkv.BatchedSequenceCache(config, implementation="reference")
  dirty = jaxkv.BatchedSequenceCache(config, implementation="reference")
  model = H.new_model(config)
  n_seqs = min(config.max_seqs, 3)
  for cache in (clean, dirty):
    assert [cache.seq_new() for _ in range(n_seqs)] == list(range(n_seqs))
  for _ in range(n_seqs):
    model.seq_new()
  victim = 0
  poison_step = 2
  for step in range(6):
    room = config.capacity - model.held
    if room < n_seqs:
      for s in range(n_seqs):   # keep going: drop each neighbour back to its floor
        target = max(model.floor(s), model.pos(s) - config.max_write)
        assert model.rewind(s, target) == 0
        assert clean.rewind(s, target) and dirty.rewind(s, target)
      room = config.capacity - model.held
    n = int(rng.integers(n_seqs, min(config.max_write, room) + 1)) if room >= n_seqs else room
    ids = [i % n_seqs for i in range(n)]
    rng.shuffle(ids)
    ids = [int(s) for s in ids]
    assert model.declare_step(ids) == 0 and model.prepare_step() == 0
    for cache in (clean, dirty):
      assert cache.declare_step(ids)
      cache.prepare_step()
    for layer in range(config.num_layers):
      q, k, v = H.content(entry, layer, model.step["positions"], [s + 1 for s in ids], rng)
      _, want, checked = model.attend(layer, q, k, v)
      out_clean = np.asarray(clean.attend(layer, q, k, v))
      bad = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
      if step == poison_step:
        rows = [t for t, s in enumerate(ids) if s == victim]
        bad[field][rows] = value
      out_dirty = np.asarray(dirty.attend(layer, bad["q"], bad["k"], bad["v"]))
      others = [t for t, s in enumerate(ids) if s != victim]
      assert out_dirty[others].tobytes() == out_clean[others].tobytes(), (step, layer)
      H.assert_rows_match(out_dirty[others], want[others], checked[others],
                          f"{name} step {step} layer {layer} neighbours")
      if step < poison_step or (step > poison_step and field == "q"):
        # Before the poison, and after a poisoned q (which leaves no history), the
        # victim is untouched too.
        assert out_dirty.tobytes() == out_clean.tobytes(), (step, layer)
    model.commit_step()
    for cache in (clean, dirty):
      cache.commit_step()
    for (kc, vc), (kd, vd) in zip(_columns(clean.state, config.max_seqs),
                                  _columns(dirty.state, config.max_seqs)):
      for s in range(n_seqs):
        if s != victim:
          assert kd[:, s].tobytes() == kc[:, s].tobytes(), (step, s)
          assert vd[:, s].tobytes() == vc[:, s].tobytes(), (step, s)
    if step == poison_step and field != "q":   # the value is data: the victim stores it
      victim_kv = [np.asarray(a[:, victim], np.float32) for kv in
                   _columns(dirty.state, config.max_seqs) for a in kv]
      assert any(not np.all(np.isfinite(a)) for a in victim_kv)
