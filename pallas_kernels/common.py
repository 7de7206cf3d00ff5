"""What the attention reference and the Mosaic GPU kernels share besides ring math.

`indexing.py` owns positions, rows and visibility; this module owns the rest that
the pure-jnp reference, the kernels and their dispatchers must agree on: the
mask value, the storage dtypes, and the token -> segment lookup. It imports
nothing from the other kernel modules, so each of them can import it without a
cycle (`varlen_attention.py` and `varlen_attention_sm90.py` used to import each
other for these).
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import indexing

# A finite mask value, not -inf: a fully masked row (a padded token) would give
# exp(-inf - -inf) = NaN; with a finite value it gives finite garbage instead.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# K/V storage dtypes of CONTRACT §2 (`kv_dtype`); every kernel either serves one or
# refuses it with NotImplementedError.
SUPPORTED_KV_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def searchsorted_right(sorted_values, queries):
  """`searchsorted(..., side="right")`: one fused compare for tables up to ~32M pairs.

  The default scan is a loop of gathers, ~log2(N) iterations of a `while` (each
  a few launches and device copies the host walks through; on the H200 the
  engine's 2,048-wide prefill step showed ~12 such iterations for its item
  table). One `[N, M]` compare-and-count is a single fused reduction: the item
  table of a 2,048-token step is 2,048 x 2,688 pairs, a few microseconds.
  """
  small = sorted_values.size * queries.size <= 1 << 25
  # Past it, a sort of both together (a few launches) rather than the scan's loop
  # (~log2(N) iterations of four launches and a device copy: ~120 us of a 16,384-token
  # call's plan on H200), while the two together have int32 positions (the sort ranks
  # their concatenation; configs at CONTRACT's limits trace with the scan).
  if small:
    method = "compare_all"
  else:
    method = "sort" if sorted_values.size + queries.size < 2**31 - 1 else "scan"
  return jnp.searchsorted(sorted_values, queries, side="right", method=method)


# Pairs up to which `searchsorted_iota` compares every value with every query (one fused
# reduction, as `searchsorted_right`); past it a scatter and a running max, linear in
# both sizes, where `searchsorted_right` would compare up to 2^25 pairs and sort past
# that. Measured on H200 per call (docs/PERFORMANCE.md, "The plan of wide calls"): the
# mixed step's two searches (17M and 19M pairs) -34 us against the compare; 16,384
# tokens (268M pairs, the sorts before) -190 us; 4 x 4,096 -156 us. Below 2^23 pairs
# (engine steps up to ~2,900 tokens) the compare stays: not measured against it there.
SEARCH_COMPARE_PAIRS = 1 << 23


def searchsorted_iota(values, n: int):
  """`searchsorted_right(values, arange(n))` for ascending `values`: per `q < n`, how many are <= q.

  The attention plan's queries are an iota (every token, every item). Past
  `SEARCH_COMPARE_PAIRS` the count comes without a sort: with the values clipped
  to `[0, n]` (still ascending), the last of each run of equal values writes its
  count (its index + 1) at its value, and a running max over `[0, n)` carries
  each count to the queries up to the next value. Only a run's last entry writes
  (the rest, and values at or past `n`, are dropped), so no two writes share an
  address: padded rows (segment starts of int32 max, a table's repeated total)
  would otherwise pile thousands of updates on one element. int32 `[n]`.
  """
  if values.size * n <= SEARCH_COMPARE_PAIRS:
    return searchsorted_right(values, jnp.arange(n, dtype=jnp.int32)).astype(jnp.int32)
  clipped = jnp.clip(values, 0, n).astype(jnp.int32)
  last = jnp.concatenate([clipped[:-1] != clipped[1:], jnp.ones((1,), bool)])
  target = jnp.where(last & (clipped < n), clipped, n)         # n: dropped below
  counts = jnp.arange(1, values.size + 1, dtype=jnp.int32)
  marks = jnp.zeros((n,), jnp.int32).at[target].set(counts, mode="drop")
  return lax.cummax(marks)


# The compare-and-sum forms below build one `[n, n]` array. Up to this many elements
# (n <= 2,048: a step's columns, tokens and segments, a decode step's attention items)
# they replace `cumsum` and `argsort`, which XLA lowers to several kernels each (a
# chain of reduce-windows; a sort, its iota and a gather), with one fused reduction,
# as `derive_positions` and `searchsorted_right` do; past it the quadratic work would
# cost more than the kernels it saves (`jaxkv._pages`' page bookkeeping uses them too).
COMPARE_ELEMENTS = 1 << 22


def _bound(max_elements):
  """The compared elements up to which a helper below compares (read when traced)."""
  return COMPARE_ELEMENTS if max_elements is None else max_elements


def prefix_sum(x, *, dtype=jnp.int32, max_elements=None):
  """Inclusive `jnp.cumsum(x, axis=-1, dtype=dtype)` of an integer or bool array.

  Up to `COMPARE_ELEMENTS` compared pairs a triangular compare-and-sum (one
  fusion, however many rows `x` has), beyond them `cumsum`; integer sums, so
  both give the same values. `max_elements` (None: `COMPARE_ELEMENTS`) moves the bound.
  """
  n = x.shape[-1]
  if x.size * n > _bound(max_elements):
    return jnp.cumsum(x, axis=-1, dtype=dtype)
  i = jnp.arange(n, dtype=jnp.int32)
  upto = (i[None, :] <= i[:, None]).reshape((1,) * (x.ndim - 1) + (n, n))   # [.., i, j]: j <= i
  return jnp.where(upto, x.astype(dtype)[..., None, :], 0).sum(axis=-1, dtype=dtype)


def _comes_before(keys):
  """`bool[n, n]`: `[i, j]` is whether entry `j` precedes entry `i` in the stable
  ascending order of `keys` (a smaller key, or an equal one at a lower index)."""
  i = jnp.arange(keys.shape[0], dtype=jnp.int32)
  return ((keys[None, :] < keys[:, None])
          | ((keys[None, :] == keys[:, None]) & (i[None, :] < i[:, None])))


def sort_rows(keys, rows, *, max_elements=None):
  """`rows[jnp.argsort(keys, stable=True)]`, for `keys` `[n]` and `rows` `[n, ...]`.

  Up to `COMPARE_ELEMENTS` pairs no sort: each entry's rank is the count of
  entries before it (one fused compare-and-sum); the ranks are a permutation,
  inverted by scattering the entries' indices (`[n]` int32), and the rows are
  gathered in that order. Scattering the rows themselves to their ranks gives
  the same result, but XLA:GPU then fuses the rows' whole computation into the
  scatter, which ran as slowly as the sort it replaced (12.6 us for the
  attention plan's `[580, 19]` item table on H200; docs/PERFORMANCE.md); a
  gather keeps that computation in an ordinary loop fusion. `max_elements`: as
  `prefix_sum`'s.
  """
  n = keys.shape[0]
  if n * n > _bound(max_elements):
    return rows[jnp.argsort(keys, stable=True)]
  rank = _comes_before(keys).sum(axis=1, dtype=jnp.int32)
  order = jnp.zeros((n,), jnp.int32).at[rank].set(
      jnp.arange(n, dtype=jnp.int32), unique_indices=True)
  return rows[order]


def sorted_prefix_sum(keys, values, *, max_elements=None):
  """Per entry, the sum of int32 `values` over it and every entry before it in the stable
  ascending order of `keys` (the inclusive cumsum of the sorted values, put back
  in the original order).

  Up to `COMPARE_ELEMENTS` pairs one compare-and-sum; beyond, a sort, a cumsum
  and a scatter back. `max_elements`: as `prefix_sum`'s.
  """
  n = keys.shape[0]
  if n * n > _bound(max_elements):
    order = jnp.argsort(keys, stable=True)
    return jnp.zeros_like(values).at[order].set(jnp.cumsum(values[order], dtype=values.dtype))
  at_or_before = _comes_before(keys) | jnp.eye(n, dtype=bool)
  return jnp.where(at_or_before, values[None, :], 0).sum(axis=1, dtype=values.dtype)


def per_column(cols, values, num_cols: int, *, op: str):
  """`int32[num_cols]`: per column `c`, the sum (`op="sum"`) or max (`op="max"`) of
  the non-negative int32 `values[j]` with `cols[j] == c`; 0 where there is none.

  Entries whose column is outside `[0, num_cols)` count nowhere (a scatter's
  `mode="drop"`). Up to `COMPARE_ELEMENTS` pairs one `[num_cols, n]`
  compare-and-reduce, a single fusion; a scatter into zeros is two kernels on
  the GPU (XLA copies the zeros into a fresh buffer first). Beyond, the scatter.
  """
  if op not in ("sum", "max"):
    raise ValueError(f"op={op!r} must be 'sum' or 'max'")
  values = values.astype(jnp.int32)
  if num_cols * cols.shape[0] > COMPARE_ELEMENTS:
    zeros = jnp.zeros((num_cols,), jnp.int32)
    # A negative index would wrap (NumPy indexing) before `mode="drop"` applies.
    cols = jnp.where(cols >= 0, cols, num_cols)
    return (zeros.at[cols].add(values, mode="drop") if op == "sum"
            else zeros.at[cols].max(values, mode="drop"))
  match = cols[None, :] == jnp.arange(num_cols, dtype=jnp.int32)[:, None]
  picked = jnp.where(match, values[None, :], 0)
  return (picked.sum(axis=1, dtype=jnp.int32) if op == "sum"
          else picked.max(axis=1, initial=0))


def token_segment_index(q_start, is_real, num_tokens: int):
  """`[num_tokens]` int32 index of the last real segment row starting at or before each token.

  Real rows are in step order (CONTRACT §7.1), so that row is the token's segment
  when the token lies inside it; -1 for a token before every real row. Callers
  still check `token < q_start + q_len` (a padding token follows the last
  segment). Non-real rows sort last.
  """
  starts = jnp.where(is_real, q_start, jnp.iinfo(jnp.int32).max)
  return searchsorted_iota(starts, num_tokens) - 1


def token_segments(seq_info, n_segments, num_tokens: int):
  """Per-token segment fields: `(has_segment, q_start, q_len, col, pos0, kind)`.

  Each is `[num_tokens]` int32 (bool for `has_segment`); tokens covered by no real
  segment (padding) get `has_segment = False` and zero fields.
  """
  tokens = jnp.arange(num_tokens, dtype=jnp.int32)
  is_real = jnp.arange(seq_info.shape[0], dtype=jnp.int32) < n_segments
  index = token_segment_index(seq_info[:, indexing.SEG_Q_START], is_real, num_tokens)
  fields = seq_info[jnp.clip(index, 0, seq_info.shape[0] - 1)]             # [T, 5]
  has_segment = (index >= 0) & (tokens < fields[:, indexing.SEG_Q_START]
                                + fields[:, indexing.SEG_Q_LEN])
  fields = jnp.where(has_segment[:, None], fields, 0)
  return (has_segment, fields[:, indexing.SEG_Q_START], fields[:, indexing.SEG_Q_LEN],
          fields[:, indexing.SEG_COL], fields[:, indexing.SEG_POS0],
          fields[:, indexing.SEG_KIND])
