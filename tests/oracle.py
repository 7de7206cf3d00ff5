"""Naive float64 per-sequence attention oracle (CONTRACT §8, §9, §11 "oracle(s)").

This module deliberately shares no code with `jaxkv` or `pallas_kernels`: it
imports neither, keeps every position of every layer in a plain Python list, and
re-derives visibility from the CONTRACT's table in §8 with direct comparisons. There
are no rows, no rings and no modular arithmetic here, so a bug in the cache's
ring addressing cannot be mirrored by the oracle.

Positions of one sequence are implicit: the i-th K/V appended to a layer's
history is position i.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

# Absolute tolerances against float32/float64 oracles, keyed by storage dtype.
# 16-bit storage rounds every K/V to 3 or fewer significant digits (CONTRACT §11: 1e-2);
# float32 differs from a float64 oracle only by accumulation order.
TOLS = {
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 1e-2,
    np.dtype(ml_dtypes.bfloat16): 1e-2,
}


def tol(dtype) -> float:
  """Tolerance for results computed over K/V stored as `dtype`."""
  return TOLS[np.dtype(dtype)]


def out_rtol(dtype) -> float:
  """Relative tolerance added for outputs rounded to `dtype`: one unit of its precision
  (machine epsilon). Two float32 results a hair apart may round to neighbouring 16-bit
  values, which at magnitude >= 2 are further apart (bfloat16: 2^-6) than `tol` alone
  allows (CONTRACT §11 case 49)."""
  return float(ml_dtypes.finfo(dtype).eps) if np.dtype(dtype).itemsize == 2 else 0.0


def _as_float64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def _cast_kv(x, kv_dtype) -> np.ndarray:
  """Rounds to `kv_dtype` (NumPy/ml_dtypes astype: round to nearest even), then float64."""
  return np.asarray(x).astype(np.dtype(kv_dtype)).astype(np.float64)


def attend_naive(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                 visible: np.ndarray, scale: float) -> np.ndarray:
  """Softmax attention of each query over its visible keys, in float64.

  Args:
    q: [n, H_q, D] queries.
    keys: [S, H_kv, D] keys.
    values: [S, H_kv, D] values.
    visible: [n, S] bool; `visible[i, j]` says query i sees key j. Every row
      must have at least one visible key.
    scale: the softmax scale.

  Returns:
    [n, H_q, D] float64 outputs; query head h uses KV head h // (H_q // H_kv).
  """
  q = _as_float64(q)
  n, n_q_heads, head_dim = q.shape
  n_kv_heads = keys.shape[1]
  assert n_q_heads % n_kv_heads == 0, (n_q_heads, n_kv_heads)
  group = n_q_heads // n_kv_heads
  out = np.zeros((n, n_q_heads, head_dim), np.float64)
  for i in range(n):
    idx = np.nonzero(visible[i])[0]
    assert idx.size > 0, f"query {i} sees no key"
    for h in range(n_q_heads):
      kh = h // group
      kk = keys[idx, kh, :]                       # [S_i, D]
      vv = values[idx, kh, :]                     # [S_i, D]
      scores = scale * (kk @ q[i, h, :])          # [S_i]
      scores = scores - scores.max()
      weights = np.exp(scores)
      weights = weights / weights.sum()
      out[i, h, :] = weights @ vv
  return out


class SequenceOracle:
  """The history of one sequence on every layer, attended to naively.

  Args:
    windows: one entry per layer; None for a flat layer (sees the whole
      history), an int w >= 1 for a ring layer (a causal query at p sees
      [max(0, p - w + 1), p]).
    kv_dtype: storage dtype; K/V are rounded to it before being kept.
    scale: softmax scale, one float for every layer (or a list, one per layer).
  """

  def __init__(self, windows: list[int | None], kv_dtype, scale: float | list[float]):
    self.windows = list(windows)
    for w in self.windows:
      assert w is None or (isinstance(w, int) and w >= 1), w
    self.kv_dtype = np.dtype(kv_dtype)
    if isinstance(scale, (list, tuple)):
      assert len(scale) == len(self.windows)
      self.scales = [float(s) for s in scale]
    else:
      self.scales = [float(scale)] * len(self.windows)
    # history[l] is a list of (k [H_kv, D], v [H_kv, D]) float64 pairs, one per position.
    self.history: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.windows]

  def length(self, layer: int) -> int:
    """Number of positions kept on `layer`."""
    return len(self.history[layer])

  def _lowest_visible(self, layer: int, p: int) -> int:
    w = self.windows[layer]
    return 0 if w is None else max(0, p - w + 1)

  def feed(self, layer: int, q, k, v, *, block: bool = False) -> np.ndarray:
    """Appends this sequence's next n positions on `layer` and attends to them.

    Args:
      layer: layer id.
      q: [n, H_q, D] queries (any float dtype; used as float64).
      k: [n, H_kv, D] keys, rounded to kv_dtype before being kept.
      v: [n, H_kv, D] values, rounded likewise.
      block: if True, the n tokens form a DFlash owner block starting at
        b0 = length(layer): every query sees [lo, b0 + n) with lo = 0 (flat) or
        max(0, b0 - w + 1) (ring), and the block's K/V are dropped afterwards.

    Returns:
      [n, H_q, D] float64 outputs.
    """
    q = _as_float64(q)
    k = _cast_kv(k, self.kv_dtype)
    v = _cast_kv(v, self.kv_dtype)
    n = q.shape[0]
    assert k.shape[0] == n and v.shape[0] == n, (q.shape, k.shape, v.shape)
    hist = self.history[layer]
    b0 = len(hist)
    if hist:
      assert hist[0][0].shape == k.shape[1:], (hist[0][0].shape, k.shape)
    for i in range(n):
      hist.append((k[i].copy(), v[i].copy()))
    total = len(hist)
    keys = np.stack([kv[0] for kv in hist])       # [total, H_kv, D]
    values = np.stack([kv[1] for kv in hist])
    visible = np.zeros((n, total), bool)
    for i in range(n):
      p = b0 + i
      if block:
        lo, hi = self._lowest_visible(layer, b0), b0 + n   # whole block, own window start
      else:
        lo, hi = self._lowest_visible(layer, p), p + 1
      visible[i, lo:hi] = True
    out = attend_naive(q, keys, values, visible, self.scales[layer])
    if block:
      del hist[b0:]
    return out

  def rewind(self, position: int) -> None:
    """Keeps positions [0, position) on every layer."""
    assert position >= 0
    for hist in self.history:
      del hist[position:]

  def fork(self, upto: int) -> "SequenceOracle":
    """A deep copy holding the first `upto` positions of every layer."""
    twin = copy.copy(self)
    twin.windows = list(self.windows)
    twin.scales = list(self.scales)
    twin.history = [[(k.copy(), v.copy()) for k, v in hist[:upto]] for hist in self.history]
    return twin


def default_scale(head_dim: int) -> float:
  """The CONTRACT §8 default scale, 1/sqrt(head_dim)."""
  return 1.0 / math.sqrt(head_dim)


def visible_positions(p: int, window: int | None, *, block=None) -> range:
  """Positions a query at `p` sees (CONTRACT §8 table).

  Args:
    p: the query's position.
    window: `None` for a flat layer, the ring window otherwise.
    block: `(b0, B)` when the query belongs to an owner block `[b0, b0 + B)`.

  Returns:
    causal: `[0, p]` flat, `[max(0, p − w + 1), p]` ring; block: `[0, b0 + B)`
    flat, `[max(0, b0 − w + 1), b0 + B)` ring.
  """
  start, end = (p, p + 1) if block is None else (block[0], block[0] + block[1])
  lo = 0 if window is None else max(0, start - window + 1)
  return range(lo, end)


def expected_probe(p: int, window: int | None, *, block=None) -> tuple[float, float]:
  """Probe channels 0 and 1 for a query at `p` (see `visible_positions`)."""
  return probe_expected(visible_positions(p, window, block=block))


def probe_expected(visible: Sequence[int]) -> tuple[float, float]:
  """Expected probe output channels 0 and 1 for a query that sees positions `visible`."""
  vis = np.asarray(list(visible), np.float64)
  return float(np.mean(vis + 1)), float(np.mean((vis + 1) ** 2))
