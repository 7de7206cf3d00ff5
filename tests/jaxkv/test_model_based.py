"""Scenario 50: a model-based random test of the facade (CONTRACT §4-§6, §8).

A hypothesis `RuleBasedStateMachine` drives `jaxkv.BatchedSequenceCache` with
every verb, valid and invalid arguments, owner blocks and right, wrong or no
positions, and replays each call on `Model`: the bookkeeping of the one
pure-Python model of the CONTRACT (`tests/model.py`, which shares no code with
jaxkv) plus the rows storage holds. After every call:

* return values and `StepError`s agree with the model;
* the control arrays (`live`, `pos`, `hw`, `held`, `phase`), the flat row count
  and the standing declaration agree with the model; a prepared `Step` equals
  the model's §7 encoding;
* a refusal (and a no-op) leaves the state bitwise unchanged, scratch excluded;
* every real output row has exact probe values: K = 0, V[..., 0] = p + 1,
  V[..., 1] = (p + 1)**2, so output channels 0 and 1 are the means of kp + 1
  and (kp + 1)**2 over the visible keys. The model tracks which position each
  storage row holds, so the prediction stays exact across uncommitted steps;
  a commit with a layer left unserved is refused (NOT_ATTENDED).

The budget is `JAXKV_HYPOTHESIS_EXAMPLES` examples per config (default below);
runs are derandomized unless `JAXKV_HYPOTHESIS_RANDOM=1`; `JAXKV_REPORT_CALLS=1`
prints what a run exercised. Each run also asserts that it met every outcome in
`MUST_OCCUR`, so a generator that drifts into vacuity fails.

Planted bugs this test caught (monkeypatched locally, never committed): the
floor ignored (`pallas_kernels.indexing.floor` returning 0), ring windows one
key too wide, commit advancing owner-block segments, and owner blocks attended
causally.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import hypothesis
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

import jaxkv
from model import CacheModel, Status
from oracle import tol, visible_positions
from scenario_utils import assert_same_state, snapshot

N_Q_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 4
CAPACITY = 24
MAX_SEQS = 3
INITIAL_CAPACITY = 2

# CONTRACT §6.1 / §10.2 phase values.
IDLE, DECLARED, PREPARED, COMMITTED = 0, 1, 2, 3

EXAMPLES = int(os.environ.get("JAXKV_HYPOTHESIS_EXAMPLES", "16"))
STEPS_PER_EXAMPLE = 150
RTOL = tol(jnp.float32)


def _layer(kind: str, window: int = 0):
  policy = jaxkv.LayerPolicy.flat() if kind == "flat" else jaxkv.LayerPolicy.ring(window)
  return jaxkv.LayerConfig(policy, N_KV_HEADS, HEAD_DIM)


CONFIGS = {
    "flat-ring3-w2": jaxkv.CacheConfig(
        layers=(_layer("flat"), _layer("ring", 3)), capacity=CAPACITY, max_seqs=MAX_SEQS,
        max_write=2, kv_dtype=jnp.float32, initial_capacity=INITIAL_CAPACITY),
    "ring5-flat-w4": jaxkv.CacheConfig(
        layers=(_layer("ring", 5), _layer("flat")), capacity=CAPACITY, max_seqs=MAX_SEQS,
        max_write=4, kv_dtype=jnp.float32, initial_capacity=INITIAL_CAPACITY),
}

# Stored-row markers of the model besides a position p >= 0.
ZERO = -1      # zero bytes (never written, or new rows of a growth)
UNKNOWN = -2   # unspecified by the CONTRACT (a fork's flat rows past its prefix, ...)


# ---------------------------------------------------------------------------
# The model.


@dataclasses.dataclass
class ModelStep:
  """The model's encoding of a prepared step (CONTRACT §7.1, unpadded)."""
  ids: list[int]
  block_flags: list[bool]
  positions: list[int]
  segments: list[tuple[int, int, int, int, int]]  # (q_start, q_len, col, pos0, kind)


