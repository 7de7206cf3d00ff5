"""What users hand the engine: requests and sampling parameters, and the checks on them.

What comes back (completions, deltas, stats, timing, logprobs) is in `results.py`.

Validation happens at the boundary, in two places: `Request`/`SamplingParams`
check types and the ranges that need no model at construction, and
`check_request` checks what needs the model and the engine (vocabulary, lengths,
columns, capacity) at submission, before anything is served. Both raise
`TypeError` (wrong kind of value) or `ValueError` (out of range) naming the
field, and the request id when it is known.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from jaxkv.structured.automaton import TokenAutomaton

_INT32_LIMIT = 2**31
# The engine samples with float32 parameters: a larger magnitude becomes inf there.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _label(request_id) -> str:
  return "" if request_id is None else f"request {request_id!r}: "


def _as_int(name: str, value, request_id=None, *, index=None) -> int:
  """A Python int from an int or NumPy integer; bools, floats and strings are refused.

  Nothing is truncated: `2.5` is a TypeError, not 2. `index`: the value is
  `name[index]` (formatted only for the error message).
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    where = name if index is None else f"{name}[{index}]"
    raise TypeError(f"{_label(request_id)}{where}={value!r} must be an int "
                    f"(got {type(value).__name__})")
  return int(value)


def _as_real(name: str, value, request_id=None) -> float:
  """A Python float from a real number, finite in float32 (bools and strings refused).

  The engine holds sampling parameters as float32, where `1e308` is inf.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"{_label(request_id)}{name}={value!r} must be a real number "
                    f"(got {type(value).__name__})")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{_label(request_id)}{name}={value} must be finite")
  if abs(value) > _FLOAT32_MAX:
    raise ValueError(f"{_label(request_id)}{name}={value} overflows float32 (the engine "
                     f"samples in float32; |{name}| must be <= {_FLOAT32_MAX:.4g})")
  return value


def _positive_in_float32(name: str, value: float) -> None:
  """`value > 0` as the engine sees it: a float32 that does not underflow to 0."""
  if not np.float32(value) > 0:
    raise ValueError(f"{name}={value} must be > 0 (and not underflow to 0 in float32)")


def _token_ids(name: str, values, request_id=None) -> tuple[int, ...]:
  """A tuple of non-negative int token ids from a sequence of ints."""
  # A str or bytes iterates as characters or small ints: "12" must not become (1, 2).
  # A dict iterates its keys and a set in no defined order: neither is a token list.
  if (isinstance(values, (str, bytes, bytearray, collections.abc.Mapping,
                          collections.abc.Set))
      or not hasattr(values, "__iter__")):
    raise TypeError(f"{_label(request_id)}{name}={values!r} must be a sequence of int "
                    f"token ids (got {type(values).__name__})")
  if isinstance(values, np.ndarray) and values.ndim != 1:
    raise TypeError(f"{_label(request_id)}{name} must be one-dimensional; got shape "
                    f"{values.shape}")
  # Fast paths, one C-level pass each (a prompt of thousands of tokens is checked at
  # construction and again by every `dataclasses.replace`): a tuple of Python ints
  # (what this returns, so re-checking one costs little), a NumPy integer array.
  # pylint: disable-next=unidiomatic-typecheck
  if type(values) is tuple and all(type(t) is int for t in values):
    ids = values
  elif isinstance(values, np.ndarray) and values.dtype.kind in "iu":
    ids = tuple(values.tolist())
  else:
    ids = tuple(_as_int(name, t, request_id, index=i) for i, t in enumerate(values))
  if ids and min(ids) < 0:
    i = next(i for i, t in enumerate(ids) if t < 0)
    raise ValueError(f"{_label(request_id)}{name}[{i}]={ids[i]} must be >= 0")
  return ids


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is sampled.

  Attributes:
    max_tokens: most new tokens (`>= 1`).
    temperature: 0 is greedy; otherwise logits are divided by it.
    top_k: keep the `top_k` most likely tokens (0 or -1, vLLM's spelling: all;
      -1 is stored as 0).
    top_p: keep the smallest set whose probability reaches `top_p` (1: all).
    seed: the request's seed; sample `i`'s token `t` uses
      `fold_in(fold_in(key(seed), i), t)`, independent of batching. None: the
      engine draws one on the host and reports it (`Completion.seed`,
      `Delta.seed`), so a random request can be replayed.
    stop_tokens: tokens that end the request (the stop token is kept).
    n: parallel samples of the prompt (forked with `seq_clone`).
    min_p: keep tokens whose probability (after temperature) is at least
      `min_p` times the most likely one's, in [0, 1] (0: off).
    repetition_penalty: over every token in the prompt or the output, a
      positive logit is divided by it and any other multiplied (Hugging Face
      and vLLM semantics); `> 0`, 1 is off, `> 1` discourages repeats.
    presence_penalty: subtracted from the logit of every token generated at
      least once, in [-2, 2] (OpenAI semantics; the prompt does not count).
    frequency_penalty: times the token's count in the output, subtracted from
      its logit, in [-2, 2] (OpenAI semantics; the prompt does not count).
    logprobs: None, or how many top alternatives to report per generated token
      (0: only the chosen token's); at most the engine's `max_logprobs`
      (default 20). Reported from the model's raw distribution: `log_softmax`
      of its logits before penalties, temperature, min_p, top-k and top-p (as
      vLLM and OpenAI report them), so a greedy token's logprob is the largest.
    min_tokens: no stop token is sampled before this many new tokens (vLLM's: a
      greedy request takes the most likely other token); at most `max_tokens`.
    logit_bias: `{token: bias}` (or `(token, bias)` pairs), each bias in [-100, 100]
      added to that token's logit before the penalties and temperature (OpenAI's),
      at most `MAX_LOGIT_BIAS` tokens; logprobs stay the raw distribution's.
    allowed_token_ids: None, or the only tokens that may be drawn (vLLM's; at most
      `MAX_LOGIT_BIAS`): the others are removed before the bias, which then applies
      to these alone. Stop tokens outside it can no longer end the request.
    grammar: None, or a `jaxkv.structured.automaton.TokenAutomaton` (structured
      output: a JSON schema, regex or choice compiled for the engine's vocabulary):
      each token is drawn from what the automaton allows (before the bias,
      penalties and temperature; logprobs stay raw), and once its text is complete
      only `stop_tokens` may follow (so it needs at least one). Not with
      `min_tokens` or `allowed_token_ids`.
    speculative: whether the request may be drafted and verified several tokens a
      step by an engine built with `speculative=` (plain greedy requests only;
      the tokens are the same either way). False: one token per step.

  Penalties apply to greedy requests too (the argmax of the penalised logits),
  in vLLM's order: penalties, then temperature, min_p, top-k, top-p.
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = 0
  stop_tokens: tuple[int, ...] = ()
  n: int = 1
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logprobs: int | None = None
  min_tokens: int = 0
  logit_bias: Any = ()
  allowed_token_ids: Any = None
  grammar: Any = None
  speculative: bool = True

  def __post_init__(self):
    fields = {}
    if not isinstance(self.speculative, bool):
      raise TypeError(f"speculative={self.speculative!r} must be a bool")
    if _as_int("top_k", self.top_k) == -1:   # vLLM's "off"
      object.__setattr__(self, "top_k", 0)
    for name, lo in (("max_tokens", 1), ("top_k", 0), ("n", 1), ("seed", 0), ("min_tokens", 0)):
      if name == "seed" and self.seed is None:   # drawn by the engine on the host
        fields[name] = None
        continue
      value = _as_int(name, getattr(self, name))
      if not lo <= value < _INT32_LIMIT:
        raise ValueError(f"{name}={value} must be in [{lo}, 2**31)")
      fields[name] = value
    if fields["min_tokens"] > fields["max_tokens"]:
      raise ValueError(f"min_tokens={fields['min_tokens']} must be <= max_tokens="
                       f"{fields['max_tokens']}")
    fields["temperature"] = _as_real("temperature", self.temperature)
    fields["top_p"] = _as_real("top_p", self.top_p)
    if not fields["temperature"] >= 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0")
    if not 0 < fields["top_p"] <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    _positive_in_float32("top_p", fields["top_p"])
    fields["stop_tokens"] = _token_ids("stop_tokens", self.stop_tokens)
    fields["logit_bias"] = _logit_bias(self.logit_bias)
    if self.allowed_token_ids is not None:
      allowed = tuple(sorted(set(_token_ids("allowed_token_ids", self.allowed_token_ids))))
      if not allowed:
        raise ValueError("allowed_token_ids=[] allows no token (None: every token)")
      if len(allowed) > MAX_LOGIT_BIAS:
        raise ValueError(f"allowed_token_ids has {len(allowed)} tokens; at most "
                         f"MAX_LOGIT_BIAS={MAX_LOGIT_BIAS}")
      fields["allowed_token_ids"] = allowed
    fields.update(_sampling_extras(self))
    if self.grammar is not None:
      _check_grammar(self.grammar, fields)
    for name, value in fields.items():   # plain Python values: equal params hash equal
      object.__setattr__(self, name, value)


def _check_grammar(grammar, fields: dict) -> None:
  if not isinstance(grammar, TokenAutomaton):
    raise TypeError(f"grammar={grammar!r:.100} must be a jaxkv.structured TokenAutomaton "
                    "(AutomatonCache.compile) or None")
  if not fields["stop_tokens"]:
    raise ValueError("grammar needs stop_tokens: a complete text ends with one of them")
  if fields["min_tokens"]:
    raise ValueError("grammar and min_tokens cannot be combined (the grammar decides the end)")
  if fields.get("allowed_token_ids") is not None:
    raise ValueError("grammar and allowed_token_ids cannot be combined (the grammar decides "
                     "the allowed tokens)")


# vLLM's ranges for the parameters it shares with OpenAI.
_RANGES = {"min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
# Top logprobs an engine reports per token by default (vLLM's `max_logprobs`).
MAX_LOGPROBS = 20
# Tokens one request may bias: the loop keeps `MAX_LOGIT_BIAS` (token, bias) slots per column.
MAX_LOGIT_BIAS = 64


def bias_slots(p: "SamplingParams") -> tuple[tuple[tuple[int, float], ...], bool]:
  """`((token, bias) slots, restricted)`: the loop's per-column logit slots of `p`. With
  `allowed_token_ids`, the allowed tokens (each with its bias, else 0) and only they may be
  drawn; else the biased tokens."""
  if p.allowed_token_ids is None:
    return p.logit_bias, False
  bias = dict(p.logit_bias)
  return tuple((t, bias.get(t, 0.0)) for t in p.allowed_token_ids), True


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
  """`(token, bias)` pairs sorted by token, from a mapping or pairs (TypeError/ValueError
  naming `logit_bias`)."""
  pairs = value.items() if isinstance(value, collections.abc.Mapping) else value
  if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
    raise TypeError(f"logit_bias={value!r} must map token ids to biases")
  out = {}
  for pair in pairs:
    if not (isinstance(pair, tuple) and len(pair) == 2):
      raise TypeError(f"logit_bias={value!r} must map token ids to biases")
    token = _as_int("logit_bias token", pair[0])
    bias = _as_real(f"logit_bias[{token}]", pair[1])
    if token < 0:
      raise ValueError(f"logit_bias token {token} must be >= 0")
    if not -100 <= bias <= 100:
      raise ValueError(f"logit_bias[{token}]={bias} must be in [-100, 100]")
    out[token] = bias
  if len(out) > MAX_LOGIT_BIAS:
    raise ValueError(f"logit_bias has {len(out)} tokens; at most MAX_LOGIT_BIAS={MAX_LOGIT_BIAS}")
  return tuple(sorted(out.items()))


def _sampling_extras(p: SamplingParams) -> dict:
  """Validated min_p, penalties and logprobs of `p` (TypeError/ValueError naming the field)."""
  out = {}
  for name, (lo, hi) in _RANGES.items():
    value = _as_real(name, getattr(p, name))
    if not lo <= value <= hi:
      raise ValueError(f"{name}={value} must be in [{lo}, {hi}]")
    out[name] = value
  rep = _as_real("repetition_penalty", p.repetition_penalty)
  _positive_in_float32("repetition_penalty", rep)
  out["repetition_penalty"] = rep
  out["logprobs"] = None
  if p.logprobs is not None:
    out["logprobs"] = _as_int("logprobs", p.logprobs)
    if not 0 <= out["logprobs"] < _INT32_LIMIT:
      raise ValueError(f"logprobs={out['logprobs']} must be >= 0 (or None: no logprobs)")
  return out


@dataclasses.dataclass(frozen=True)
class Request:
  """A prompt and its sampling parameters.

  Attributes:
    prompt: token ids (at least one).
    params: `SamplingParams`.
    request_id: any hashable label (default: its index in the `run` call).
  """

  prompt: tuple[int, ...]
  params: SamplingParams = SamplingParams()
  request_id: object = None

  def __post_init__(self):
    rid = self.request_id
    _check_id_and_params(rid, self.params)
    prompt = _token_ids("prompt", self.prompt, rid)
    if not prompt:
      raise ValueError(f"{_label(rid)}prompt must hold at least one token")
    object.__setattr__(self, "prompt", prompt)

  def replace(self, **changes) -> "Request":
    """`dataclasses.replace` of `request_id` and/or `params`, keeping the checked prompt.

    The engine labels and seeds every queued request; re-checking a prompt of
    thousands of tokens each time cost tens of milliseconds per run. The new
    values are checked as the constructor checks them.
    """
    unknown = set(changes) - {"request_id", "params"}
    if unknown:
      raise TypeError(f"replace: only request_id and params; got {sorted(unknown)}")
    rid = changes.get("request_id", self.request_id)
    params = changes.get("params", self.params)
    _check_id_and_params(rid, params)
    new = object.__new__(Request)
    changed = {"request_id": rid, "params": params}
    for field in dataclasses.fields(Request):   # every field, so a new one is carried over
      object.__setattr__(new, field.name, changed.get(field.name, getattr(self, field.name)))
    return new


def _check_id_and_params(rid, params) -> None:
  try:
    hash(rid)
  except TypeError as e:
    raise TypeError(f"request_id={rid!r} must be hashable") from e
  if not isinstance(params, SamplingParams):
    raise TypeError(f"{_label(rid)}params={params!r} must be a SamplingParams")


def check_request(request: Request, *, vocab_size: int, max_len: int, max_seqs: int,
                  capacity: int, max_stop_tokens: int,
                  max_logprobs: int = MAX_LOGPROBS, grammar_room=(0, 0, 0)) -> None:
  """Checks a request against the model and the engine, before anything is served.

  Args:
    request: the `Request` (already type- and sign-checked by its constructor).
    vocab_size: the model's vocabulary; every prompt and stop token must be below it
      (an id past it reads past the embedding and its NaN K/V would stay in the
      sequence's history).
    max_len: the engine's per-column token buffer (prompt + max_tokens).
    max_seqs: the cache's columns (`n` samples each take one).
    capacity: the cache's token budget (each sample holds prompt + max_tokens - 1).
    max_stop_tokens: the engine's stop-token slots per request.
    max_logprobs: the engine's top logprobs per token (`logprobs` must not exceed it).
    grammar_room: the engine's grammar pool `(states, masks, transitions)`; a
      request's `grammar` must fit it alone.

  Raises:
    TypeError: `request` is not a `Request`.
    ValueError: naming the request id and the field that cannot be served.
  """
  if not isinstance(request, Request):
    raise TypeError(f"request={request!r} must be a Request")
  label, p = f"request {request.request_id!r}", request.params
  for name, ids in (("prompt", request.prompt), ("stop_tokens", p.stop_tokens)):
    if ids and max(ids) >= vocab_size:   # one C-level pass; the loop only names the first
      i = next(i for i, t in enumerate(ids) if t >= vocab_size)
      raise ValueError(f"{label}: {name}[{i}]={ids[i]} must be < vocab_size={vocab_size}")
  total = len(request.prompt) + p.max_tokens
  if total > max_len:
    raise ValueError(f"{label}: prompt ({len(request.prompt)}) + max_tokens ({p.max_tokens}) "
                     f"must be <= max_len={max_len}")
  if p.n > max_seqs:
    raise ValueError(f"{label}: n={p.n} must be <= max_seqs={max_seqs}")
  if p.n * (total - 1) > capacity:
    raise ValueError(f"{label}: n ({p.n}) x (prompt + max_tokens - 1 = {total - 1}) = "
                     f"{p.n * (total - 1)} cache rows must be <= capacity={capacity}")
  if p.logprobs is not None and p.logprobs > min(max_logprobs, vocab_size):
    raise ValueError(f"{label}: logprobs={p.logprobs} must be <= max_logprobs={max_logprobs} "
                     f"(and vocab_size={vocab_size})")
  if p.allowed_token_ids and p.allowed_token_ids[-1] >= vocab_size:
    raise ValueError(f"{label}: allowed_token_ids holds {p.allowed_token_ids[-1]}, which must be "
                     f"< vocab_size={vocab_size}")
  if p.logit_bias and p.logit_bias[-1][0] >= vocab_size:
    bad = next(t for t, _ in p.logit_bias if t >= vocab_size)
    raise ValueError(f"{label}: logit_bias token {bad} must be < vocab_size={vocab_size}")
  if len(p.stop_tokens) > max_stop_tokens:
    raise ValueError(f"{label}: {len(p.stop_tokens)} stop_tokens; at most "
                     f"max_stop_tokens={max_stop_tokens}")
  if p.grammar is not None:
    g = p.grammar
    if g.vocab_size > vocab_size:
      raise ValueError(f"{label}: grammar was compiled for {g.vocab_size} tokens; the model has "
                       f"vocab_size={vocab_size}")
    need = (g.num_states, g.masks.shape[0], g.tokens.shape[0])
    for what, n, room in zip(("states", "masks", "transitions"), need, grammar_room[:3]):
      if n > room:
        raise ValueError(f"{label}: grammar has {n} {what}; the engine's grammar pool holds "
                         f"{room} (Engine(grammar_pool=...))")
