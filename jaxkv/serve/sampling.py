"""Token sampling inside the jitted loop, with vLLM's parameters and order.

Per row, in this order (vLLM's v1 sampler):

1. **logprobs** (rows with `logprobs >= 0`): `log_softmax` of the model's raw
   logits, before any penalty, temperature or truncation (vLLM's default
   `logprobs_mode`, and what OpenAI reports): the chosen token's value and
   the `num_logprobs` largest, in descending order.
2. **penalties**: `repetition_penalty` over every token seen in the prompt or
   the output (a positive logit divided by it, any other multiplied, as
   Hugging Face and vLLM do); `frequency_penalty * count + presence_penalty *
   (count > 0)` subtracted, counting the generated tokens only (OpenAI). The
   counts are scattered from the column's token buffer (prompt then output)
   each step they are needed, so nothing is stored for them.
3. **greedy** rows (`temperature == 0`) take the argmax of the penalised logits.
4. others: divided by `temperature`; **min_p** keeps tokens whose probability
   is at least `min_p` times the largest; **top-k** then **top-p** (over the
   top-k renormalised) set a threshold; a token is drawn with the row's key.
   Ties at the threshold are all kept.

Nothing sorts the vocabulary. Top-k and top-p first read the row's `top_cap`
(16) largest logits with `lax.top_k` (on GPU XLA runs a one-pass TopK kernel
up to k = 16 and lowers a larger k to a full sort, hence the small cap): that
decides rows with `top_k <= top_cap`, and rows whose top-k keeps the whole
vocabulary and whose nucleus closes within the candidates. Other rows
(`top_cap < top_k < vocab`, or a wider nucleus) find their thresholds by
bisection over the 32 bits of order-preserving integer keys of the logits
(32 counting passes for top-k, 32 mass passes for top-p), exact, under a
`lax.cond` that only runs when a row needs it. A row's result depends only on
its own values, never on which path its neighbours took, so seeded sampling
is independent of batching.

Cost when unused: every stage sits behind a `lax.cond` on "any sampling row
needs it", so a step whose sampling rows are all greedy with no penalty and no
logprobs pays one argmax and nothing `[S, V]`-sized beyond it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.structured import pool as structured_pool

# A finite mask value, not -inf: a row with every logit masked must stay NaN-free.
_NEG = float(np.finfo(np.float32).min)
# Candidates a row reads with `lax.top_k` (XLA's GPU TopK kernel serves k <= 16).
TOP_CAP = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParams:
  """Per-row sampling parameters, `[S]` each.

  Attributes:
    temperature: `float32` (0: greedy).
    top_k: `int32` (0: all).
    top_p, min_p: `float32` (1 and 0: off).
    repetition_penalty: `float32` (1: off).
    presence_penalty, frequency_penalty: `float32` (0: off).
    logprobs: `int32` top logprobs wanted (-1: none; 0: the chosen token's only).
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  repetition_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  logprobs: jax.Array

  @classmethod
  def default(cls, rows: int, **values) -> RowParams:
    """Rows with every parameter off (greedy), `values` (arrays or scalars) replacing some."""
    off = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
               presence_penalty=0.0, frequency_penalty=0.0, logprobs=-1)
    out = {}
    for name, v in (off | values).items():
      dtype = jnp.int32 if name in ("top_k", "logprobs") else jnp.float32
      out[name] = jnp.broadcast_to(jnp.asarray(v, dtype), (rows,))
    return cls(**out)

  def has_penalty(self):
    return ((self.repetition_penalty != 1) | (self.presence_penalty != 0)
            | (self.frequency_penalty != 0))


def _penalize(logits, p: RowParams, history, prompt_len, length):
  """Penalised `float32[S, V]`; rows without a penalty are returned bitwise unchanged."""
  s, v = logits.shape
  pos = jnp.arange(history.shape[1], dtype=jnp.int32)[None, :]
  in_output = (pos >= prompt_len[:, None]) & (pos < length[:, None])
  seen_at = (pos < length[:, None]).astype(jnp.int32)
  rows = jnp.arange(s, dtype=jnp.int32)[:, None]
  tok = jnp.clip(history, 0, v - 1)
  counts = jnp.zeros((s, v), jnp.int32).at[rows, tok].add(in_output.astype(jnp.int32))
  seen = jnp.zeros((s, v), jnp.int32).at[rows, tok].max(seen_at) > 0
  rep = p.repetition_penalty[:, None]
  x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  x = (x - p.frequency_penalty[:, None] * counts.astype(jnp.float32)
       - p.presence_penalty[:, None] * (counts > 0).astype(jnp.float32))
  return jnp.where(p.has_penalty()[:, None], x, logits)