class Model:
  """Scenario 50's model: the bookkeeping of `tests/model.CacheModel` plus the rows storage holds.

  Every verb runs on the one pure-Python model of CONTRACT §4-§6 (`self.book`); this
  class adds what that model leaves out on purpose, the storage: which position
  each row of each column holds, so probe values stay exact when a step commits
  with a layer left unserved (CONTRACT §6.4 allows it) and stale rows are read.

  Attributes:
    book: the `CacheModel` (live, pos, hw, held, floor, phase, declaration, step).
    stored: stored[l][col][row] = the position whose probe values the row holds,
      ZERO or UNKNOWN.
  """

  def __init__(self, config):
    self.book = CacheModel.for_config(config)
    self.windows = self.book.windows
    self.stored = [[[ZERO] * self.rows(l) for _ in range(self.book.max_seqs)]
                   for l in range(len(self.windows))]

  # Bookkeeping, read from the book.

  live = property(lambda self: self.book.live)
  pos = property(lambda self: self.book._pos)   # pylint: disable=protected-access
  hw = property(lambda self: self.book._hw)     # pylint: disable=protected-access
  held = property(lambda self: self.book.held)
  phase = property(lambda self: self.book.phase)
  decl = property(lambda self: self.book.decl)
  served = property(lambda self: self.book.served)   # layers attended this step (NOT_ATTENDED)
  flat_rows = property(lambda self: self.book.flat_rows)

  def is_live(self, s) -> bool:
    return self.book.is_live(s)

  def floor(self, s: int) -> int:
    return self.book.floor(s)

  def free_id(self):
    return self.book._lowest_free()   # pylint: disable=protected-access

  def derived_positions(self) -> list[int]:
    return self.book.derived_positions()

  @property
  def step(self) -> ModelStep | None:
    """The prepared step (PREPARED and COMMITTED), else None."""
    if self.phase not in (PREPARED, COMMITTED):
      return None
    st = self.book.step
    return ModelStep(list(st["ids"]), list(st["flags"]), list(st["positions"]),
                     list(st["segments"]))

  # Storage.

  def rows(self, layer: int) -> int:
    return self.flat_rows if self.windows[layer] is None else self.book.ring_rows(layer)

  def row(self, layer: int, p: int) -> int:
    return p if self.windows[layer] is None else p % self.book.ring_rows(layer)

  def _forget_column(self, s: int, first_position: int | None = None):
    """Marks column s's rows UNKNOWN: all, or those holding positions >= first_position.

    The CONTRACT calls these bytes stale and never has them read before a rewrite,
    so the model does not assume the implementation keeps them.
    """
    for per_col in self.stored:
      column = per_col[s]
      for r, held_pos in enumerate(column):
        if first_position is None or held_pos >= first_position:
          column[r] = UNKNOWN

  # Verbs, with the facade's results (CONTRACT §5, §6, §9, §10.5).

  def seq_new(self):
    return self.book.seq_new()[1]

  def seq_clone(self, src, upto):
    status, f = self.book.seq_clone(src, upto)
    if status != Status.OK:
      return None
    keep = self.pos[f]
    for layer, per_col in enumerate(self.stored):
      column = list(per_col[src])
      if self.windows[layer] is None:
        # Flat rows from keep up are unspecified (the whole column may be copied).
        column[keep:] = [UNKNOWN] * (len(column) - keep)
      per_col[f] = column
    return f

  def seq_rm(self, s) -> bool:
    if self.book.seq_rm(s) != Status.OK:
      return False
    self._forget_column(s)
    return True

  def rewind(self, s, position) -> bool:
    if self.book.rewind(s, position) != Status.OK:
      return False
    self._forget_column(s, position)
    return True

  def clear(self):
    self.book.clear()

  def declare_step(self, ids, blocks) -> bool:
    return self.book.declare_step(ids, blocks) == Status.OK

  def prepare_step(self, positions):
    """Returns the ModelStep, or raises ModelStepError."""
    old_rows = self.flat_rows
    status = self.book.prepare_step(positions)
    if status != Status.OK:
      raise ModelStepError(status.name)
    for layer, per_col in enumerate(self.stored):
      if self.windows[layer] is None:
        for column in per_col:
          column.extend([ZERO] * (self.flat_rows - old_rows))   # new rows are zero (CONTRACT §3)
    return self.step

  def attend(self, layer, shapes_ok: bool):
    """Writes the layer and returns per real token the expected (ch0, ch1) or None."""
    if self.phase != PREPARED or not 0 <= layer < len(self.windows) or not shapes_ok:
      raise ModelStepError("NOT_PREPARED or bad arguments")
    step = self.step
    self.served.add(layer)
    for s, p in zip(step.ids, step.positions):
      self.stored[layer][s][self.row(layer, p)] = p
    expected = []
    w = self.windows[layer]
    for _, q_len, col, pos0, kind in step.segments:
      for i in range(q_len):
        block = (pos0, q_len) if kind == 1 else None
        visible = visible_positions(pos0 + i, w, block=block)
        values = [self.stored[layer][col][self.row(layer, kp)] for kp in visible]
        if UNKNOWN in values:
          expected.append(None)
          continue
        ones = [0.0 if x == ZERO else float(x + 1) for x in values]
        expected.append((np.mean(ones), np.mean(np.square(ones))))
    return expected

  def commit_step(self) -> bool:
    """True if positions advanced; raises ModelStepError when nothing is prepared."""
    was_committed = self.phase == COMMITTED
    status = self.book.commit_step()
    if status != Status.OK:
      raise ModelStepError(status.name)
    return not was_committed


