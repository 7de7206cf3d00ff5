"""The jitted drivers every test family shares: which implementations run, the compiled pure verbs,
a facade-alike over them, state copies and the NaN poison of free storage.

Two tables of compiled pure verbs, one jit wrapper per verb and process, so
compilations are reused across tests: `p_*` donate the state (as the facade
does, CONTRACT §10.6; the caller must drop the old state), and `PureCache` drives
the undonated table (`pure_verbs()`), so a state read from it stays valid
across later calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv

pure = jaxkv.pure


def has_hopper_gpu() -> bool:
  """True on an NVIDIA GPU of compute capability >= 9.0."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return False
  return any(float(getattr(d, "compute_capability", "0")) >= 9.0 for d in devices)


# Implementations every kernel-backed scenario runs with: the reference always,
# the Mosaic GPU interpreter on CPU, the compiled kernels on a Hopper GPU.
KERNEL_IMPLEMENTATIONS = ["reference", "interpret"] + (
    ["mosaic_gpu"] if has_hopper_gpu() else [])


# --------------------------------------------------------------------------- donated pure verbs


def _jit(fn, **kw):
  return jax.jit(fn, static_argnums=0, donate_argnums=1, **kw)


p_seq_new = _jit(pure.seq_new)
p_seq_clone = _jit(pure.seq_clone)
p_seq_rm = _jit(pure.seq_rm)
p_rewind = _jit(pure.rewind)
p_clear = _jit(pure.clear)
p_declare = _jit(pure.declare_step)
p_prepare = _jit(pure.prepare_step)
p_commit = _jit(pure.commit_step)
p_attend = jax.jit(lambda cfg, state, layer, q, k, v: pure.attend(
    cfg, state, layer, q, k, v, implementation="reference"),
                   static_argnums=(0, 2), donate_argnums=1)


@jax.jit
def copy_state(state):
  """A fresh copy of every leaf (a donated verb then leaves this one intact)."""
  return jax.tree.map(jnp.copy, state)


_floors_jit = jax.jit(
    lambda config, state: jax.vmap(lambda s: pure.floor(config, state, s))(
        jnp.arange(config.max_seqs, dtype=jnp.int32)), static_argnums=0)


def floors(config, state) -> list[int]:
  """pure.floor of every column, in one jitted call."""
  return [int(x) for x in np.asarray(_floors_jit(config, state))]


# --------------------------------------------------------------------------- NaN poison


def _kept_rows(rows: int, window: int | None, live: int, pos: int, hw: int) -> np.ndarray:
  """Rows of one column that hold positions the cache legitimately keeps.

  Flat: rows [0, pos). Ring with R rows, written up to hw - 1: positions in
  [max(0, hw - R), pos) are intact and below pos (a fork may still resume
  anywhere at or above the floor, so all of them stay), each in row p mod R.
  """
  keep = np.zeros(rows, bool)
  if not live:
    return keep
  if window is None:
    keep[:pos] = True
    return keep
  for p in range(max(0, hw - rows), pos):
    keep[p % rows] = True
  return keep