def _keys(x):
  """`uint32` keys ordered as the float32 values `x` are (finite values; -0 < +0)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _bisect(test, rows: int):
  """`uint32[S]`: per row, the largest key `t` with `test(t)` true (`test` monotone, true at 0)."""
  def body(b, t):
    cand = t | (jnp.uint32(1) << (31 - b).astype(jnp.uint32))
    return jnp.where(test(cand), cand, t)
  return jax.lax.fori_loop(0, 32, body, jnp.zeros((rows,), jnp.uint32))


def _bisected_floor(scaled, k, top_p):
  """`uint32[S]` key thresholds of top-k then top-p (keep `keys >= floor`), by bisection."""
  keys = _keys(scaled)
  rows = scaled.shape[0]
  # The k-th largest key: the largest t with at least k keys >= t.
  kth = _bisect(lambda t: (keys >= t[:, None]).sum(-1, dtype=jnp.int32) >= k, rows)
  mass = jnp.where(keys >= kth[:, None],
                   jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
  goal = top_p * mass.sum(-1)
  # A token is kept while the mass above it (strictly) is below top_p: keep keys > t*, where
  # t* is the largest t whose mass above still reaches top_p.
  above = _bisect(lambda t: jnp.where(keys > t[:, None], mass, 0.0).sum(-1) >= goal, rows)
  nucleus = jnp.where(top_p >= 1, jnp.uint32(0), above + jnp.uint32(1))
  return jnp.maximum(kth, nucleus)


def _keep(scaled, top_k, top_p, top_cap: int, branches: bool = True):
  """`bool[S, V]`: the tokens top-k then top-p keep (ties at the threshold all kept).

  `branches` False: no row needs the bisection (the caller's guarantee,
  `admission.plain_sampled`), so there is no `lax.cond` for it."""
  vocab = scaled.shape[-1]
  cap = min(top_cap, vocab)
  vals, _ = jax.lax.top_k(scaled, cap)                     # [S, cap], descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_k = jnp.arange(cap, dtype=jnp.int32)[None, :] < k[:, None]
  # Normaliser: over the top-k set when it is within the candidates, else the vocabulary.
  norm = jnp.where(k <= cap, jax.nn.logsumexp(jnp.where(in_k, vals, _NEG), axis=-1),
                   jax.nn.logsumexp(scaled, axis=-1))
  probs = jnp.where(in_k, jnp.exp(vals - norm[:, None]), 0.0)
  keep = in_k & (((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None])
                 | (top_p[:, None] >= 1))
  count = keep.sum(axis=-1, dtype=jnp.int32)
  fast = _keys(jnp.take_along_axis(vals, jnp.maximum(count - 1, 0)[:, None], axis=-1)[:, 0])
  keeps_all = (k >= vocab) & (top_p >= 1)
  fast = jnp.where(keeps_all, jnp.uint32(0), fast)
  # The candidates cannot decide: a top-k past them, or a nucleus that may extend past them.
  needs_more = ~keeps_all & (k > cap) & ((k < vocab) | (count >= cap))
  floor = fast if not branches else jax.lax.cond(
      jnp.any(needs_more),
      lambda: jnp.where(needs_more, _bisected_floor(scaled, k, top_p), fast),
      lambda: fast)
  return _keys(scaled) >= floor[:, None]


def _top_n(x, n: int):
  """`(values, ids)` of each row's `n` largest, descending, without sorting the row.

  Up to `TOP_CAP` by `lax.top_k`; past it (on GPU XLA would sort the row), the `n`-th
  largest key by bisection, then the entries above it and enough ties, gathered in index
  order and ordered among themselves (an `[S, n]` sort).
  """
  rows, vocab = x.shape
  if n <= TOP_CAP:
    return jax.lax.top_k(x, n) if n else (jnp.zeros((rows, 0), x.dtype),
                                          jnp.zeros((rows, 0), jnp.int32))
  keys = _keys(x)
  nth = _bisect(lambda t: (keys >= t[:, None]).sum(-1, dtype=jnp.int32) >= n, rows)
  above, tied = keys > nth[:, None], keys == nth[:, None]
  count = above.sum(-1, dtype=jnp.int32, keepdims=True)
  slot = jnp.where(above, jnp.cumsum(above, -1, dtype=jnp.int32) - 1,
                   jnp.where(tied, count + jnp.cumsum(tied, -1, dtype=jnp.int32) - 1, n))
  ids = jnp.zeros((rows, n), jnp.int32).at[jnp.arange(rows)[:, None], slot].set(
      jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (rows, vocab)), mode="drop")
  vals = jnp.take_along_axis(x, ids, axis=-1)
  order = jnp.argsort(-vals, axis=-1, stable=True)
  return jnp.take_along_axis(vals, order, -1), jnp.take_along_axis(ids, order, -1)


def _draw(x, p: RowParams, keys, top_cap: int, branches: bool = True):
  """Random rows' tokens from penalised logits `x` (greedy rows: argmax)."""
  greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
  scaled = x / jnp.maximum(p.temperature, jnp.float32(1e-6))[:, None]
  # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p): no softmax needed.
  floor = jnp.max(scaled, axis=-1) + jnp.log(jnp.maximum(p.min_p, jnp.float32(1e-30)))
  scaled = jnp.where((p.min_p[:, None] > 0) & (scaled < floor[:, None]), _NEG, scaled)
  masked = jnp.where(_keep(scaled, p.top_k, p.top_p, top_cap, branches), scaled, _NEG)
  drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
  return jnp.where(p.temperature > 0, drawn, greedy)


