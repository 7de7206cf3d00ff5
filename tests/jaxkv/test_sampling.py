"""`jaxkv.serve.sampling` on fixed logits against an independent NumPy oracle.

The oracle applies vLLM's order (penalties, temperature, min_p, top-k, top-p)
with plain loops, Python sets and a full stable sort, sharing no code with the
sampler (which reads the top `top_cap` logits and bisects on integer keys as a fallback).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.serve.sampling import RowParams, sample, sample_rows
from jaxkv.serve.sampling import TOP_CAP
from jaxkv.serve.sampling import _keep, _penalize, _top_n


def _oracle_penalize(logits, history, prompt_len, length, rep, pres, freq):
  x = np.array(logits, np.float64)
  for r in range(x.shape[0]):
    seen = set(int(t) for t in history[r, :length[r]])
    counts = collections.Counter(int(t) for t in history[r, prompt_len[r]:length[r]])
    for t in seen:
      x[r, t] = x[r, t] / rep[r] if x[r, t] > 0 else x[r, t] * rep[r]
    for t, c in counts.items():
      x[r, t] -= freq[r] * c + pres[r]
  return x


def _oracle_probs(x, temperature, top_k, top_p, min_p):
  """The distribution one row is drawn from (float64[V]), or a one-hot for greedy."""
  x = np.asarray(x, np.float64)
  if temperature == 0:
    return np.eye(x.size)[int(np.argmax(x))]
  z = x / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  kept = [t for t in range(x.size) if p[t] >= min_p * p.max()]
  order = sorted(kept, key=lambda t: -z[t])
  if top_k > 0:
    order = order[:top_k]
  mass = np.array([p[t] for t in order])
  mass /= mass.sum()
  nucleus, before = [], 0.0
  for t, m in zip(order, mass):
    if before < top_p or top_p >= 1:
      nucleus.append(t)
    before += m
  out = np.zeros(x.size)
  out[nucleus] = [p[t] for t in nucleus]
  return out / out.sum()


def _params(rows, **columns):
  return RowParams.default(len(rows), **{k: np.asarray([r[k] for r in rows])
                                         for k in columns})


def _frequencies(logits, rows, draws, *, top_cap, seed=0):
  """`[S, V]` empirical frequencies of `draws` samples of each row, and one draw's tokens."""
  names = sorted({k for r in rows for k in r})
  p = RowParams.default(len(rows), **{k: np.asarray([r.get(k, _OFF[k]) for r in rows])
                                      for k in names})
  s = len(rows)
  fn = jax.jit(jax.vmap(lambda key: sample_rows(
      logits, p, jax.random.split(key, s), sampling=jnp.ones((s,), bool), top_cap=top_cap)[0]))
  tokens = np.asarray(fn(jax.random.split(jax.random.key(seed), draws)))   # [draws, S]
  v = logits.shape[1]
  return np.stack([np.bincount(tokens[:, r], minlength=v) / draws for r in range(s)]), tokens


_OFF = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
            presence_penalty=0.0, frequency_penalty=0.0, logprobs=-1)


def _check_distribution(freq, expected, draws):
  support = expected > 0
  assert not (freq[~support] > 0).any(), np.flatnonzero(freq * ~support)
  sigma = np.sqrt(expected * (1 - expected) / draws)
  assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-9), (freq, expected)


