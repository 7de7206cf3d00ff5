"""Shared helpers for the CONTRACT §11 scenarios: content, state snapshots, a step driver.

Everything here talks to jaxkv through its public names only (`import jaxkv`),
and compares against `tests/oracle.py`, which shares no code with jaxkv.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from drivers import PureCache
from drivers import check_page_invariants
import jaxkv
from oracle import SequenceOracle
from oracle import tol

# CONTRACT §11 defaults.
N_Q_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 8

# Storage of `default_config`: None (columns) or a page size; the `storage` fixture
# (conftest) sets it per test. 3 does not divide the §11 capacities or W, so steps
# cross page boundaries at every offset.
PAGE_SIZE: int | None = None
PAGED_PAGE_SIZE = 3

# Relative tolerance of probe content: CONTRACT §11 probes use float32 storage, relative 1e-5,
# which is conftest's float32 tolerance.
PROBE_RTOL = tol(np.float32)


# --------------------------------------------------------------------------- content


def tok(tag: int, p: int, l: int, *, n_q_heads: int = N_Q_HEADS, n_kv_heads: int = N_KV_HEADS,
        head_dim: int = HEAD_DIM) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Content of one token: (q [H_q, D], k [H_kv, D], v [H_kv, D]) float32, seeded by (tag, p, l)."""
  rng = np.random.default_rng([int(tag), int(p), int(l)])
  q = rng.standard_normal((n_q_heads, head_dim), dtype=np.float32)
  k = rng.standard_normal((n_kv_heads, head_dim), dtype=np.float32)
  v = rng.standard_normal((n_kv_heads, head_dim), dtype=np.float32)
  return q, k, v


def probe(p: int, *, n_q_heads: int = N_Q_HEADS, n_kv_heads: int = N_KV_HEADS,
          head_dim: int = HEAD_DIM) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Probe content at position p: K = 0, V[..., 0] = p + 1, V[..., 1] = (p + 1)**2.

  With K = 0 every visible key gets the same score, so output channels 0 and 1
  are the means of kp + 1 and (kp + 1)**2 over exactly the visible positions kp.
  """
  assert head_dim >= 2
  q = np.ones((n_q_heads, head_dim), np.float32)
  k = np.zeros((n_kv_heads, head_dim), np.float32)
  v = np.zeros((n_kv_heads, head_dim), np.float32)
  v[:, 0] = p + 1
  v[:, 1] = (p + 1) ** 2
  return q, k, v


# --------------------------------------------------------------------------- state snapshots


def _leaf_name(path) -> str:
  return jax.tree_util.keystr(path)


def _is_kv_path(path) -> bool:
  first = path[0] if path else None
  name = getattr(first, "name", None)
  if name is None:
    name = getattr(first, "key", None)
  return name in ("k", "v")


def snapshot(state) -> dict[str, np.ndarray]:
  """NumPy copies of every CacheState leaf, keyed by path, scratch column removed.

  The scratch column (index max_seqs on axis 1 of every column-stored K/V array)
  is owned by no sequence and its contents are unspecified (CONTRACT §3), so it
  is left out. A page pool (CONTRACT §3.1) is kept whole: no verb writes its
  scratch page, and a refusal must leave every page, the page table and the
  reference counts bitwise unchanged. Call this before the next facade call:
  the facade donates its state.
  """
  leaves, _ = jax.tree_util.tree_flatten_with_path(state)
  live = getattr(state, "live", None)    # a Step has no columns of its own
  columns = None if live is None else live.shape[0] + 1
  out = {}
  for path, leaf in leaves:
    arr = np.array(leaf, copy=True)
    if _is_kv_path(path):
      assert arr.ndim == 4, (path, arr.shape)
      # A pool whose page size happens to equal the column count loses its last
      # row per page here: a weaker check, never a wrong one.
      if arr.shape[1] == columns:
        arr = np.ascontiguousarray(arr[:, :-1])
    out[_leaf_name(path)] = arr
  return out


def stored_rows(state, config, layer: int, col: int, positions) -> tuple[np.ndarray, np.ndarray]:
  """`(K, V)` `[len(positions), H_kv, D]` that flat layer `layer` stores for column `col`.

  Reads `k[layer][p, col]` with column storage, and
  `pool[page_table[col, p // page_size], p % page_size]` with paged storage
  (CONTRACT §3.1), so a scenario can inspect storage under either.
  """
  k, v = np.asarray(state.k[layer]), np.asarray(state.v[layer])
  positions = np.asarray(list(positions), np.int64)
  if config.page_size is None or config.layers[layer].policy.kind != "flat":
    return k[positions, col], v[positions, col]
  table = np.asarray(state.page_table)
  pages = table[col, positions // config.page_size]
  return k[pages, positions % config.page_size], v[pages, positions % config.page_size]


def flat_row_count(state, config) -> int:
  """Flat rows per column as allocated: `k[flat].shape[0]`, or `max_seq_len` (else
  `capacity`) when paged (every position a sequence may hold has a page-table slot;
  the pool never grows)."""
  if config.page_size is not None:
    return config.max_seq_len or config.capacity
  return next(a.shape[0] for a, lc in zip(state.k, config.layers) if lc.policy.kind == "flat")


def assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  """Bitwise equality of two snapshots (NaN equals an identical NaN); names the first difference."""
  assert list(a) == list(b), f"different leaves: {sorted(set(a) ^ set(b))}"
  for name in a:
    x, y = a[name], b[name]
    assert x.dtype == y.dtype, f"{name}: dtype {x.dtype} != {y.dtype}"
    assert x.shape == y.shape, f"{name}: shape {x.shape} != {y.shape}"
    if x.tobytes() != y.tobytes():
      xb = x.reshape(-1).view(np.uint8).reshape(x.size, -1) if x.size else x
      yb = y.reshape(-1).view(np.uint8).reshape(y.size, -1) if y.size else y
      diff = np.nonzero(np.any(xb != yb, axis=-1))[0]
      first = tuple(int(i) for i in np.unravel_index(int(diff[0]), x.shape)) if x.ndim else ()
      raise AssertionError(
          f"{name} differs at {len(diff)} elements, first at {first}: "
          f"{x[first] if x.ndim else x} != {y[first] if y.ndim else y}")


def state_of(cache):
  """Snapshot of a facade's current state."""
  return snapshot(cache.state)


