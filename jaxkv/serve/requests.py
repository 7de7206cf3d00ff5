"""What users hand the engine and get back: requests, sampling parameters, completions, stats."""

from __future__ import annotations

import dataclasses


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
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if self.n < 1:
      raise ValueError(f"n={self.n} must be >= 1")
    if self.seed is not None and not 0 <= self.seed < 2**31:
      raise ValueError(f"seed={self.seed} must be in [0, 2**31)")
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


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
    prompt = tuple(int(t) for t in self.prompt)
    if not prompt:
      raise ValueError("prompt must hold at least one token")
    object.__setattr__(self, "prompt", prompt)


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

  @property
  def serve_seconds(self) -> float:
    """Wall time spent serving, compilation excluded."""
    return max(self.seconds - self.compile_seconds, 0.0)

  @property
  def tokens_per_second(self) -> float:
    """Generated tokens per second of serving time (after warm-up: compilation excluded)."""
    return self.generated / self.serve_seconds if self.serve_seconds > 0 else 0.0


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