class ModelStepError(Exception):
  """The model's StepError."""


# ---------------------------------------------------------------------------
# The state machine.


def probe_inputs(positions, n_rows: int, *, n_q_heads=N_Q_HEADS, n_kv_heads=N_KV_HEADS,
                 head_dim=HEAD_DIM):
  """Probe q/k/v for the real tokens at `positions`, NaN-padded to `n_rows` rows."""
  q = np.full((n_rows, n_q_heads, head_dim), np.nan, np.float32)
  k = np.full((n_rows, n_kv_heads, head_dim), np.nan, np.float32)
  v = np.full((n_rows, n_kv_heads, head_dim), np.nan, np.float32)
  n = min(len(positions), n_rows)
  q[:n] = 1.0
  k[:n] = 0.0
  v[:n] = 0.0
  for t in range(n):
    v[t, :, 0] = positions[t] + 1
    v[t, :, 1] = (positions[t] + 1) ** 2
  return q, k, v


class CacheMachine(RuleBasedStateMachine):
  """Facade vs Model, one config per run."""

  config = None  # set by `machine_for`
  calls = 0      # facade calls over all examples of this class
  stats = None   # collections.Counter of what the run exercised

  def __init__(self):
    super().__init__()
    self.cache = jaxkv.BatchedSequenceCache(self.config, implementation="reference")
    self.model = Model(self.config)
    self.n_layers = len(self.config.layers)
    self.width = self.config.max_write
    self.next_layer = 0  # the layer protocol_call serves next in PREPARED
    self.check_control()

  # Helpers.

  def count(self, n: int = 1):
    type(self).calls += n

  def check_control(self):
    """Control arrays, F, the declaration and the step agree with the model."""
    state, model = self.cache.state, self.model
    np.testing.assert_array_equal(np.asarray(state.live), np.asarray(model.live, np.int32),
                                  err_msg="live")
    np.testing.assert_array_equal(np.asarray(state.pos), np.asarray(model.pos, np.int32),
                                  err_msg="pos")
    np.testing.assert_array_equal(np.asarray(state.hw), np.asarray(model.hw, np.int32),
                                  err_msg="hw")
    assert int(state.held) == model.held, ("held", int(state.held), model.held)
    assert int(state.phase) == model.phase, ("phase", int(state.phase), model.phase)
    for layer in range(self.n_layers):
      for kv in (state.k[layer], state.v[layer]):
        assert kv.shape == (model.rows(layer), MAX_SEQS + 1, N_KV_HEADS, HEAD_DIM), (
            layer, kv.shape, model.rows(layer))
    if model.phase in (DECLARED, PREPARED):
      ids, _ = model.decl
      n = len(ids)
      assert int(state.decl_n) == n
      assert np.asarray(state.decl_ids)[:n].tolist() == ids
    if model.phase in (PREPARED, COMMITTED):
      self.check_step(state.step)

  def check_step(self, step):
    """The Step equals the model's §7.1 encoding, padding included."""
    want = self.model.step
    n, W, M = len(want.ids), self.width, MAX_SEQS
    assert int(step.n_tokens) == n
    assert int(step.n_segments) == len(want.segments)
    assert np.asarray(step.seq_cols).tolist() == want.ids + [M] * (W - n)
    assert np.asarray(step.positions).tolist() == want.positions + [0] * (W - n)
    rows = [[self.model.row(l, p) for p in want.positions] + [0] * (W - n)
            for l in range(self.n_layers)]
    assert np.asarray(step.write_rows).tolist() == rows
    info = [list(seg) for seg in want.segments]
    info += [[n, 0, M, 0, 0]] * (W - len(info))
    assert np.asarray(step.seq_info).tolist() == info

  def id_arg(self, data):
    """Mostly a live id; sometimes any id in [-1, max_seqs]."""
    live = [s for s in range(MAX_SEQS) if self.model.live[s]]
    if live and data.draw(st.integers(0, 4), label="pick_live"):
      return data.draw(st.sampled_from(live), label="id")
    return data.draw(st.integers(-1, MAX_SEQS), label="id")

  def near(self, data, s, extra=()):
    """A position near the interesting values of sequence s (pos, floor, 0)."""
    pos = self.model.pos[s] if self.model.is_live(s) else 0
    floor = self.model.floor(s) if self.model.is_live(s) else 0
    candidates = sorted({-1, 0, 1, floor - 1, floor, floor + 1, pos - 1, pos, pos + 1,
                         *extra})
    if data.draw(st.booleans(), label="near"):
      return data.draw(st.sampled_from(candidates), label="position")
    return data.draw(st.integers(-1, CAPACITY + 1), label="position")

  def call_checked(self, name, facade_call, model_call, *, unchanged_if):
    """Runs one facade call and its model twin; compares results and the state.

    Args:
      name: for messages.
      facade_call: calls the facade; returns its result.
      model_call: calls the model; returns the expected result.
      unchanged_if: predicate on the model result: the state must be unchanged.

    Returns:
      (facade result, model result); StepErrors are returned as the exception.
    """
    before = snapshot(self.cache.state)
    try:
      got = facade_call()
    except jaxkv.StepError as e:
      got = e
    self.count()
    try:
      want = model_call()
    except ModelStepError as e:
      want = e
    got_error = isinstance(got, jaxkv.StepError)
    want_error = isinstance(want, ModelStepError)
    if want_error:
      outcome = "error"
    elif name == "commit_step" and want is False:
      outcome = "noop"  # a second commit
    elif want is False or (want is None and name != "clear"):
      outcome = "refused"
    else:
      outcome = "ok"
    self.stats[f"{name}:{outcome}"] += 1
    assert got_error == want_error, (name, got, want)
    if want_error or unchanged_if(want):
      assert_same_state(before, snapshot(self.cache.state))
    self.check_control()
    return got, want

  # Sequence verbs.

  @rule()
  def seq_new(self):
    got, want = self.call_checked("seq_new", self.cache.seq_new, self.model.seq_new,
                                  unchanged_if=lambda w: w is None)
    assert got == want

  @rule(data=st.data())
  def seq_clone(self, data):
    if self.model.free_id() is None and data.draw(st.booleans(), label="make_room"):
      self.seq_rm_any(data)  # all columns live: usually free one first
    src = self.id_arg(data)
    upto = None if data.draw(st.booleans(), label="whole") else self.near(
        data, src, extra=(100,))
    got, want = self.call_checked(
        "seq_clone", lambda: self.cache.seq_clone(src, upto),
        lambda: self.model.seq_clone(src, upto), unchanged_if=lambda w: w is None)
    assert got == want, ("seq_clone", src, upto)

  @rule(data=st.data())
  def seq_rm(self, data):
    self.seq_rm_any(data)

  def seq_rm_any(self, data):
    s = self.id_arg(data)
    got, want = self.call_checked("seq_rm", lambda: self.cache.seq_rm(s),
                                  lambda: self.model.seq_rm(s), unchanged_if=lambda w: not w)
    assert got is want, ("seq_rm", s)

  @rule(data=st.data())
  def rewind(self, data):
    s = self.id_arg(data)
    position = self.near(data, s)
    if self.model.is_live(s) and 0 <= position < self.model.floor(s):
      self.stats["rewind:below_floor"] += 1
    got, want = self.call_checked("rewind", lambda: self.cache.rewind(s, position),
                                  lambda: self.model.rewind(s, position),
                                  unchanged_if=lambda w: not w)
    assert got is want, ("rewind", s, position)

  @rule(data=st.data())
  def at_the_floor(self, data):
    """Rewind or clone the sequence with the highest floor at floor - 1 or floor."""
    live = [s for s in range(MAX_SEQS) if self.model.live[s]]
    if not live:
      return
    s = max(live, key=self.model.floor)
    target = self.model.floor(s) - data.draw(st.integers(0, 1), label="below")
    if data.draw(st.booleans(), label="clone"):
      got, want = self.call_checked(
          "seq_clone", lambda: self.cache.seq_clone(s, target),
          lambda: self.model.seq_clone(s, target), unchanged_if=lambda w: w is None)
      assert got == want, ("seq_clone", s, target)
    else:
      if 0 <= target < self.model.floor(s):
        self.stats["rewind:below_floor"] += 1
      got, want = self.call_checked(
          "rewind", lambda: self.cache.rewind(s, target),
          lambda: self.model.rewind(s, target), unchanged_if=lambda w: not w)
      assert got is want, ("rewind", s, target)

  @rule(data=st.data())
  def clear(self, data):
    if data.draw(st.integers(0, 5), label="clear_now"):
      return  # rare: clear drops everything
    got, _ = self.call_checked("clear", self.cache.clear, self.model.clear,
                               unchanged_if=lambda w: False)
    assert got is None

  @rule(data=st.data())
  def queries(self, data):
    s = data.draw(st.integers(-2, MAX_SEQS + 1), label="query_id")
    assert self.cache.pos(s) == (self.model.pos[s] if self.model.is_live(s) else 0)
    assert self.cache.is_live(s) == self.model.is_live(s)
    assert self.cache.max_seqs() == MAX_SEQS
    assert self.cache.capacity() == CAPACITY
    self.count(4)

  # The step protocol.

  def draw_valid_block(self, data, ids):
    """A valid owner block: a suffix of the last sequence's final run, longest first."""
    run_start = len(ids) - 1
    while run_start > 0 and ids[run_start - 1] == ids[-1]:
      run_start -= 1
    start = data.draw(st.integers(run_start, len(ids) - 1), label="block_start")
    return (start, len(ids) - start)

  def draw_declaration(self, data):
    live = [s for s in range(MAX_SEQS) if self.model.live[s]]
    if data.draw(st.integers(0, 9), label="bad_n"):
      n = data.draw(st.integers(1, self.width), label="n")
    else:
      n = data.draw(st.sampled_from([0, self.width + 1]), label="n")
    if live and data.draw(st.integers(0, 5), label="valid_ids"):
      ids = data.draw(st.lists(st.sampled_from(live), min_size=n, max_size=n), label="ids")
    else:
      ids = data.draw(st.lists(st.integers(-1, MAX_SEQS), min_size=n, max_size=n), label="ids")
    blocks = None
    kind = data.draw(st.integers(0, 5), label="blocks_kind")
    if kind == 1 and ids:
      blocks = [self.draw_valid_block(data, ids)]
    elif kind == 2:
      blocks = data.draw(st.lists(st.tuples(st.integers(-1, n + 1), st.integers(0, n + 1)),
                                  min_size=1, max_size=2), label="blocks")
    elif kind == 3:
      blocks = []
    return ids, blocks

  def declare(self, ids, blocks):
    got, want = self.call_checked(
        "declare_step", lambda: self.cache.declare_step(ids, owner_blocks=blocks),
        lambda: self.model.declare_step(ids, blocks), unchanged_if=lambda w: not w)
    assert got is want, ("declare_step", ids, blocks)
    if blocks:
      self.stats[f"declare_with_blocks:{'ok' if got else 'refused'}"] += 1
    return got

  def prepare(self, positions):
    was_prepared = self.model.phase == PREPARED
    got, want = self.call_checked(
        "prepare_step", lambda: self.cache.prepare_step(positions),
        lambda: self.model.prepare_step(positions),
        unchanged_if=lambda w: was_prepared)
    if not isinstance(want, ModelStepError):
      self.check_step(got)
      if not was_prepared:
        self.next_layer = 0
    return got

  def attend(self, layer, n_rows, *, bad=None):
    """Attends with probe content; `bad` names a deliberate shape error."""
    step = self.model.step if self.model.phase == PREPARED else None
    positions = step.positions if step is not None else []
    n_q_heads, head_dim, kv_rows = N_Q_HEADS, HEAD_DIM, n_rows
    if bad == "heads":
      n_q_heads = 3  # not a multiple of n_kv_heads = 2
    elif bad == "head_dim":
      head_dim = HEAD_DIM + 1
    elif bad == "rows":
      kv_rows = n_rows + 1
    q, _, _ = probe_inputs(positions, n_rows, n_q_heads=n_q_heads, head_dim=head_dim)
    _, k, v = probe_inputs(positions, kv_rows, head_dim=head_dim)
    n = len(positions)
    shapes_ok = bad is None and n_rows in (n, self.width)
    got, want = self.call_checked(
        "attend", lambda: self.cache.attend(layer, jnp.asarray(q), jnp.asarray(k),
                                            jnp.asarray(v)),
        lambda: self.model.attend(layer, shapes_ok), unchanged_if=lambda w: False)
    if isinstance(want, ModelStepError):
      return
    if layer == self.next_layer:
      self.next_layer += 1
    out = np.asarray(got)
    assert out.shape == (n_rows, N_Q_HEADS, HEAD_DIM) and out.dtype == np.float32, out.shape
    self.stats["max_hw"] = max(self.stats["max_hw"], max(self.model.hw))
    self.stats["max_flat_rows"] = max(self.stats["max_flat_rows"], self.model.flat_rows)
    for t, expected in enumerate(want):
      self.stats["rows_checked" if expected is not None else "rows_unspecified"] += 1
      if expected is None:
        continue  # a visible row holds unspecified bytes (a skipped layer)
      row = np.zeros((N_Q_HEADS, HEAD_DIM), np.float64)
      row[:, 0], row[:, 1] = expected
      np.testing.assert_allclose(out[t], row, rtol=RTOL, atol=0,
                                 err_msg=f"layer {layer} token {t} of {self.model.step}")

  def commit(self):
    was_committed = self.model.phase == COMMITTED
    got, _ = self.call_checked("commit_step", self.cache.commit_step, self.model.commit_step,
                               unchanged_if=lambda w: was_committed)
    assert got is None or isinstance(got, jaxkv.StepError)

  def any_declare(self, data):
    ids, blocks = self.draw_declaration(data)
    self.declare(ids, blocks)

  def any_prepare(self, data, mode=None):
    if mode is None:
      mode = data.draw(st.sampled_from(["none", "none", "right", "wrong"]), label="positions")
    model = self.model
    if model.phase == PREPARED:
      right = list(model.step.positions)
    elif model.phase == DECLARED:
      right = model.derived_positions()
    else:
      right = data.draw(st.lists(st.integers(0, 8), min_size=1, max_size=self.width),
                        label="positions_without_declaration")
    positions = None
    if mode == "right":
      positions = right
    elif mode == "wrong":
      how = data.draw(st.sampled_from(["shift", "one", "short", "long", "gap"]), label="wrong")
      positions = list(right)
      if how == "shift":
        positions = [p + 1 for p in positions]
      elif how == "one":
        t = data.draw(st.integers(0, len(positions) - 1), label="wrong_index")
        positions[t] += data.draw(st.sampled_from([-1, 1, 2]), label="delta")
      elif how == "short":
        positions = positions[:-1]
      elif how == "long":
        positions = positions + [positions[-1] + 1]
      else:
        positions = [positions[0] + 2 * i for i in range(len(positions))]
        if len(positions) == 1:
          positions = [positions[0] - 1]
    self.prepare(positions)

  def any_attend(self, data, layer=None, misuse=False):
    model = self.model
    n = len(model.step.positions) if model.phase == PREPARED else self.width
    if layer is None or not data.draw(st.integers(0, 9), label="keep_layer"):
      layer = data.draw(st.integers(-1, self.n_layers), label="layer")
    bad = None
    if misuse:
      how = data.draw(st.sampled_from(["layer", "T", "heads", "head_dim", "rows"]), label="bad")
      if how == "layer":
        layer = data.draw(st.sampled_from([-1, self.n_layers]), label="bad_layer")
      elif how != "T":
        bad = how
    if misuse and how == "T":
      n_rows = data.draw(st.sampled_from(
          sorted({max(1, n - 1), n + 1} - {self.width} or {n + 1})), label="bad_T")
    else:
      n_rows = data.draw(st.sampled_from(sorted({n, self.width})), label="T")
    self.attend(layer, n_rows, bad=bad)

  @rule(data=st.data())
  def misuse(self, data):
    """Wrong positions, ill-shaped attends, or any verb in any phase."""
    kind = data.draw(st.sampled_from(["positions", "attend", "declare", "prepare", "attend_any",
                                      "commit", "commit_twice"]), label="misuse")
    if kind == "positions":
      self.any_prepare(data, mode="wrong")
    elif kind == "attend":
      self.any_attend(data, misuse=True)
    elif kind == "declare":
      self.any_declare(data)
    elif kind == "prepare":
      self.any_prepare(data)
    elif kind == "attend_any":
      self.any_attend(data)
    elif kind == "commit":
      self.commit()
    else:
      self.commit()
      self.commit()

  @rule(data=st.data())
  def protocol_call(self, data):
    """One of declare/prepare/attend/commit, usually the one the phase expects.

    One call in three picks any of the four, so every verb also meets every
    phase (StepErrors, no-ops, replaced and dropped declarations).
    """
    phase = self.model.phase
    verbs = ["declare", "prepare", "attend", "commit"]
    if data.draw(st.integers(0, 2), label="natural"):
      if phase in (IDLE, COMMITTED):
        verb = "declare"
      elif phase == DECLARED:
        verb = "prepare"
      else:
        # Serve the layers in order, then commit; sometimes commit early.
        verb = "commit" if self.next_layer >= self.n_layers else data.draw(
            st.sampled_from(["attend"] * 5 + ["commit"]), label="early_commit")
    else:
      verb = data.draw(st.sampled_from(verbs), label="verb")
    if verb == "declare":
      self.any_declare(data)
    elif verb == "prepare":
      self.any_prepare(data)
    elif verb == "attend":
      self.any_attend(data, layer=self.next_layer if self.next_layer < self.n_layers else None)
    else:
      early = phase == PREPARED and self.next_layer < self.n_layers
      self.commit()   # refused (NOT_ATTENDED) when early
      if early:   # then serve the rest and commit, so an early commit still makes progress
        for layer in range(self.next_layer, self.n_layers):
          self.attend(layer, len(self.model.step.positions))
        self.commit()

  def make_room(self, data, tokens):
    """When the budget cannot take `tokens` more, usually rewind or remove a sequence."""
    if self.model.held + tokens <= CAPACITY or not data.draw(st.integers(0, 3), label="room"):
      return
    s = max(range(MAX_SEQS), key=lambda s: self.model.pos[s])
    target = max(self.model.floor(s), self.model.pos[s] - 4)
    if data.draw(st.booleans(), label="room_by_rewind") and target < self.model.pos[s]:
      got, want = self.call_checked(
          "rewind", lambda: self.cache.rewind(s, target),
          lambda: self.model.rewind(s, target), unchanged_if=lambda w: not w)
      assert got is want, ("rewind", s, target)
    else:
      got, want = self.call_checked("seq_rm", lambda: self.cache.seq_rm(s),
                                    lambda: self.model.seq_rm(s), unchanged_if=lambda w: not w)
      assert got is want, ("seq_rm", s)

  @rule(data=st.data())
  def whole_step(self, data):
    """A declared, prepared, fully served and committed step (most progress)."""
    self.make_room(data, self.width)
    live = [s for s in range(MAX_SEQS) if self.model.live[s]]
    if not live:
      self.seq_new()
      return
    n = data.draw(st.integers(1, self.width), label="n")
    ids = data.draw(st.lists(st.sampled_from(live), min_size=n, max_size=n), label="ids")
    blocks = None
    if data.draw(st.integers(0, 3), label="with_block") == 0:
      blocks = [self.draw_valid_block(data, ids)]
    if not self.declare(ids, blocks):
      return
    self.prepare(None)
    n_rows = data.draw(st.sampled_from([n, self.width]), label="T")
    for layer in range(self.n_layers):
      self.attend(layer, n_rows)
    self.commit()

  @rule(data=st.data())
  def decode_step(self, data):
    """One token for every live sequence, served and committed."""
    self.make_room(data, MAX_SEQS)
    live = [s for s in range(MAX_SEQS) if self.model.live[s]]
    if not live:
      self.seq_new()
      return
    ids = data.draw(st.permutations(live), label="order")[:self.width]
    if not self.declare(ids, None):
      return
    self.prepare(None)
    for layer in range(self.n_layers):
      self.attend(layer, len(ids))
    self.commit()