# --------------------------------------------------------------------------- driver


def layer_windows(config) -> list[int | None]:
  """Per-layer oracle windows: None for flat, w for ring(w)."""
  return [None if lc.policy.kind == "flat" else int(lc.policy.window) for lc in config.layers]


def segments_of(ids: Sequence[int], owner_blocks=None) -> list[tuple[int, int, int, bool]]:
  """Maximal runs of equal id and block flag: (start, length, id, is_block), in step order."""
  flags = [False] * len(ids)
  for start, length in owner_blocks or ():
    for t in range(start, start + length):
      flags[t] = True
  segs = []
  for t, (s, f) in enumerate(zip(ids, flags)):
    if segs and segs[-1][2] == s and segs[-1][3] == f and segs[-1][0] + segs[-1][1] == t:
      start, length, _, _ = segs[-1]
      segs[-1] = (start, length + 1, s, f)
    else:
      segs.append((t, 1, s, f))
  return segs


def derived_positions(pos_of, seq_ids) -> list[int]:
  """Positions §6.3 and §9 derive: `pos_of(s)`, then one more per later token of `s`."""
  seen: dict[int, int] = {}
  positions = []
  for s in seq_ids:
    positions.append(pos_of(s) + seen.get(s, 0))
    seen[s] = seen.get(s, 0) + 1
  return positions


def run_step(cache, ids, contents, *, owner_blocks=None, T=None, scale=None,
             positions=None) -> list[np.ndarray]:
  """One whole step on the facade: declare (must be accepted), prepare, attend every layer, commit.

  Args:
    cache: a jaxkv.BatchedSequenceCache.
    ids: the step's sequence ids (n entries).
    contents: one (q [n, H_q, D], k [n, H_kv, D], v [n, H_kv, D]) triple per
      layer, or a callable `layer, previous_output -> triple` (previous_output
      is None for layer 0 and the real rows of the previous layer otherwise).
    owner_blocks: passed to declare_step.
    T: None or n passes n rows; the step width W pads q/k/v with NaN rows.
    scale: passed to attend.
    positions: passed to prepare_step.

  Returns:
    Per-layer float32 NumPy outputs, n rows each (the real rows).
  """
  n = len(ids)
  assert cache.declare_step(list(ids), owner_blocks=owner_blocks) is True
  cache.prepare_step(positions)
  outputs = []
  prev = None
  n_layers = len(contents) if not callable(contents) else None
  layer = 0
  while True:
    if n_layers is not None and layer >= n_layers:
      break
    triple = contents(layer, prev) if callable(contents) else contents[layer]
    if triple is None:
      break
    q, k, v = (np.asarray(x, np.float32) for x in triple)
    if T is not None and T != n:
      q, k, v = (pad_nan(x, T) for x in (q, k, v))
    out = cache.attend(layer, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=scale)
    out = np.asarray(out)
    assert out.shape[0] == q.shape[0], (out.shape, q.shape)
    prev = out[:n]
    outputs.append(prev)
    layer += 1
  cache.commit_step()
  return outputs


def pad_nan(x: np.ndarray, rows: int) -> np.ndarray:
  """x with NaN rows appended up to `rows` rows (axis 0)."""
  pad = np.full((rows - x.shape[0],) + x.shape[1:], np.nan, x.dtype)
  return np.concatenate([x, pad], axis=0)