def sample_rows(logits, p: RowParams, keys, *, sampling, history=None, prompt_len=None,
                length=None, banned=None, bias=None, grammar=None, num_logprobs: int = 0,
                top_cap: int = TOP_CAP, branches: bool = True):
  """Samples one token per row, with its logprobs where asked.

  Args:
    logits: `float32[S, V]` the model's logits.
    p: `RowParams`.
    keys: `[S]` typed PRNG keys.
    sampling: `bool[S]` rows whose result is used; only these decide which
      stages run (a retired column's stale parameters cost nothing).
    history: `int32[S, L]` each row's prompt then generated tokens; with
      `prompt_len`/`length` (`int32[S]`: prompt tokens, tokens known), needed
      for penalties (None: no row may have one).
    banned: optional `int32[S, K]` token ids each row may not draw now (-1: unused; a
      request's stop tokens before its `min_tokens`). They are removed after the
      penalties, before temperature; the logprobs stay the raw distribution's.
    bias: optional `(int32[S, B] token ids (-1: unused), float32[S, B] biases, int32[S]
      restrict)` added to the logits before the penalties (OpenAI's `logit_bias`); a
      restricted row draws only its slots' tokens (`allowed_token_ids`). Logprobs stay raw.
    grammar: optional `(structured.pool.Pool, int32[S] states (-1: none), int32[S]
      pending tokens (-1: none), int32[S, K] stop tokens)`: a sampling row with a
      state first consumes its pending token (the one it drew last step), then draws
      only what its automaton allows (removed first, before the bias). Both happen
      inside the branch that adjusts logits, so rows without a grammar add no work
      and no branch. Logprobs stay raw.
    num_logprobs: top logprobs returned per row (static; rows ask for fewer).
    top_cap: candidates read with `lax.top_k` (static; see the module docstring).
    branches: (static) True: skip the stages no row uses with `lax.cond`s (a step's work
      follows its rows). False: the draw alone (temperature, min-p, top-k and top-p from the
      `top_cap` candidates), with no branch (a GPU reads each `cond`'s predicate back to the
      host, so a program holding one cannot be dispatched ahead of the device: the stepping
      server's sampled steps). Its tokens are the loop sampler's when no sampling row has a
      penalty, a bias, a ban, a grammar or logprobs (they come back as zeros) and the
      candidates decide every row's top-k and top-p (`admission.plain_sampled`): the
      caller's to guarantee.

  Returns:
    `(tokens int32[S], logprob float32[S], top_ids int32[S, num_logprobs],
    top_logprobs float32[S, num_logprobs])`; the logprob fields are 0 on rows
    that did not ask (and everywhere when no sampling row did). With `grammar`, a
    fifth: `int32[S]` each row's state after its pending token.
  """
  s = logits.shape[0]
  has_pen = p.has_penalty() & sampling
  random = (p.temperature > 0) & sampling
  wants_lp = (p.logprobs >= 0) & sampling
  if banned is None:
    banned = jnp.full((s, 1), -1, jnp.int32)
  has_ban = jnp.any(banned >= 0, axis=1) & sampling
  if bias is None:
    bias = (jnp.full((s, 1), -1, jnp.int32), jnp.zeros((s, 1), jnp.float32),
            jnp.zeros((s,), jnp.int32))
  has_bias = (jnp.any(bias[0] >= 0, axis=1) | (bias[2] > 0)) & sampling
  if history is None:
    history = jnp.zeros((s, 1), jnp.int32)
    prompt_len = length = jnp.zeros((s,), jnp.int32)
  if grammar is None:
    has_grammar, state = jnp.zeros((s,), bool), jnp.full((s,), -1, jnp.int32)
  else:
    has_grammar, state = (grammar[1] != -1) & sampling, grammar[1]

  if not branches:   # the caller's guarantee: no stage but the draw (see `branches`)
    out = ((_draw(logits, p, keys, top_cap, branches=False),) + _no_logprobs(s, num_logprobs)
           + (state,))
    return out if grammar is not None else out[:4]

  def adjusted():   # each stage leaves the rows that do not use it bitwise unchanged
    x, now = logits, state
    if grammar is not None:
      pool, _, pending, stops = grammar
      vocab = logits.shape[1]
      now = jnp.where(has_grammar & (pending >= 0),
                      structured_pool.advance(pool, state, pending, vocab), state)
      x = jnp.where(structured_pool.allowed(pool, jnp.where(has_grammar, now, -1), stops, vocab),
                    x, _NEG)
    x = _add_bias(x, *bias, has_bias)
    # Penalties count each row's whole token history (rows x max_len scatters): a batch that
    # adjusts logits only for a grammar, a bias or a ban must not pay for them every step.
    x = jax.lax.cond(jnp.any(has_pen), lambda x: _penalize(x, p, history, prompt_len, length),
                     lambda x: x, x)
    return _ban(x, banned, has_ban), now

  def special():
    # One conditional for every logit adjustment: on a GPU each predicate is a host sync.
    x, now = jax.lax.cond(jnp.any(has_pen | has_bias | has_ban | has_grammar), adjusted,
                          lambda: (logits, state))
    tokens = jax.lax.cond(jnp.any(random), lambda: _draw(x, p, keys, top_cap),
                          lambda: jnp.argmax(x, axis=-1).astype(jnp.int32))

    def logprobs():
      raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
      top_lp, top_ids = _top_n(raw, num_logprobs)
      on = wants_lp[:, None]
      return (jnp.where(wants_lp, chosen, 0.0), jnp.where(on, top_ids, 0).astype(jnp.int32),
              jnp.where(on, top_lp, 0.0))

    return (tokens,) + jax.lax.cond(jnp.any(wants_lp), logprobs, lambda: _no_logprobs(
        s, num_logprobs)) + (now,)

  out = jax.lax.cond(jnp.any(has_pen | random | wants_lp | has_ban | has_bias | has_grammar),
                     special, lambda: greedy_rows(logits, num_logprobs) + (state,))
  return out if grammar is not None else out[:4]