def poison_free_storage(state, config):
  """Returns `state` with NaN in every K/V row that no live sequence owns.

  NaN goes to non-live columns, the scratch column, flat rows at or above
  pos(s) of each live column, and ring rows that do not hold a position in
  [max(0, hw(s) - R), pos(s)). Control values are unchanged. Any read of a row
  that the CONTRACT says is never read then turns an output NaN.
  """
  live = np.asarray(state.live)
  pos = np.asarray(state.pos)
  hw = np.asarray(state.hw)
  max_seqs = live.shape[0]

  def poison(arr, layer):
    rows, cols = arr.shape[:2]
    assert cols == max_seqs + 1, arr.shape
    policy = config.layers[layer].policy
    window = None if policy.kind == "flat" else int(policy.window)
    keep = np.zeros((rows, cols), bool)
    for s in range(max_seqs):
      keep[:, s] = _kept_rows(rows, window, int(live[s]), int(pos[s]), int(hw[s]))
    mask = jnp.asarray(keep)[:, :, None, None]
    return jnp.where(mask, arr, jnp.asarray(np.nan, arr.dtype))

  def poison_pool(arr):
    keep = kept_page_rows(state, config)
    return jnp.where(jnp.asarray(keep)[:, :, None, None], arr, jnp.asarray(np.nan, arr.dtype))

  def poison_any(arr, layer):
    paged = config.page_size is not None and config.layers[layer].policy.kind == "flat"
    return poison_pool(arr) if paged else poison(arr, layer)

  k = tuple(poison_any(a, l) for l, a in enumerate(state.k))
  v = tuple(poison_any(a, l) for l, a in enumerate(state.v))
  return dataclasses.replace(state, k=k, v=v)


