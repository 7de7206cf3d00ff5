"""What users hand the engine and get back: requests, sampling parameters, completions, stats.

Validation happens at the boundary, in two places: `Request`/`SamplingParams`
check types and the ranges that need no model at construction, and
`check_request` checks what needs the model and the engine (vocabulary, lengths,
columns, capacity) at submission, before anything is served. Both raise
`TypeError` (wrong kind of value) or `ValueError` (out of range) naming the
field, and the request id when it is known.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

_INT32_LIMIT = 2**31


def _label(request_id) -> str:
  return "" if request_id is None else f"request {request_id!r}: "


def _as_int(name: str, value, request_id=None) -> int:
  """A Python int from an int or NumPy integer; bools, floats and strings are refused.

  Nothing is truncated: `2.5` is a TypeError, not 2.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{_label(request_id)}{name}={value!r} must be an int "
                    f"(got {type(value).__name__})")
  return int(value)


def _as_real(name: str, value, request_id=None) -> float:
  """A finite Python float from a real number (bools and strings refused)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"{_label(request_id)}{name}={value!r} must be a real number "
                    f"(got {type(value).__name__})")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{_label(request_id)}{name}={value} must be finite")
  return value


def _token_ids(name: str, values, request_id=None) -> tuple[int, ...]:
  """A tuple of non-negative int token ids from a sequence of ints."""
  # A str or bytes iterates as characters or small ints: "12" must not become (1, 2).
  if isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__iter__"):
    raise TypeError(f"{_label(request_id)}{name}={values!r} must be a sequence of int "
                    f"token ids (got {type(values).__name__})")
  if isinstance(values, np.ndarray) and values.ndim != 1:
    raise TypeError(f"{_label(request_id)}{name} must be one-dimensional; got shape "
                    f"{values.shape}")
  ids = tuple(_as_int(f"{name}[{i}]", t, request_id) for i, t in enumerate(values))
  for i, t in enumerate(ids):
    if t < 0:
      raise ValueError(f"{_label(request_id)}{name}[{i}]={t} must be >= 0")
  return ids


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is sampled.

  Attributes:
    max_tokens: most new tokens (`>= 1`).
    temperature: 0 is greedy; otherwise logits are divided by it.
    top_k: keep the `top_k` most likely tokens (0: all).
    top_p: keep the smallest set whose probability reaches `top_p` (1: all).
    seed: the request's seed; sample `i`'s token `t` uses
      `fold_in(fold_in(key(seed), i), t)`, independent of batching. None: the
      engine draws one on the host and reports it (`Completion.seed`,
      `Delta.seed`), so a random request can be replayed.
    stop_tokens: tokens that end the request (the stop token is kept).
    n: parallel samples of the prompt (forked with `seq_clone`).
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = 0
  stop_tokens: tuple[int, ...] = ()
  n: int = 1

  def __post_init__(self):
    fields = {}
    for name, lo in (("max_tokens", 1), ("top_k", 0), ("n", 1), ("seed", 0)):
      if name == "seed" and self.seed is None:   # drawn by the engine on the host
        fields[name] = None
        continue
      value = _as_int(name, getattr(self, name))
      if not lo <= value < _INT32_LIMIT:
        raise ValueError(f"{name}={value} must be in [{lo}, 2**31)")
      fields[name] = value
    fields["temperature"] = _as_real("temperature", self.temperature)
    fields["top_p"] = _as_real("top_p", self.top_p)
    if not fields["temperature"] >= 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0")
    if not 0 < fields["top_p"] <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    fields["stop_tokens"] = _token_ids("stop_tokens", self.stop_tokens)
    for name, value in fields.items():   # plain Python values: equal params hash equal
      object.__setattr__(self, name, value)


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
    try:
      hash(rid)
    except TypeError as e:
      raise TypeError(f"request_id={rid!r} must be hashable") from e
    prompt = _token_ids("prompt", self.prompt, rid)
    if not prompt:
      raise ValueError(f"{_label(rid)}prompt must hold at least one token")
    if not isinstance(self.params, SamplingParams):
      raise TypeError(f"{_label(rid)}params={self.params!r} must be a SamplingParams")
    object.__setattr__(self, "prompt", prompt)


def check_request(request: Request, *, vocab_size: int, max_len: int, max_seqs: int,
                  capacity: int, max_stop_tokens: int) -> None:
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

  Raises:
    TypeError: `request` is not a `Request`.
    ValueError: naming the request id and the field that cannot be served.
  """
  if not isinstance(request, Request):
    raise TypeError(f"request={request!r} must be a Request")
  label, p = f"request {request.request_id!r}", request.params
  for name, ids in (("prompt", request.prompt), ("stop_tokens", p.stop_tokens)):
    for i, t in enumerate(ids):
      if t >= vocab_size:
        raise ValueError(f"{label}: {name}[{i}]={t} must be < vocab_size={vocab_size}")
  total = len(request.prompt) + p.max_tokens
  if total > max_len:
    raise ValueError(f"{label}: prompt ({len(request.prompt)}) + max_tokens ({p.max_tokens}) "
                     f"must be <= max_len={max_len}")
  if p.n > max_seqs:
    raise ValueError(f"{label}: n={p.n} must be <= max_seqs={max_seqs}")
  if p.n * (total - 1) > capacity:
    raise ValueError(f"{label}: n ({p.n}) x (prompt + max_tokens - 1 = {total - 1}) = "
                     f"{p.n * (total - 1)} cache rows must be <= capacity={capacity}")
  if len(p.stop_tokens) > max_stop_tokens:
    raise ValueError(f"{label}: {len(p.stop_tokens)} stop_tokens; at most "
                     f"max_stop_tokens={max_stop_tokens}")