def test_penalties_match_the_oracle(rng):
  s, v, length = 6, 40, 30
  logits = rng.normal(size=(s, v)).astype(np.float32) * 3
  history = rng.integers(0, 12, size=(s, length + 5)).astype(np.int32)   # many repeats
  prompt_len = rng.integers(0, 15, size=s).astype(np.int32)
  lengths = rng.integers(15, length, size=s).astype(np.int32)
  rep = np.array([1.0, 1.3, 0.7, 1.0, 2.0, 1.0], np.float32)
  pres = np.array([0.0, 0.5, -1.0, 0.0, 2.0, 0.0], np.float32)
  freq = np.array([0.0, 0.25, 0.5, -0.75, -2.0, 0.0], np.float32)
  p = RowParams.default(s, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
  got = np.asarray(_penalize(jnp.asarray(logits), p, jnp.asarray(history),
                             jnp.asarray(prompt_len), jnp.asarray(lengths)))
  want = _oracle_penalize(logits, history, prompt_len, lengths, rep, pres, freq)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
  np.testing.assert_array_equal(got[[0, 5]], logits[[0, 5]])   # no penalty: bitwise unchanged
  # Greedy rows take the argmax of the penalised logits.
  tokens = sample_rows(jnp.asarray(logits), p, jax.random.split(jax.random.key(0), s),
                       sampling=jnp.ones((s,), bool), history=jnp.asarray(history),
                       prompt_len=jnp.asarray(prompt_len), length=jnp.asarray(lengths))[0]
  np.testing.assert_array_equal(np.asarray(tokens), np.argmax(want, axis=-1))
  assert (np.argmax(want, axis=-1) != np.argmax(logits, axis=-1)).any()   # penalties mattered


@pytest.mark.parametrize("top_cap", [16, 3], ids=["candidates", "bisection"])
def test_min_p_top_k_top_p_distributions_match_the_oracle(rng, top_cap):
  """Each row's draws follow the oracle's distribution; nothing outside its support is drawn.

  With `top_cap=3` rows with `top_k > 3` or a nucleus past 3 tokens take the bisection.
  """
  v, draws = 16, 3000
  base = rng.normal(size=(v,)).astype(np.float32) * 1.5
  logits = jnp.asarray(np.stack([base] * 8))
  rows = [dict(temperature=1.0), dict(temperature=0.7, min_p=0.2), dict(temperature=1.0, top_k=3),
          dict(temperature=1.3, top_k=10), dict(temperature=1.0, top_p=0.6),
          dict(temperature=2.0, top_p=0.95), dict(temperature=1.0, top_k=9, top_p=0.8, min_p=0.05),
          dict(temperature=0.0, top_k=2)]
  freq, _ = _frequencies(logits, rows, draws, top_cap=top_cap)
  for r, row in enumerate(rows):
    full = _OFF | row
    expected = _oracle_probs(base, full["temperature"], full["top_k"], full["top_p"],
                             full["min_p"])
    _check_distribution(freq[r], expected, draws)


@pytest.mark.parametrize("top_cap", [16, 2], ids=["candidates", "bisection"])
def test_kept_tokens_equal_the_oracle_support_exactly(rng, top_cap):
  """Top-k then top-p keep sets, token for token, over 96 random rows of every kind."""
  s, v = 96, 40
  scaled = (rng.normal(size=(s, v)) * rng.choice([0.3, 1.0, 4.0], size=(s, 1))).astype(np.float32)
  top_k = rng.choice([0, 1, 3, 7, 20, 39, 40, 50], size=s).astype(np.int32)
  top_p = rng.choice([1.0, 0.3, 0.6, 0.9, 0.99], size=s).astype(np.float32)
  got = np.asarray(_keep(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p), top_cap))
  for r in range(s):
    want = _oracle_probs(scaled[r], 1.0, int(top_k[r]), float(top_p[r]), 0.0) > 0
    np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}: {top_k[r]=} {top_p[r]=}")


def test_a_row_does_not_depend_on_its_neighbours_path(rng):
  """A fast-path row gives the same token alone and beside rows that force the bisection."""
  v = 300
  logits = rng.normal(size=(4, v)).astype(np.float32)
  rows = dict(temperature=np.array([1.0, 1.0, 0.8, 0.0], np.float32),
              top_k=np.array([5, 50, 0, 0], np.int32),       # 50 > cap: bisection
              top_p=np.array([0.9, 1.0, 0.99, 1.0], np.float32))   # flat nucleus > cap: bisection
  keys = jax.random.split(jax.random.key(3), 4)
  together = sample_rows(jnp.asarray(logits), RowParams.default(4, **rows), keys,
                         sampling=jnp.ones((4,), bool), top_cap=8)[0]
  for r in range(4):
    alone = sample_rows(jnp.asarray(logits[r:r + 1]),
                        RowParams.default(1, **{k: a[r:r + 1] for k, a in rows.items()}),
                        keys[r:r + 1], sampling=jnp.ones((1,), bool), top_cap=8)[0]
    assert int(alone[0]) == int(together[r]), r


@pytest.mark.parametrize("nl", [5, 20], ids=["top_k", "bisection"])
def test_logprobs_are_the_raw_distribution(rng, nl):
  s, v = 4, 30
  logits = rng.normal(size=(s, v)).astype(np.float32) * 2
  history = rng.integers(0, v, size=(s, 8)).astype(np.int32)
  p = RowParams.default(s, temperature=np.array([0.0, 1.5, 0.0, 1.0], np.float32),
                        repetition_penalty=np.array([1.0, 1.5, 2.0, 1.0], np.float32),
                        frequency_penalty=np.array([0.0, 1.0, 0.0, 0.0], np.float32),
                        logprobs=np.array([nl, 2, 0, -1], np.int32))
  tokens, lp, ids, top = sample_rows(
      jnp.asarray(logits), p, jax.random.split(jax.random.key(1), s),
      sampling=jnp.ones((s,), bool), history=jnp.asarray(history),
      prompt_len=jnp.full((s,), 4, jnp.int32), length=jnp.full((s,), 8, jnp.int32),
      num_logprobs=nl)
  tokens, lp, ids, top = map(np.asarray, (tokens, lp, ids, top))
  x = logits.astype(np.float64)
  raw = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(
      -1, keepdims=True)
  for r in range(3):   # penalties and temperature do not change what is reported
    assert lp[r] == pytest.approx(raw[r, tokens[r]], abs=1e-5)
    order = np.argsort(-raw[r], kind="stable")[:nl]
    np.testing.assert_array_equal(ids[r], order)
    np.testing.assert_allclose(top[r], raw[r, order], atol=1e-5)
  assert lp[3] == 0 and not ids[3].any() and not top[3].any()   # did not ask
  # The greedy row with a penalty picked a token other than the raw argmax: its logprob says so.
  assert tokens[2] == np.argmax(_oracle_penalize(logits, history, [4] * s, [8] * s,
                                                 [1, 1.5, 2, 1], [0] * s, [0, 1, 0, 0])[2])