def machine_for(name: str):
  """A CacheMachine subclass bound to CONFIGS[name]."""
  return type(f"CacheMachine_{name}", (CacheMachine,),
              {"config": CONFIGS[name], "calls": 0, "stats": collections.Counter()})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_facade_agrees_with_model(name):
  """Scenario 50 for one config: every call agrees with the model."""
  machine = machine_for(name)
  settings = hypothesis.settings(
      max_examples=EXAMPLES,
      stateful_step_count=STEPS_PER_EXAMPLE,
      deadline=None,
      database=None,
      suppress_health_check=list(hypothesis.HealthCheck),
  )
  run_state_machine_as_test(machine, settings=settings)
  stats = machine.stats
  if os.environ.get("JAXKV_REPORT_CALLS"):
    print(f"{name}: {machine.calls} facade calls; {dict(sorted(stats.items()))}")
  # The run must have exercised what scenario 50 asks for (a vacuous run fails).
  assert machine.calls >= 40 * EXAMPLES, machine.calls
  if EXAMPLES >= 10:
    for key in MUST_OCCUR:
      assert stats[key] > 0, (key, dict(stats))
    assert stats["rows_checked"] >= 10 * EXAMPLES, dict(stats)
    assert stats["max_flat_rows"] == CAPACITY and stats["max_hw"] == CAPACITY, dict(stats)


# Outcomes every run of at least 10 examples must contain.
MUST_OCCUR = (
    "seq_new:ok", "seq_new:refused", "seq_clone:ok", "seq_clone:refused", "seq_rm:ok",
    "seq_rm:refused", "rewind:ok", "rewind:refused", "rewind:below_floor", "clear:ok",
    "declare_step:ok", "declare_step:refused", "declare_with_blocks:ok",
    "declare_with_blocks:refused", "prepare_step:ok", "prepare_step:error", "attend:ok",
    "attend:error", "commit_step:ok", "commit_step:error", "commit_step:noop",
)