@dataclasses.dataclass
class Completion:
  """One finished sample.

  Attributes:
    request_id: the request's label.
    index: sample index (0..n-1).
    prompt: the prompt tokens.
    tokens: generated tokens.
    finish_reason: `"stop"` (a stop token) or `"length"` (token limit).
    seed: the seed the sample was drawn with (drawn by the engine when the
      request's was None).
  """

  request_id: object
  index: int
  prompt: tuple[int, ...]
  tokens: list[int]
  finish_reason: str
  seed: int | None = None


@dataclasses.dataclass
class EngineStats:
  """Counters of one `Engine.run`.

  Attributes:
    steps: cache steps run.
    step_tokens: real tokens carried by those steps (prefill + decode).
    generated: tokens sampled.
    occupancy: sum over steps of sequences in the step (mean = occupancy/steps).
    loop_entries: entries into the jitted loop (host round trips).
    seconds: wall time.
    peak_rows: most cache positions held at once (all sequences together).
    width_steps: steps run at each compiled width (`{width: steps}`).
    compile_seconds: of `seconds`, the time spent tracing and compiling (the
      first entry of a new shape class pays it).
    aborted: samples ended by `Engine.abort` (incremental API).
    preemptions: paged storage: sequences preempted (pages dropped, tokens
      recomputed later) because a step or fork would pass `capacity`.
    evictions: prefix caching: retained prefixes evicted for room or columns.
    cached_tokens: prefix caching: prompt tokens adopted from cached pages
      instead of computed (`step_tokens` counts only the computed ones).
  """

  steps: int = 0
  step_tokens: int = 0
  generated: int = 0
  occupancy: int = 0
  loop_entries: int = 0
  seconds: float = 0.0
  peak_rows: int = 0
  width_steps: dict = dataclasses.field(default_factory=dict)
  compile_seconds: float = 0.0
  aborted: int = 0
  preemptions: int = 0
  evictions: int = 0
  cached_tokens: int = 0

  @property
  def serve_seconds(self) -> float:
    """Wall time spent serving, compilation excluded."""
    return max(self.seconds - self.compile_seconds, 0.0)

  @property
  def tokens_per_second(self) -> float:
    """Generated tokens per second of serving time (after warm-up: compilation excluded)."""
    return self.generated / self.serve_seconds if self.serve_seconds > 0 else 0.0


# Loop counters (`LoopState` scalars) copied into `EngineStats` after each loop entry.
PAGED_COUNTERS = ("preemptions", "evictions", "cached_tokens")


def read_paged_counters(stats: EngineStats, host: dict) -> None:
  """Copies the paged loop's counters from a host copy of the loop state into `stats`."""
  for name in PAGED_COUNTERS:
    setattr(stats, name, int(host[name]))


@dataclasses.dataclass(frozen=True)
class RequestTiming:
  """Latency figures of one request, measured on the host (resolution: one loop entry).

  Attributes:
    queue_seconds: `add_request` until the host saw the request admitted.
    first_token_seconds: `add_request` until its first token was reported
      (None if it produced none).
    total_seconds: `add_request` until it finished.
  """

  queue_seconds: float | None
  first_token_seconds: float | None
  total_seconds: float


@dataclasses.dataclass(frozen=True)
class Delta:
  """New tokens of one sample since the last step.

  Attributes:
    request_id: the request's id (`add_request`'s return value).
    index: sample index (0..n-1).
    tokens: tokens generated since the last delta of this sample.
    finish_reason: None while the sample runs; `"stop"` (a stop token, kept
      as the last token), `"length"` (max_tokens) or `"abort"` (`abort`).
    seed: the sample's seed (drawn by the engine when the request's was None).
    timing: the request's `RequestTiming` on the delta that ends its last
      sample; None otherwise.
  """

  request_id: object
  index: int
  tokens: tuple[int, ...]
  finish_reason: str | None
  seed: int
  timing: RequestTiming | None = None
