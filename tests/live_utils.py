"""Helpers for the incremental API's tests: random request mixes and deltas gathered per sample."""

from __future__ import annotations

from jaxkv import serve


def random_requests(rng, count, *, sampled: bool = True, prefix: str = "r"):
  """`count` requests over a 64-token vocabulary: prompts of 1..11 tokens, 1..13 new tokens,
  greedy or seeded sampling (`sampled`), top-k, n of 1..3, two stop tokens each."""
  out = []
  for i in range(count):
    prompt = tuple(int(t) for t in rng.integers(0, 64, size=int(rng.integers(1, 12))))
    params = serve.SamplingParams(
        max_tokens=int(rng.integers(1, 14)),
        temperature=float(rng.choice([0.0, 0.9])) if sampled else 0.0,
        top_k=int(rng.choice([0, 5])), seed=int(rng.integers(0, 100)),
        n=int(rng.choice([1, 1, 2, 3])), stop_tokens=tuple(int(t) for t in rng.integers(0, 64, 2)))
    out.append(serve.Request(prompt, params, request_id=f"{prefix}{i}"))
  return out


def collect(deltas, into=None):
  """`{(request_id, index): (tokens, finish_reason)}` from deltas, checking nothing follows a
  sample's finish."""
  into = {} if into is None else into
  for d in deltas:
    tokens, reason = into.get((d.request_id, d.index), ([], None))
    assert reason is None, f"delta after the finish of {d.request_id}/{d.index}"
    into[(d.request_id, d.index)] = (tokens + list(d.tokens), d.finish_reason)
  return into
