"""Several token automata in one set of arrays, and the two lookups a jitted step makes.

`pack` lays automata end to end (state, mask-row and transition ids made global), so one
pool serves every constrained row of a batch; each row carries one global state (-1: no
grammar). `allowed` and `advance` are pure jax functions with no loop or branch (the
binary search is unrolled), so a step that uses them never waits for the host.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.structured.automaton import TokenAutomaton

def default_capacity(vocab_size: int) -> tuple[int, int, int, int]:
  """An engine's pool by default: `(states, distinct masks, transitions, automata)`. A JSON
  schema takes tens to hundreds of states and masks and, stored by token class, tens to
  hundreds of transitions a state (256k at most; fewer at a small vocabulary); each
  automaton placed at once takes a row of token classes (16 rows)."""
  return 4096, 256, min(1 << 18, max(1 << 14, 16 * vocab_size)), 16


def capacity_of(value) -> tuple[int, int, int, int]:
  """A pool capacity as 4 ints: `(states, masks, transitions)` gets the default automata."""
  value = tuple(int(v) for v in value)
  return value if len(value) == 4 else value + (16,)

# A row whose sampled token left its automaton (it cannot happen with the mask applied): it
# may only draw a stop token from then on.
DEAD = -2


class Pool(NamedTuple):
  """Automata end to end (`pack`); every id global. Leaves as `TokenAutomaton`'s fields, with
  each automaton's token classes in a row of `class_of` (`row`: each state's)."""
  final: jax.Array      # int32[S]
  mask_of: jax.Array    # int32[S]
  masks: jax.Array      # uint32[M, W]
  start: jax.Array      # int32[S]
  count: jax.Array      # int32[S]
  tokens: jax.Array     # int32[T] (token classes)
  next: jax.Array       # int32[T]
  row: jax.Array        # int32[S]
  class_of: jax.Array   # int32[A, V]


def pack(automata: Sequence[TokenAutomaton], vocab_size: int, *, states: int = 0,
         masks: int = 0, transitions: int = 0, rows: int = 0) -> tuple[Pool, list[int]]:
  """`(pool as NumPy arrays, each automaton's initial state)` for a model of `vocab_size`
  tokens, padded to at least the given sizes (pools of one capacity share one program).

  Raises:
    ValueError: an automaton of a larger vocabulary than the model's.
  """
  words = -(-vocab_size // 32)
  s0 = m0 = t0 = 0
  parts, initials = [], []
  for k, a in enumerate(automata):
    if a.vocab_size > vocab_size:
      raise ValueError(f"an automaton of {a.vocab_size} tokens in a pool of {vocab_size}")
    mask_rows = np.zeros((a.masks.shape[0], words), np.uint32)
    mask_rows[:, :a.masks.shape[1]] = a.masks
    classes = np.zeros((1, vocab_size), np.int32)
    classes[0, :a.vocab_size] = a.class_of
    parts.append((a.final.astype(np.int32), a.mask_of + m0, mask_rows, a.start + t0, a.count,
                  a.tokens, a.next + s0, np.full(a.num_states, k, np.int32), classes))
    initials.append(s0 + a.initial)
    s0, m0, t0 = s0 + a.num_states, m0 + a.masks.shape[0], t0 + a.tokens.shape[0]
  cols = list(zip(*parts)) if parts else [()] * 9
  pool = Pool(final=_joined(cols[0], states, 0, np.int32),
              mask_of=_joined(cols[1], states, 0, np.int32),
              masks=_joined(cols[2], masks, 0, np.uint32, (words,)),
              start=_joined(cols[3], states, 0, np.int32),
              count=_joined(cols[4], states, 0, np.int32),
              tokens=_joined(cols[5], transitions, -1, np.int32),
              next=_joined(cols[6], transitions, DEAD, np.int32),
              row=_joined(cols[7], states, 0, np.int32),
              class_of=_joined(cols[8], rows, 0, np.int32, (vocab_size,)))
  return pool, initials


def pool_bytes(vocab_size: int, capacity) -> int:
  """Device bytes of a pool of `capacity = (states, masks, transitions[, automata])`."""
  states, masks, transitions, rows = capacity_of(capacity)
  return (20 * states + 4 * masks * -(-vocab_size // 32) + 8 * transitions
          + 4 * rows * vocab_size)


def empty_pool(vocab_size: int, states: int = 1, masks: int = 1, transitions: int = 1,
               rows: int = 1) -> Pool:
  """A pool holding no automaton, of the given capacity (NumPy arrays)."""
  return pack([], vocab_size, states=states, masks=masks, transitions=transitions,
              rows=rows)[0]


def _joined(parts, at_least: int, fill, dtype, shape=()) -> np.ndarray:
  """`parts` end to end, then `fill` up to `at_least` rows (one row at least)."""
  xs = [np.asarray(x, dtype).reshape((-1,) + shape) for x in parts]
  n = sum(len(x) for x in xs)
  return np.concatenate(xs + [np.full((max(at_least, 1) - n,) + shape, fill, dtype)]
                        if max(at_least, 1) > n else xs)


def allowed(pool: Pool, state, stop_tokens, vocab_size: int):
  """`bool[R, vocab_size]`: what each row may draw. A row without a grammar (`state` -1)
  everything; a row in a final state its automaton's tokens and its `stop_tokens`
  (`int32[R, K]`, -1 unused); a `DEAD` row only its stop tokens."""
  has = state >= 0
  safe = jnp.where(has, state, 0)
  words = pool.masks[pool.mask_of[safe]]                                   # [R, W]
  bits = jnp.unpackbits(jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(
      words.shape[0], -1), axis=1, bitorder="little").astype(bool)
  bits = jnp.pad(bits, ((0, 0), (0, max(0, vocab_size - bits.shape[1]))))[:, :vocab_size]
  rows = jnp.arange(state.shape[0], dtype=jnp.int32)[:, None]
  is_stop = jnp.zeros(bits.shape, bool).at[
      rows, jnp.where(stop_tokens >= 0, stop_tokens, vocab_size)].set(True, mode="drop")
  final = (has & (pool.final[safe] == 1)) | (state == DEAD)
  return jnp.where((state == -1)[:, None], True,
                   (bits & has[:, None]) | (is_stop & final[:, None]))


def advance(pool: Pool, state, token, vocab_size: int):
  """`int32[R]`: each row's state after drawing `token` (rows without a grammar stay -1; a
  token its state does not allow gives `DEAD`)."""
  has = state >= 0
  safe = jnp.where(has, state, 0)
  lo = pool.start[safe]
  hi = lo + pool.count[safe]
  last = pool.tokens.shape[0] - 1
  in_vocab = (token >= 0) & (token < pool.class_of.shape[1])
  key = pool.class_of[pool.row[safe], jnp.clip(token, 0, pool.class_of.shape[1] - 1)]
  allowed_here = _bit(pool.masks[pool.mask_of[safe]], token) & in_vocab
  # Lower bound of the token's class in tokens[lo:hi], unrolled: a loop would be a host sync
  # per step.
  for _ in range(max(1, int(vocab_size).bit_length())):
    mid = (lo + hi) // 2
    go_right = (mid < hi) & (pool.tokens[jnp.minimum(mid, last)] < key)
    lo, hi = jnp.where(go_right, mid + 1, lo), jnp.where(go_right, hi, mid)
  found = allowed_here & (lo < pool.start[safe] + pool.count[safe]) & (
      pool.tokens[jnp.minimum(lo, last)] == key)
  nxt = jnp.where(found, pool.next[jnp.minimum(lo, last)], DEAD)
  return jnp.where(has, nxt, state)


def _bit(words, token):
  """Whether bit `token` is set in each row of packed `words` (`uint32[R, W]`)."""
  w = jnp.clip(token // 32, 0, words.shape[1] - 1)
  word = jnp.take_along_axis(words, w[:, None], axis=1)[:, 0]
  return ((word >> (token % 32).astype(jnp.uint32)) & 1) == 1