@pytest.mark.parametrize("n", [3, 16, 17, 40])
def test_top_n_with_many_ties(rng, n):
  """The n largest values, descending, each id once and pointing at its value; ties anywhere."""
  x = rng.integers(-3, 3, size=(8, 50)).astype(np.float32) + rng.choice([0.0, 0.5], size=(8, 1))
  vals, ids = map(np.asarray, _top_n(jnp.asarray(x), n))
  for r in range(8):
    np.testing.assert_array_equal(vals[r], np.sort(x[r])[::-1][:n])
    np.testing.assert_array_equal(x[r, ids[r]], vals[r])
    assert len(set(ids[r].tolist())) == n


def test_rows_outside_the_step_decide_nothing_and_greedy_takes_the_short_path(rng):
  """Rows not sampling (stale parameters of a retired column) cannot force the special path.

  The all-greedy branch of the outer `lax.cond` holds no sort, top-k, scatter or
  exponential: the common decode step pays for an argmax only.
  """
  logits = jnp.asarray(rng.normal(size=(3, 20)).astype(np.float32))
  p = RowParams.default(3, temperature=np.array([0.0, 2.0, 0.0], np.float32),
                        repetition_penalty=np.array([1.0, 1.0, 3.0], np.float32),
                        logprobs=np.array([-1, 4, 4], np.int32))
  sampling = jnp.array([True, False, False])
  out = sample_rows(logits, p, jax.random.split(jax.random.key(0), 3), sampling=sampling,
                    history=jnp.zeros((3, 4), jnp.int32), prompt_len=jnp.zeros((3,), jnp.int32),
                    length=jnp.full((3,), 4, jnp.int32), num_logprobs=4)
  np.testing.assert_array_equal(np.asarray(out[0]), np.argmax(np.asarray(logits), -1))
  assert not np.asarray(out[1]).any() and not np.asarray(out[2]).any()
  jaxpr = jax.make_jaxpr(lambda lg, s: sample_rows(
      lg, p, jax.random.split(jax.random.key(0), 3), sampling=s, num_logprobs=4))(logits,
                                                                                  sampling)
  conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
  assert len(conds) == 1
  greedy_branch = conds[0].params["branches"][0].jaxpr
  names = {e.primitive.name for e in greedy_branch.eqns}
  assert "argmax" in names
  assert not names & {"sort", "top_k", "scatter-add", "scatter", "exp", "log", "cond"}, names


def _eqns(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs nested in it (cond branches, loops)."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def test_nothing_sorts_the_vocabulary(rng):
  """Every path of the sampler (penalties, min_p, top-k/top-p, 20 logprobs): no sort over V."""
  s, v = 4, 512
  p = RowParams.default(s, temperature=1.0, top_k=np.array([0, 5, 100, 0], np.int32),
                        top_p=0.9, min_p=0.05, repetition_penalty=1.2, logprobs=20)
  jaxpr = jax.make_jaxpr(lambda lg: sample_rows(
      lg, p, jax.random.split(jax.random.key(0), s), sampling=jnp.ones((s,), bool),
      history=jnp.zeros((s, 8), jnp.int32), prompt_len=jnp.zeros((s,), jnp.int32),
      length=jnp.full((s,), 8, jnp.int32), num_logprobs=20))(jnp.zeros((s, v), jnp.float32))
  eqns = list(_eqns(jaxpr.jaxpr))
  sorts = [e for e in eqns if e.primitive.name == "sort"]
  top_ks = [e for e in eqns if e.primitive.name == "top_k"]
  assert top_ks and all(e.params["k"] <= TOP_CAP for e in top_ks)
  assert all(e.invars[0].aval.shape[-1] <= 20 for e in sorts), [e.invars[0].aval for e in sorts]


def test_sample_keeps_its_signature_and_min_p(rng):
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2, jnp.float32))
  keys = jax.random.split(jax.random.key(0), 400)
  draw = jax.vmap(lambda k: sample(logits, jnp.ones((2,), jnp.float32), jnp.zeros((2,), jnp.int32),
                                   jnp.ones((2,), jnp.float32), jax.random.split(k, 2),
                                   min_p=jnp.array([0.5, 0.25], jnp.float32)))
  tokens = np.asarray(draw(keys))
  assert set(tokens[:, 0]) == {0, 1}      # 0.3 >= 0.5 * 0.5; 0.15 is not
  assert set(tokens[:, 1]) == {0, 1, 2}   # 0.15 >= 0.25 * 0.5