def kept_page_rows(state, config) -> np.ndarray:
  """`bool[num_pages, page_size]`: pool rows holding a position some live sequence keeps.

  Row `r` of page `q` is kept iff a live column `c` holds `q` at table slot `j`
  with `j * page_size + r < pos(c)`; free pages, the scratch page and every row at
  or past its holders' lengths are not (the union over holders: it does not rely
  on a shared page being full for each of them).
  """
  table = np.asarray(state.page_table)
  live, pos = np.asarray(state.live), np.asarray(state.pos)
  size = config.page_size
  keep = np.zeros((config.num_pages, size), bool)
  for c in np.nonzero(live)[0]:
    for p in range(int(pos[c])):
      keep[table[c, p // size], p % size] = True
  return keep


def check_page_invariants(config, state) -> None:
  """Asserts CONTRACT §3.1's page-table invariants on concrete values (no jaxkv code).

  Each live column holds a prefix of table slots covering at least its `pos`,
  no page twice; every other entry and the whole scratch row hold the scratch
  page; `page_refs[p]` is the number of live-column entries holding `p` (the sum
  of the counts is the number of entries held); a page shared by a column lies
  below its first write slot `pos // page_size`, a full page of every column
  holding it (so no step writes a shared page: `rewind` copies a shared page it
  ends in); no column holds a slot past `ceil((pos + W) / P)`; the pages in use
  fit the pool.
  """
  if config.page_size is None:
    assert state.page_table is None and state.page_refs is None
    return
  table, refs = np.asarray(state.page_table), np.asarray(state.page_refs)
  live, pos = np.asarray(state.live), np.asarray(state.pos)
  size, scratch = config.page_size, config.num_pages - 1
  # One sequence holds at most max_seq_len positions (capacity when unset).
  limit = config.capacity if config.max_seq_len is None else config.max_seq_len
  slots = -(-limit // size)
  assert table.shape == (config.max_seqs + 1, slots) and refs.shape == (config.num_pages,)
  assert np.all(table[-1] == scratch), f"scratch row {table[-1]}"
  counts = np.zeros(config.num_pages, np.int64)
  for c in range(config.max_seqs):
    row = table[c]
    held = row != scratch
    if not live[c]:
      assert not held.any(), f"non-live column {c} holds pages {row}"
      continue
    n = int(held.sum())
    assert held[:n].all() and not held[n:].any(), f"column {c} holds no prefix: {row}"
    assert n * size >= pos[c], f"column {c}: {n} pages cannot hold pos {pos[c]}"
    # A step adds at most W positions, and every verb that ends one trims to `pos`: so no
    # column holds a slot past its pos plus one step (prepare_step only looks that far).
    assert n <= -(-(int(pos[c]) + config.max_write) // size), (
        f"column {c} holds {n} pages, past pos {pos[c]} + W {config.max_write}")
    assert len(set(row[:n].tolist())) == n, f"column {c} holds a page twice: {row}"
    np.add.at(counts, row[:n], 1)
  assert refs[scratch] == 0 and np.array_equal(refs, counts), f"refs {refs} != {counts}"
  assert int(refs.sum()) == int(sum((table[c] != scratch).sum()
                                    for c in range(config.max_seqs) if live[c]))
  for c in np.nonzero(live)[0]:
    for j, page in enumerate(table[c]):
      if page != scratch and refs[page] > 1:
        assert j < pos[c] // size, (
            f"column {c} (pos {pos[c]}) shares page {page} at slot {j} >= pos // P")
  assert int((counts > 0).sum()) <= config.num_pages - 1


# --------------------------------------------------------------------------- undonated pure verbs


@functools.cache
def pure_verbs() -> dict:
  """One undonated jit wrapper per pure verb, shared by every PureCache so compilations are reused."""
  verbs = {name: jax.jit(getattr(pure, name), static_argnums=0)
           for name in ("seq_new", "seq_clone", "seq_rm", "rewind", "declare_step",
                        "prepare_step", "commit_step", "rows_needed", "clear")}

  def attend(cfg, state, layer, q, k, v, scale, *, implementation):
    return pure.attend(cfg, state, layer, q, k, v, scale=scale, implementation=implementation)

  verbs["attend"] = jax.jit(attend, static_argnums=(0, 2, 6),
                            static_argnames=("implementation",))
  return verbs


class PureCache:
  """A facade-alike over `jaxkv.pure` whose `state` may be replaced between calls.

  It exists so that scenarios can NaN-poison free storage (`poison()`) before a
  step, which the facade does not allow. It follows CONTRACT §10.3/§10.5: Python
  lists in, fixed-shape int32 arrays to the jitted pure verbs, flat growth on
  the host when prepare reports NEEDS_ROWS. A StepError status raises
  AssertionError naming the status (error behaviour is tested on the facade).

  Args:
    config: the jaxkv.CacheConfig.
    implementation: passed to `jaxkv.pure.attend`.
  """

  def __init__(self, config, *, implementation: str | None = "reference"):
    self.config = config
    self.implementation = implementation
    self.state = jaxkv.init_state(config)
    jitted = pure_verbs()
    self._seq_new = jitted["seq_new"]
    self._seq_clone = jitted["seq_clone"]
    self._seq_rm = jitted["seq_rm"]
    self._rewind = jitted["rewind"]
    self._declare = jitted["declare_step"]
    self._prepare = jitted["prepare_step"]
    self._commit = jitted["commit_step"]
    self._rows_needed = jitted["rows_needed"]
    self._attend = functools.partial(jitted["attend"], implementation=implementation)

  def poison(self) -> None:
    """NaN-fills every K/V row no live sequence owns (see `poison_free_storage`)."""
    self.state = poison_free_storage(self.state, self.config)

  def _ok(self, status, verb):
    status = jaxkv.Status(int(status))
    return status == jaxkv.Status.OK

  def max_seqs(self) -> int:
    return self.config.max_seqs

  def capacity(self) -> int:
    return self.config.capacity

  def is_live(self, s) -> bool:
    return 0 <= s < self.config.max_seqs and bool(np.asarray(self.state.live)[s])

  def pos(self, s) -> int:
    return int(np.asarray(self.state.pos)[s]) if self.is_live(s) else 0

  def seq_new(self):
    self.state, status, s = self._seq_new(self.config, self.state)
    return int(s) if self._ok(status, "seq_new") else None

  def seq_clone(self, src, upto=None):
    upto = jaxkv.pure.WHOLE if upto is None else upto
    self.state, status, s = self._seq_clone(self.config, self.state, jnp.int32(src),
                                            jnp.int32(upto))
    return int(s) if self._ok(status, "seq_clone") else None

  def seq_rm(self, s) -> bool:
    self.state, status = self._seq_rm(self.config, self.state, jnp.int32(s))
    return self._ok(status, "seq_rm")

  def rewind(self, s, position) -> bool:
    self.state, status = self._rewind(self.config, self.state, jnp.int32(s), jnp.int32(position))
    return self._ok(status, "rewind")

  def clear(self) -> None:
    self.state, status = pure_verbs()["clear"](self.config, self.state)
    assert self._ok(status, "clear")

  def declare_step(self, seq_ids, owner_blocks=None) -> bool:
    width = self.config.step_width
    ids = np.full((width,), self.config.max_seqs, np.int32)
    ids[:min(len(seq_ids), width)] = list(seq_ids)[:width]
    blocks = np.zeros((width, 2), np.int32)
    for i, (start, length) in enumerate(owner_blocks or ()):
      blocks[i] = (start, length)
    self.state, status = self._declare(self.config, self.state, jnp.asarray(ids),
                                       jnp.int32(len(seq_ids)), jnp.asarray(blocks))
    return self._ok(status, "declare_step")

  def prepare_step(self, positions=None):
    arr = None
    if positions is not None:
      arr = np.zeros((self.config.step_width,), np.int32)
      arr[:len(positions)] = list(positions)
      arr = jnp.asarray(arr)
    self.state, status = self._prepare(self.config, self.state, arr)
    if jaxkv.Status(int(status)) == jaxkv.Status.NEEDS_ROWS:
      required = int(self._rows_needed(self.config, self.state))
      flat = [a.shape[0] for a, lc in zip(self.state.k, self.config.layers)
              if lc.policy.kind == "flat"]
      cap = self.config.max_seq_len or self.config.capacity   # CONTRACT §3: F <= max_seq_len
      rows = min(cap, max(required, 2 * flat[0]))
      self.state = jaxkv.pure.grow(self.config, self.state, rows)
      self.state, status = self._prepare(self.config, self.state, arr)
    assert self._ok(status, "prepare_step"), f"prepare_step: {jaxkv.Status(int(status)).name}"
    return self.state.step

  def attend(self, layer, q, k, v, scale=None):
    n = q.shape[0]
    width = self.config.step_width
    if n != width:
      pad = lambda x: jnp.concatenate(
          [x, jnp.zeros((width - n,) + x.shape[1:], x.dtype)], axis=0)
      q, k, v = pad(q), pad(k), pad(v)
    self.state, out, status = self._attend(self.config, self.state, layer, q, k, v, scale)
    assert self._ok(status, "attend"), f"attend: {jaxkv.Status(int(status)).name}"
    return out[:n]

  def commit_step(self) -> None:
    self.state, status = self._commit(self.config, self.state)
    assert self._ok(status, "commit_step"), f"commit_step: {jaxkv.Status(int(status)).name}"


def assert_serve_loop_in_place(graphdef, config, widths, params, ls) -> None:
  """The serving loop, compiled with `ls` donated, copies no K/V-sized buffer and aliases
  at least every K/V byte (the cache is updated in place across the whole loop)."""
  import re   # pylint: disable=g-import-not-at-top
  from jaxkv.serve.loop import serve_loop   # pylint: disable=g-import-not-at-top
  kv_shapes = {tuple(a.shape) for a in ls.cache.k}
  compiled = jax.jit(serve_loop, static_argnums=(0, 1, 2), donate_argnums=4).lower(
      graphdef, config, widths, params, ls, jnp.int32(8)).compile()
  instruction = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s(?P<op>[\w\-]+)\(")
  copies = []
  for line in compiled.as_text().splitlines():
    match = instruction.match(line)
    if match and match["op"] in ("copy", "copy-start"):
      for dims in re.findall(r"\b\w+\[([\d,]*)\]", match["shape"]):
        if tuple(int(d) for d in dims.split(",") if d) in kv_shapes:
          copies.append(line.strip())
  assert not copies, copies[:3]
  kv_bytes = sum(a.nbytes for a in ls.cache.k + ls.cache.v)
  assert compiled.memory_analysis().alias_size_in_bytes >= kv_bytes
