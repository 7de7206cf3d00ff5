"""Issue 6, part 1: stateful property tests of the facade and of the jitted pure verbs.

Hypothesis `RuleBasedStateMachine`s drive one cache with random verbs -- valid
and refused ones, ids out of range, wrong positions, steps that are prepared and
attended but never committed, owner blocks, growth -- and compare every result
with `tests/model.py`, a pure-Python model that shares no code with jaxkv.

After every rule:
  * return values / statuses (pure: the exact `Status`; facade: None/False or
    StepError) equal the model's;
  * a refused verb or a StepError left every state leaf bitwise equal (scratch
    column excluded, `scenario_utils.snapshot`);
  * live, pos, hw, held, phase, flat rows and every column's floor equal the
    model's; the pure driver also checks the standing declaration and the Step;
  * every real attention row equals the model's float64 attention over exactly
    the visible positions of its own sequence. Probe configs make this exact
    and tag each sequence in V channel 2, so a key read from another sequence
    or another position changes the output; the pure driver also NaN-poisons
    every K/V row no live sequence owns before attending.

Budget: we count rule steps (one verb, or one whole step for `full_step`, plus
the invariant check). CI runs 2 tests x 30 hypothesis runs x at most 50 steps,
3,000 steps in all (1,500 each, measured) (each test prints its count; with
JAXKV_RELIABILITY_REPORT=path it also appends them to that file as JSON lines).
JAXKV_RELIABILITY_EXAMPLES=N raises the runs so both tests together take about N
steps; JAXKV_RELIABILITY_RANDOM=1 (conftest's "random" hypothesis profile) draws fresh
random examples instead of hypothesis's derandomized (CI-stable) ones.
"""

from __future__ import annotations

import json
import os

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

import drivers as D
from drivers import poison_free_storage
import jaxkv
from model import FACADE_STEP_ERRORS, Phase, Status
from reliability import harness as H
from scenario_utils import assert_same_state, snapshot

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
HUGE_FACADE = [INT32_MAX, INT32_MIN, 2**31, 2**32, 2**40, -(2**63), 2**64 + 1]
HUGE_PURE = [INT32_MAX, INT32_MIN, INT32_MAX - 1, INT32_MIN + 1]
STEPS_PER_RUN = 50
RUNS = 30
STEPS = {"facade": 0, "pure": 0}
# Weighted actions; "full_step" is declare + prepare + attend every layer + (usually) commit.
ACTIONS = (["full_step"] * 8 + ["declare_step", "prepare_step", "attend", "commit_step"] * 2
           + ["seq_new"] * 2 + ["seq_clone", "rewind"] * 3 + ["seq_rm"] * 2 + ["clear", "grow"])