def _scatter_at(x, tokens, on):
  """`(rows, ids)` indexing each row's `tokens` of `x` where `on` (-1 slots and rows not on
  point past the vocabulary: a `mode="drop"` update skips them)."""
  s, v = x.shape
  return (jnp.arange(s, dtype=jnp.int32)[:, None],
          jnp.where((tokens >= 0) & on[:, None], tokens, v))


def _add_bias(x, tokens, values, restrict, on):
  """`x` plus each row's bias `values` at `tokens` (where `on`); a restricted row keeps only
  those tokens (the rest at the lowest float32: never drawn)."""
  rows, ids = _scatter_at(x, tokens, on)
  slot = jnp.zeros(x.shape, bool).at[rows, ids].set(True, mode="drop")
  x = x.at[rows, ids].add(values, mode="drop")
  return jnp.where(((restrict > 0) & on)[:, None] & ~slot, _NEG, x)


def _ban(x, banned, on):
  """`x` with each row's `banned` ids (where `on`) at the lowest float32: never drawn."""
  rows, ids = _scatter_at(x, banned, on)
  return x.at[rows, ids].set(_NEG, mode="drop")


def greedy_rows(logits, num_logprobs: int):
  """`sample_rows`' result when no row samples, is penalised or wants logprobs:
  the argmax, and zero logprob fields."""
  return ((jnp.argmax(logits, axis=-1).astype(jnp.int32),)
          + _no_logprobs(logits.shape[0], num_logprobs))


def _no_logprobs(s: int, num_logprobs: int):
  return (jnp.zeros((s,), jnp.float32), jnp.zeros((s, num_logprobs), jnp.int32),
          jnp.zeros((s, num_logprobs), jnp.float32))


def sample(logits, temperature, top_k, top_p, keys, *, min_p=None, top_cap: int = TOP_CAP):
  """Samples one token per row (no penalties, no logprobs): `sample_rows` for every row.

  Args:
    logits: `float32[S, V]`.
    temperature: `float32[S]` (0: greedy).
    top_k: `int32[S]` (0: all).
    top_p: `float32[S]`.
    keys: `[S]` typed PRNG keys.
    min_p: optional `float32[S]` (0: off).
    top_cap: see `sample_rows`.

  Returns:
    `int32[S]`. Nothing `[S, V]`-sized beyond an argmax runs when every row is greedy.
  """
  s = logits.shape[0]
  p = RowParams.default(s, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=0.0 if min_p is None else min_p)
  return sample_rows(logits, p, keys, sampling=jnp.ones((s,), bool), top_cap=top_cap)[0]
