"""How a queue of requests is ordered and checked before it is served (no device work here)."""

from __future__ import annotations

from typing import Sequence

from jaxkv.serve.requests import Request, SamplingParams


def _draw_only(params: SamplingParams) -> bool:
  """Nothing but the draw (temperature, min-p, top-k, top-p, seed) shapes the token: no
  penalty, no logprobs, no logit bias or allowed ids, no grammar, no stop token held back by
  `min_tokens`."""
  return (params.repetition_penalty == 1 and params.presence_penalty == 0
          and params.frequency_penalty == 0 and params.logprobs is None
          and (params.min_tokens == 0 or not params.stop_tokens)
          and not params.logit_bias and params.allowed_token_ids is None
          and params.grammar is None)


def plain_greedy(params: SamplingParams) -> bool:
  """The token is the argmax: no temperature, and nothing else shapes it (`_draw_only`)
  (`serve_loop(greedy=True)`)."""
  return params.temperature == 0 and _draw_only(params)


def plain_sampled(params: SamplingParams, top_cap: int) -> bool:
  """Whether a step with no branch (`serve_step(greedy=False)`: the draw alone,
  `sampling.sample_rows(branches=False)`) gives this request the loop's tokens: nothing but
  the draw shapes them (`_draw_only`), and the `top_cap` largest logits decide its top-k and
  top-p whatever the logits are (greedy; a top-k of at most `top_cap`; or neither), so it
  never needs the bisection behind the loop sampler's branch."""
  return _draw_only(params) and (params.temperature == 0 or 0 < params.top_k <= top_cap
                                 or (params.top_k <= 0 and params.top_p >= 1))


def labelled(requests: Sequence[Request]) -> list[Request]:
  """The queue as a list of `Request`s, each without a `request_id` labelled by its index."""
  if isinstance(requests, Request) or not all(isinstance(r, Request) for r in requests):
    raise TypeError("requests must be a sequence of jaxkv.serve.Request")
  return [r if r.request_id is not None else r.replace(request_id=i)
          for i, r in enumerate(requests)]


def queue_order(requests: Sequence[Request]) -> dict:
  """`request_id -> position` of a labelled queue; raises ValueError on a repeated id."""
  order = {r.request_id: i for i, r in enumerate(requests)}
  if len(order) != len(requests):
    raise ValueError("request_id values must be unique")
  return order


ADMISSION_ORDERS = ("longest_first", "fcfs")


def check_admission(admission) -> None:
  """Raises ValueError, naming the argument, unless `admission` is one of `ADMISSION_ORDERS`."""
  if admission not in ADMISSION_ORDERS:
    raise ValueError(f"admission={admission!r} must be one of {ADMISSION_ORDERS}")


def admission_order(requests: Sequence[Request], admission: str) -> list[Request]:
  """The queue in the order `Engine.run(admission=...)` admits it (see there).

  Longest first sorts by `max_tokens`, descending; the sort is stable, so
  requests of equal budgets keep their queue order.
  """
  if admission == "fcfs":
    return list(requests)
  return sorted(requests, key=lambda r: -r.params.max_tokens)