def _dependent_maps(l: int, n_q_heads: int, n_kv_heads: int, head_dim: int, n_q_in: int,
                    d_in: int):
  """Fixed seeded linear maps from layer l's output row to layer l+1's q, k, v."""
  rng = np.random.default_rng([987654, l])
  fan_in = n_q_in * d_in
  scale = 1.0 / math.sqrt(fan_in)
  mq = (rng.standard_normal((fan_in, n_q_heads * head_dim)) * scale).astype(np.float32)
  mk = (rng.standard_normal((fan_in, n_kv_heads * head_dim)) * scale).astype(np.float32)
  mv = (rng.standard_normal((fan_in, n_kv_heads * head_dim)) * scale).astype(np.float32)
  return mq, mk, mv


class Harness:
  """A facade cache plus one SequenceOracle per sequence, fed the same tokens.

  Each sequence has a content tag; a token at position p on layer l gets
  `tok(tag, p, l)` (or `probe(p)` with `content="probe"`). A fork keeps its
  donor's history (oracle fork) and gets a fresh tag for its own new tokens.
  `step` checks every real row of every layer against the oracles.

  Args:
    config: the jaxkv.CacheConfig.
    implementation: passed to the facade.
    n_q_heads: H_q for every layer.
    content: "tok" or "probe".
    dependent: if True, layer l+1's q/k/v are fixed seeded linear maps of layer
      l's output row plus the token's own content (CONTRACT §11 dependent model);
      the cache uses its own outputs and each oracle its own.
    cache: an existing cache object to drive instead of a new one.
    driver: "facade" (jaxkv.BatchedSequenceCache) or "pure-poisoned" (a
      PureCache whose free storage is NaN-poisoned before every step).
    scale: passed to every attend (None: the CONTRACT default 1/sqrt(head_dim)).
  """

  def __init__(self, config, *, implementation: str | None = "reference", n_q_heads: int = N_Q_HEADS,
               content: str = "tok", dependent: bool = False, cache=None,
               driver: str = "facade", scale: float | None = None):
    self.config = config
    self.scale = scale
    if cache is None and driver == "pure-poisoned":
      cache = PureCache(config, implementation=implementation)
    self.poisoned = driver == "pure-poisoned"
    self.cache = cache if cache is not None else jaxkv.BatchedSequenceCache(
        config, implementation=implementation)
    self.n_q_heads = n_q_heads
    self.content = content
    self.dependent = dependent
    self.windows = layer_windows(config)
    self.kv_dtype = np.dtype(config.kv_dtype)
    self.scales = [1.0 / math.sqrt(lc.head_dim) if scale is None else scale
                   for lc in config.layers]
    self.oracles: dict[int, SequenceOracle] = {}
    self.tags: dict[int, int] = {}
    self._next_tag = 1000

  # ---- bookkeeping mirrored on success only

  def fresh_tag(self) -> int:
    self._next_tag += 1
    return self._next_tag

  def new(self, tag: int | None = None) -> int:
    s = self.cache.seq_new()
    assert s is not None
    self.oracles[s] = SequenceOracle(self.windows, self.kv_dtype, self.scales)
    self.tags[s] = self.fresh_tag() if tag is None else tag
    return s

  def clone(self, src: int, upto: int | None = None, tag: int | None = None) -> int | None:
    f = self.cache.seq_clone(src, upto)
    if f is not None:
      self.oracles[f] = self.oracles[src].fork(self.cache.pos(f))
      self.tags[f] = self.fresh_tag() if tag is None else tag
    return f

  def rm(self, s: int) -> bool:
    ok = self.cache.seq_rm(s)
    if ok:
      del self.oracles[s]
      del self.tags[s]
    return ok

  def rewind(self, s: int, position: int) -> bool:
    ok = self.cache.rewind(s, position)
    if ok:
      self.oracles[s].rewind(position)
    return ok

  def pos(self, s: int) -> int:
    return self.oracles[s].length(0)

  # ---- content

  def token(self, tag: int, p: int, l: int):
    lc = self.config.layers[l]
    geom = dict(n_q_heads=self.n_q_heads, n_kv_heads=lc.n_kv_heads, head_dim=lc.head_dim)
    return probe(p, **geom) if self.content == "probe" else tok(tag, p, l, **geom)

  def _layer_inputs(self, l, tags, positions, prev):
    """q/k/v rows of layer l for tokens with `tags`/`positions`; prev = layer l-1 outputs."""
    triples = [self.token(t, p, l) for t, p in zip(tags, positions)]
    q, k, v = (np.stack(x) for x in zip(*triples))
    if self.dependent and l > 0:
      lc = self.config.layers[l]
      prev = np.asarray(prev, np.float32)
      mq, mk, mv = _dependent_maps(l, self.n_q_heads, lc.n_kv_heads, lc.head_dim,
                                   prev.shape[1], prev.shape[2])
      flat = prev.reshape(prev.shape[0], -1)
      q = q + (flat @ mq).reshape(q.shape)
      k = k + (flat @ mk).reshape(k.shape)
      v = v + (flat @ mv).reshape(v.shape)
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)

  def expected_positions(self, ids, owner_blocks=None) -> list[int]:
    del owner_blocks  # a block continues its owner's count like any other run
    return derived_positions(self.pos, ids)

  # ---- the step

  def step(self, ids, owner_blocks=None, *, tags=None, T=None, check=True,
           check_positions=True) -> list[np.ndarray]:
    """Runs one step on the cache and the oracles; returns the cache's per-layer outputs.

    Args:
      ids: sequence id per step token.
      owner_blocks: (start, length) ranges (CONTRACT §9).
      tags: content tag per token (default: each sequence's own tag).
      T: attend with T rows (n or W); W pads with NaN.
      check: compare every real row of every layer with the oracles.
      check_positions: assert the prepared Step's positions equal the derived ones.
    """
    ids = list(ids)
    n = len(ids)
    tags = [self.tags[s] for s in ids] if tags is None else list(tags)
    positions = self.expected_positions(ids, owner_blocks)
    segs = segments_of(ids, owner_blocks)
    cache_prev = None

    def contents(l, prev):
      if l >= len(self.config.layers):
        return None
      return self._layer_inputs(l, tags, positions, prev)

    if self.poisoned:
      self.cache.poison()
    assert self.cache.declare_step(ids, owner_blocks=owner_blocks) is True
    step = self.cache.prepare_step()
    if check_positions:
      got = np.asarray(step.positions)[:n].tolist()
      assert got == positions, f"prepared positions {got} != {positions}"
    outputs = []
    for l in range(len(self.config.layers)):
      q, k, v = contents(l, cache_prev)
      if T is not None and T != n:
        q, k, v = (pad_nan(x, T) for x in (q, k, v))
      out = np.asarray(self.cache.attend(l, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                         scale=self.scale))
      assert out.shape[0] == (n if T is None else T), out.shape
      assert out.dtype == np.float32, out.dtype
      cache_prev = out[:n]
      outputs.append(cache_prev)
    self.cache.commit_step()
    check_page_invariants(self.config, self.cache.state)

    # Oracles: each sequence's segments in step order, layer by layer.
    expected = [np.zeros((n,) + o.shape[1:], np.float64) for o in outputs]
    oracle_prev = None
    for l in range(len(self.config.layers)):
      q, k, v = self._layer_inputs(l, tags, positions, oracle_prev)
      for start, length, s, is_block in segs:
        sl = slice(start, start + length)
        expected[l][sl] = self.oracles[s].feed(l, q[sl], k[sl], v[sl], block=is_block)
      oracle_prev = expected[l]
    if check:
      self.check(outputs, expected, ids=ids, positions=positions)
    return outputs

  def check(self, outputs, expected, *, ids=None, positions=None):
    """Compares every real row of every layer with the oracle outputs."""
    for l, (got, want) in enumerate(zip(outputs, expected)):
      assert np.all(np.isfinite(got)), f"layer {l}: non-finite output rows {ids} {positions}"
      if self.content == "probe":
        np.testing.assert_allclose(got[..., :2], want[..., :2], rtol=PROBE_RTOL, atol=0,
                                   err_msg=f"layer {l}, ids {ids}, positions {positions}")
      else:
        np.testing.assert_allclose(got, want, rtol=0, atol=tol(self.kv_dtype),
                                   err_msg=f"layer {l}, ids {ids}, positions {positions}")


def default_config(**overrides):
  """The CONTRACT §11 default config (one flat layer, 2 KV heads, head_dim 8, float16, ...)."""
  layers = overrides.pop("layers", None)
  if layers is None:
    layers = [jaxkv.LayerPolicy.flat()]
  layer_configs = [
      lc if isinstance(lc, jaxkv.LayerConfig) else jaxkv.LayerConfig(lc, N_KV_HEADS, HEAD_DIM)
      for lc in layers
  ]
  kwargs = dict(capacity=32, max_seqs=4, max_write=8, kv_dtype=jnp.float16, initial_capacity=32)
  kwargs.update(overrides)
  has_flat = any(lc.policy.kind == "flat" for lc in layer_configs)
  if PAGE_SIZE is not None and has_flat and "page_size" not in overrides:
    kwargs["page_size"] = min(PAGE_SIZE, kwargs["capacity"])
  return jaxkv.CacheConfig(layer_configs, **kwargs)