class CacheMachine(RuleBasedStateMachine):
  """Random verbs against a model; `PURE` picks the jitted pure verbs over the facade."""

  PURE = False

  # ------------------------------------------------------------------ setup and state

  @initialize(name=st.sampled_from(H.POOL_NAMES), seed=st.integers(0, 2**32 - 1))
  def setup(self, name, seed):
    self.name = name
    self.entry = H.POOL[name]
    self.config = self.entry.config
    self.model = H.new_model(self.config)
    self.rng = np.random.default_rng(seed)
    self.tags: dict[int, int] = {}
    self.next_tag = 1
    if self.PURE:
      self.state = jaxkv.init_state(self.config)
    else:
      self.cache = jaxkv.BatchedSequenceCache(self.config, implementation="reference")

  @property
  def current(self):
    return self.state if self.PURE else self.cache.state

  def _snap(self):
    return snapshot(self.current)

  def _count(self):
    STEPS["pure" if self.PURE else "facade"] += 1

  def _fresh_tag(self, s):
    self.tags[s] = self.next_tag
    self.next_tag += 1

  @property
  def width(self):
    return self.config.max_write

  # ------------------------------------------------------------------ strategies

  def choice(self, options):
    """A uniform choice from `options`, from the run's seeded generator."""
    return options[int(self.rng.integers(len(options)))]

  def int(self, lo: int, hi: int) -> int:
    """A uniform int in [lo, hi], from the run's seeded generator."""
    return int(self.rng.integers(lo, hi, endpoint=True))

  def _live(self):
    return [s for s in range(self.config.max_seqs) if self.model.live[s]]

  def draw_id(self, data):
    """An id: a live one 4 times in 5 when any is live, else anything near range or huge."""
    ms = self.config.max_seqs
    live = self._live()
    if live and self.int(0, 4) != 4:
      return self.choice(live)
    value = self.int(-2, ms + 1) if self.choice((0, 1)) else self.choice(
        HUGE_PURE if self.PURE else HUGE_FACADE)
    if not self.PURE and INT32_MIN <= value <= INT32_MAX and self.choice((False, True)):
      value = self.choice([np.int32, np.int64])(value)   # numpy ints are fine
    return value

  def draw_target(self, data, s):
    """A rewind/clone target around the interesting values of sequence `s`."""
    pos, floor = self.model.pos(_py(s)), self.model.floor(_py(s))
    huge = HUGE_PURE if self.PURE else HUGE_FACADE
    return self.choice([self.int(-2, pos + 2), floor - 1, floor, floor - 1, floor, pos,
                        pos - self.width, pos - self.width + 1, self.choice(huge)])

  def draw_ids(self, data):
    """A declaration's ids: usually 1..W live ids in runs, sometimes empty, wide or dead."""
    n = self.int(1, self.width)
    if self.int(0, 9) == 9:
      n = self.choice([0, self.width + 1])
    ids = []
    while len(ids) < n:
      s = self.draw_id(data)
      ids.extend([s] * self.int(1, max(1, n - len(ids))))
    return ids[:n]

  def draw_blocks(self, data, ids):
    """Owner blocks: none, valid ones (a suffix of an owner's last run), or random."""
    mode = self.choice(["none", "none", "valid", "valid", "random"])
    n = len(ids)
    if mode == "none" or n == 0:
      return []
    if mode == "random":
      return [(self.int(-1, n + 1), self.int(-1, n + 1)) for _ in range(self.int(1, 2))]
    candidates = sorted(set(_py(s) for s in ids))
    owners = [int(x) for x in self.rng.permutation(candidates)[:self.int(1, 2)]]
    blocks = []
    for owner in owners:
      last = max(t for t, s in enumerate(ids) if _py(s) == owner)
      first = last
      while first > 0 and _py(ids[first - 1]) == owner:
        first -= 1
      start = self.int(first, last)
      blocks.append((start, last - start + 1))
    return blocks

  # ------------------------------------------------------------------ checks

  def expect_refusal_or_error(self, before, status, call):
    """Runs a facade `call` whose model status is `status`; returns its result.

    A StepError status must raise StepError; any other non-OK status must
    return None/False; both must leave the state bitwise unchanged.
    """
    if status in FACADE_STEP_ERRORS:
      with pytest.raises(jaxkv.StepError, match=Status(status).name):
        call()
      assert_same_state(before, self._snap())
      return None
    result = call()
    if status != Status.OK:
      assert result is None or result is False, (Status(status).name, result)
      assert_same_state(before, self._snap())
    return result

  def check_pure_status(self, before, got, want):
    assert Status(int(got)) == want, f"status {Status(int(got)).name} != model {want.name}"
    if want != Status.OK:
      assert_same_state(before, self._snap())

  @invariant()
  def control_matches_model(self):
    if not hasattr(self, "model"):
      return
    self._count()
    state, model = self.current, self.model
    want = model.control()
    got = dict(live=np.asarray(state.live).tolist(), pos=np.asarray(state.pos).tolist(),
               hw=np.asarray(state.hw).tolist(), held=int(state.held),
               phase=int(state.phase))
    assert got == want, f"{self.name}: state {got} != model {want}"
    assert H.flat_rows(self.config, state) == model.flat_rows
    D.check_page_invariants(self.config, state)
    floors = D.floors(self.config, state)
    assert floors == [model.floor(s) for s in range(self.config.max_seqs)], floors
    self._check_declaration_and_step(state)
    if not self.PURE:
      for s in list(range(-1, self.config.max_seqs + 1)) + [2**31, -(2**40)]:
        assert self.cache.is_live(s) == model.is_live(s), s
        assert self.cache.pos(s) == model.pos(s), s

  def _check_declaration_and_step(self, state):
    model, width, ms = self.model, self.width, self.config.max_seqs
    if model.phase in (Phase.DECLARED, Phase.PREPARED):
      ids, flags = model.decl if model.phase == Phase.DECLARED else (
          model.step["ids"], model.step["flags"])
      n = len(ids)
      assert int(state.decl_n) == n
      assert np.asarray(state.decl_ids).tolist() == ids + [ms] * (width - n)
      assert np.asarray(state.decl_block).tolist() == [int(f) for f in flags] + [0] * (width - n)
    if model.phase in (Phase.PREPARED, Phase.COMMITTED):
      step, want = state.step, model.step
      n = len(want["ids"])
      assert int(step.n_tokens) == n
      assert np.asarray(step.positions).tolist() == want["positions"] + [0] * (width - n)
      assert np.asarray(step.seq_cols).tolist() == want["ids"] + [ms] * (width - n)
      for layer in range(self.config.num_layers):
        assert np.asarray(step.write_rows[layer]).tolist() == (
            model.write_rows(layer) + [0] * (width - n)), layer
      segs = [list(x) for x in want["segments"]]
      assert int(step.n_segments) == len(segs)
      assert np.asarray(step.seq_info).tolist() == segs + [[n, 0, ms, 0, 0]] * (width - len(segs))

  # ------------------------------------------------------------------ the one rule

  @rule(data=st.data())
  def act(self, data):
    """One action, drawn with weights: whole steps dominate so histories get long."""
    action = data.draw(st.sampled_from(ACTIONS), label="action")
    getattr(self, "do_" + action)(data)

  # ------------------------------------------------------------------ sequence verbs

  def do_seq_new(self, data=None):
    before = self._snap()
    status, want = self.model.seq_new()
    if self.PURE:
      self.state, got_status, got = D.p_seq_new(self.config, self.state)
      self.check_pure_status(before, got_status, status)
      assert int(got) == (want if want is not None else -1)
    else:
      got = self.expect_refusal_or_error(before, status, self.cache.seq_new)
      assert got == want
    if want is not None:
      self._fresh_tag(want)

  def do_seq_clone(self, data):
    src = self.draw_id(data)
    upto = self.choice([None, self.draw_target(data, src), self.draw_target(data, src)])
    before = self._snap()
    status, want = self.model.seq_clone(_py(src), None if upto is None else _py(upto))
    if self.PURE:
      arg = jaxkv.pure.WHOLE if upto is None else upto
      self.state, got_status, got = D.p_seq_clone(self.config, self.state, jnp.int32(src),
                                                 jnp.int32(arg))
      self.check_pure_status(before, got_status, status)
      assert int(got) == (want if want is not None else -1)
    else:
      got = self.expect_refusal_or_error(before, status, lambda: self.cache.seq_clone(src, upto))
      assert got == want, (src, upto, got, want)
    if want is not None:
      self._fresh_tag(want)

  def do_seq_rm(self, data):
    s = self.draw_id(data)
    before = self._snap()
    status = self.model.seq_rm(_py(s))
    if self.PURE:
      self.state, got = D.p_seq_rm(self.config, self.state, jnp.int32(s))
      self.check_pure_status(before, got, status)
    else:
      got = self.expect_refusal_or_error(before, status, lambda: self.cache.seq_rm(s))
      assert got == (status == Status.OK)

  def do_rewind(self, data):
    s = self.draw_id(data)
    position = self.draw_target(data, s)
    before = self._snap()
    status = self.model.rewind(_py(s), _py(position))
    if self.PURE:
      self.state, got = D.p_rewind(self.config, self.state, jnp.int32(s), jnp.int32(position))
      self.check_pure_status(before, got, status)
    else:
      got = self.expect_refusal_or_error(before, status, lambda: self.cache.rewind(s, position))
      assert got == (status == Status.OK), (s, position)

  def do_clear(self, data):
    self.model.clear()
    if self.PURE:
      self.state, status = D.p_clear(self.config, self.state)
      assert Status(int(status)) == Status.OK
    else:
      assert self.cache.clear() is None

  # ------------------------------------------------------------------ the step

  def _declare(self, ids, blocks, data):
    before = self._snap()
    if self.PURE:   # the pure API has W block rows; length 0 marks an unused row
      blocks = blocks[:self.width]
    model_blocks = [b for b in blocks if not (self.PURE and b[1] == 0)]
    status = self.model.declare_step([_py(s) for s in ids], model_blocks)
    if self.PURE:
      width = self.width
      n = len(ids)
      padded = [self.choice([self.config.max_seqs, 0, -1, INT32_MAX])
                for _ in range(width)]
      padded[:min(n, width)] = ids[:width]
      rows = np.zeros((width, 2), np.int32)
      places = list(self.rng.permutation(width))
      for b, r in zip(blocks, places):
        rows[r] = b
      self.state, got = D.p_declare(self.config, self.state, jnp.asarray(padded, jnp.int32),
                                    jnp.int32(n), jnp.asarray(rows))
      self.check_pure_status(before, got, status)
    else:
      got = self.expect_refusal_or_error(
          before, status, lambda: self.cache.declare_step(list(ids), owner_blocks=blocks or None))
      assert got == (status == Status.OK), (ids, blocks)
    return status

  def do_declare_step(self, data):
    ids = self.draw_ids(data)
    self._declare(ids, self.draw_blocks(data, ids), data)

  def _prepare(self, positions, data):
    """Prepares with `positions` (None or a list of n ints); the pure driver may get NEEDS_ROWS.

    In PREPARED, a prepare that does not raise is a no-op (CONTRACT §6.1): bitwise checked.
    """
    before = self._snap()
    was_prepared = self.model.phase == Phase.PREPARED
    status = self._prepare_call(positions, data, before)
    if was_prepared:
      assert_same_state(before, self._snap())
    return status

  def _prepare_call(self, positions, data, before):
    if self.PURE:
      status = self.model.prepare_step(positions, grow=False)
      arr = None
      if positions is not None:
        arr = [self.int(INT32_MIN, INT32_MAX) for _ in range(self.width)]
        arr[:len(positions)] = positions
        arr = jnp.asarray(arr, jnp.int32)
      self.state, got = D.p_prepare(self.config, self.state, arr)
      self.check_pure_status(before, got, status)
      return status
    status = self.model.prepare_step(positions, grow=True)
    self.expect_refusal_or_error(before, status, lambda: self.cache.prepare_step(positions))
    return status

  def do_prepare_step(self, data):
    positions = None
    mode = self.choice(["none", "right", "wrong", "length", "huge"])
    if self.model.phase in (Phase.DECLARED, Phase.PREPARED):
      derived = self.model.derived_positions()
      n = len(derived)
      if mode == "right":
        positions = derived
      elif mode == "wrong":
        t = self.int(0, n - 1)
        positions = list(derived)
        positions[t] += self.choice([-1, 1, 2])
      elif mode == "length" and not self.PURE:
        positions = derived + [derived[-1] + 1] if self.choice((False, True)) else derived[:-1]
      elif mode == "huge":
        positions = list(derived)
        positions[self.int(0, n - 1)] = self.choice(HUGE_PURE if self.PURE else HUGE_FACADE)
    elif mode != "none" and not self.PURE:
      positions = [0]
    if self.PURE and positions is not None and self.model.phase not in (
        Phase.DECLARED, Phase.PREPARED):
      positions = None
    self._prepare(positions, data)

  def do_grow(self, data):
    model = self.model
    if not self.PURE or not model.has_flat or model.flat_rows >= model.max_rows:
      return
    # A few sizes only: every new F recompiles every verb.
    rows = self.choice(sorted({min(model.max_rows, 2 * model.flat_rows),
                               min(model.max_rows, model.flat_rows + 1)}))
    old_rows = model.flat_rows
    old = snapshot(self.state)
    self.state = jaxkv.pure.grow(self.config, self.state, rows)
    model.grow(rows)
    for name, arr in snapshot(self.state).items():
      if arr.shape != old[name].shape:   # a flat K/V: old rows bitwise kept, new rows zero
        assert arr[:old_rows].tobytes() == old[name].tobytes(), name
        assert not np.any(arr[old_rows:].astype(np.float32)), name
      else:
        assert arr.tobytes() == old[name].tobytes(), name

  def _attend(self, layer, data, *, bad_layer=False):
    """Attends `layer` with fresh content and checks every real row (or the refusal)."""
    model, entry = self.model, self.entry
    phase_ok = model.phase == Phase.PREPARED
    if phase_ok:
      ids, positions = model.step["ids"], model.step["positions"]
    else:
      ids, positions = [0], [0]
    n = len(ids)
    good_layer = layer if 0 <= layer < self.config.num_layers else 0
    tags = [self.tags.get(_py(s), 0) for s in ids]
    q, k, v = H.content(entry, good_layer, positions, tags, self.rng)
    width_rows = self.PURE or self.choice((False, True))
    if width_rows and n < self.width:
      pad = lambda x: np.concatenate(
          [x, np.full((self.width - n,) + x.shape[1:], np.nan, np.float32)])
      q, k, v = pad(q), pad(k), pad(v)
    # Poison only before the step's first service: rows this step already wrote
    # on another layer are about to be committed, and no poison may touch them.
    if self.PURE and not model.served and self.choice((False, True)):
      self.state = poison_free_storage(self.state, self.config)
    before = self._snap()
    if bad_layer:
      if self.PURE:
        with pytest.raises(ValueError, match="layer"):
          D.p_attend(self.config, self.state, layer, *(jnp.asarray(x) for x in (q, k, v)))
        assert_same_state(before, self._snap())
      else:
        with pytest.raises(jaxkv.StepError, match="layer" if phase_ok else "NOT_PREPARED"):
          self.cache.attend(layer, q, k, v)
        assert_same_state(before, self._snap())
      return
    status, want, checked = model.attend(layer, q[:n], k[:n], v[:n])
    if self.PURE:
      self.state, out, got = D.p_attend(self.config, self.state, layer,
                                        *(jnp.asarray(x) for x in (q, k, v)))
      self.check_pure_status(before, got, status)
      if status != Status.OK:
        assert not np.any(np.asarray(out)), "a refused attend returns zeros"
        return
    else:
      out = self.expect_refusal_or_error(
          before, status, lambda: self.cache.attend(layer, jnp.asarray(q), jnp.asarray(k),
                                                    jnp.asarray(v)))
      if status != Status.OK:
        return
      assert out.shape[0] == q.shape[0], (out.shape, q.shape)
    H.assert_rows_match(np.asarray(out)[:n], want, checked,
                        f"{self.name} layer {layer} ids {ids} positions {positions}")

  def do_attend(self, data):
    layers = self.config.num_layers
    layer = self.int(0, layers - 1) if self.int(0, 5) else self.choice([-1, layers])
    self._attend(layer, data, bad_layer=not 0 <= layer < layers)

  def do_commit_step(self, data=None):
    before = self._snap()
    was_committed = self.model.phase == Phase.COMMITTED
    status = self.model.commit_step()
    if self.PURE:
      self.state, got = D.p_commit(self.config, self.state)
      self.check_pure_status(before, got, status)
    else:
      self.expect_refusal_or_error(before, status, self.cache.commit_step)
    if was_committed:   # a second commit is a no-op (CONTRACT §6.5)
      assert_same_state(before, self._snap())

  def do_full_step(self, data):
    """Declare live ids (blocks sometimes), prepare, attend every layer, usually commit."""
    live = self._live()
    if not live:
      self.do_seq_new()
      return
    room = self.config.capacity - self.model.held
    n = self.int(1, max(1, min(self.width, room)))
    ids = []
    while len(ids) < n:
      ids.extend([self.choice(live)] * self.int(1, n - len(ids)))
    blocks = self.draw_blocks(data, ids) if self.choice((False, True)) else []
    if blocks and not self.model.blocks_valid([_py(s) for s in ids], blocks):
      blocks = []
    if self._declare(ids, blocks, data) != Status.OK:
      return
    if not self.int(0, 3):   # a refused re-declaration leaves this one standing
      self._declare(ids, [(-1, 1)], data)
    if not self.int(0, 3):   # wrong positions: StepError / BAD_POSITIONS, nothing changes
      wrong = self.model.derived_positions()
      wrong[self.int(0, len(wrong) - 1)] += self.choice([-1, 1])
      assert self._prepare(wrong, data) == Status.BAD_POSITIONS
    status = self._prepare(None, data)
    if status == Status.NEEDS_ROWS:
      target = self.model.growth_target()
      self.state = jaxkv.pure.grow(self.config, self.state, target)
      self.model.grow(target)
      status = self._prepare(None, data)
    assert status == Status.OK, status
    for layer in range(self.config.num_layers):
      self._attend(layer, data)
    if self.int(0, 4) != 4:
      self.do_commit_step()


def _py(x) -> int:
  return int(x)


class FacadeMachine(CacheMachine):
  PURE = False


class PureMachine(CacheMachine):
  PURE = True


def _settings(runs: int):
  return settings(max_examples=H.stateful_runs(runs), stateful_step_count=STEPS_PER_RUN,
                  deadline=None, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.filter_too_much])


def _report(kind: str):
  path = os.environ.get("JAXKV_RELIABILITY_REPORT")
  print(f"{kind}: {STEPS[kind]} rule steps")
  if path:
    with open(path, "a") as f:
      f.write(json.dumps({"machine": kind, "steps": STEPS[kind]}) + "\n")


def test_facade_matches_model():
  """Random facade calls agree with the model; refusals and StepErrors change nothing."""
  run_state_machine_as_test(FacadeMachine, settings=_settings(RUNS))
  _report("facade")


def test_pure_verbs_match_model():
  """Random jitted, donated pure verbs agree with the model, with free storage NaN-poisoned."""
  run_state_machine_as_test(PureMachine, settings=_settings(RUNS))
  _report("pure")
