"""What users get back from the engine: completions, deltas, stats, timing, logprobs.

`Completion` (one finished sample of `Engine.run`), `Delta` (new tokens of one
sample, incremental API), `EngineStats` (counters of a run or of the
incremental API), `RequestTiming` (latency figures) and `TokenLogprob`, with
the host helpers that fill them from the loop's outputs (`token_logprobs`,
`read_paged_counters`). What users hand in is in `requests.py`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """One generated token's log-probability and the most likely alternatives.

  Attributes:
    token: the generated token.
    logprob: its log-probability under the model's raw distribution (see
      `SamplingParams.logprobs`).
    top: `SamplingParams.logprobs` pairs `(token, logprob)`, most likely first
      (it may or may not hold `token`).
  """

  token: int
  logprob: float
  top: tuple[tuple[int, float], ...] = ()


def logprob_buffers(ls) -> tuple:
  """`(out_logprob, out_top_ids, out_top_logprobs)` of a loop state, `token_logprobs`' input
  once on the host (`EngineCore.read(logprob_buffers)`)."""
  return ls.out.logprob, ls.out.top_ids, ls.out.top_logprobs


def token_logprobs(buffers, row: int, tokens, indices, n: int) -> list[TokenLogprob]:
  """`TokenLogprob`s of `tokens` (generated indices `indices`) from host copies of the outputs.

  Args:
    buffers: `logprob_buffers` as NumPy arrays.
    row: the sample's logprob row.
    tokens: its generated tokens at `indices`.
    indices: their indices among its generated tokens (slot `index % T`).
    n: top alternatives the request asked for.
  """
  lp, ids, top = buffers
  window = lp.shape[1]
  out = []
  for token, t in zip(tokens, indices):
    at = t % window
    out.append(TokenLogprob(int(token), float(lp[row, at]),
                            tuple((int(i), float(v)) for i, v in zip(ids[row, at, :n],
                                                                     top[row, at, :n]))))
  return out


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
    logprobs: one `TokenLogprob` per generated token when the request asked
      (`SamplingParams.logprobs`); None otherwise.
    timing: the sample's `RequestTiming` (from the device's step counts, see
      there); set when `Engine.run` returns or raises, None before (in
      `on_progress` callbacks). A measurement, not part of the result: two
      completions of the same tokens compare equal whatever their timing.
    speculation: the sample's `Speculation` when the engine speculates
      (`Engine(speculative=)`), else None; a measurement, as `timing`.
  """

  request_id: object
  index: int
  prompt: tuple[int, ...]
  tokens: list[int]
  finish_reason: str
  seed: int | None = None
  logprobs: list[TokenLogprob] | None = None
  timing: RequestTiming | None = dataclasses.field(default=None, compare=False)
  speculation: "Speculation | None" = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Speculation:
  """One sample's speculative decoding (`Engine(speculative=)`).

  Attributes:
    draft_tokens: draft tokens verified.
    accepted_tokens: those accepted (each one a step saved).
    rounds: steps that verified a draft.
  """

  draft_tokens: int = 0
  accepted_tokens: int = 0
  rounds: int = 0

  @property
  def acceptance_rate(self) -> float:
    """Accepted over verified draft tokens (0 without a draft)."""
    return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

  @property
  def mean_accepted_length(self) -> float:
    """Draft tokens accepted per step that verified a draft (vLLM's mean acceptance length
    is this plus one: the token each such step emits from its own rows)."""
    return self.accepted_tokens / self.rounds if self.rounds else 0.0


@dataclasses.dataclass
class EngineStats:
  """Counters of one `Engine.run` (or of the incremental API since its cache was made).

  Attributes:
    steps: cache steps run.
    step_tokens: real tokens carried by those steps (prefill + decode).
    generated: tokens sampled.
    occupancy: sum over steps of sequences in the step (mean = occupancy/steps).
    loop_entries: entries into the jitted loop (host round trips).
    seconds: wall time, compilation included.
    peak_rows: most cache positions held at once (all sequences together).
    width_steps: steps run at each compiled width (`{width: steps}`).
    compile_seconds: of `seconds`, the time spent tracing, lowering and
      compiling (`jax.monitoring`'s compile events in the serving thread; the
      first entry of a new shape class pays it, later entries reuse the code).
    aborted: samples ended by `Engine.abort` (incremental API).
    implementations: which attention implementation serves each layer and why
      (`Engine.implementations`: one `jaxkv.LayerImplementation` per layer).
    preemptions: paged storage: sequences preempted (pages dropped, tokens
      recomputed later) because a step or fork would pass `capacity`.
    evictions: prefix caching: retained prefixes evicted for room or columns.
    cached_tokens: prefix caching: prompt tokens adopted from cached pages
      instead of computed (`step_tokens` counts only the computed ones).
    setup_seconds: `Engine.run`: of `seconds`, the host's set-up before the
      loop's first entry (packing the queue, the loop state and K/V, growth).
    loop_seconds: `Engine.run`: of `seconds`, from each loop entry until its
      counters are on the host (the steps themselves, and the compilation of a
      first run); the rest of `seconds` is reading outputs and building
      completions between and after entries.
    step_call_seconds: stepping (`LiveQueue.dispatch(stepwise=True)`): of
      `seconds`, inside the single steps' calls (launching each step's kernels,
      then taking the interpreter lock back).
    pace_seconds: stepping: of `seconds`, waiting for the device to run a step
      queued earlier. Near `seconds` the device sets the pace; near zero the
      host does and the device waits for it.
    admit_seconds: stepping: of `seconds`, inside the admission blocks' calls
      (`admissions` of them). The block's loops read their predicates back, so on
      a GPU its call returns once the device has run every step queued before it
      and the block itself: what a request arriving at a busy engine waits for.
    admissions: stepping: admission blocks dispatched.
    draft_tokens, accepted_tokens: speculative decoding (`Engine(speculative=)`): draft
      tokens verified, and those accepted (`acceptance_rate` is their ratio).
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
  implementations: tuple = ()
  preemptions: int = 0
  evictions: int = 0
  cached_tokens: int = 0
  setup_seconds: float = 0.0
  loop_seconds: float = 0.0
  step_call_seconds: float = 0.0
  pace_seconds: float = 0.0
  admit_seconds: float = 0.0
  admissions: int = 0
  draft_tokens: int = 0
  accepted_tokens: int = 0

  @property
  def acceptance_rate(self) -> float:
    """Accepted over verified draft tokens (0 before any draft)."""
    return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

  @property
  def serve_seconds(self) -> float:
    """Wall time spent serving, compilation excluded (`seconds - compile_seconds`).

    The first run of a shape class also pays first-call costs that are not
    compilation (dispatch set-up of each jitted function: tens of milliseconds on
    a CPU), so its serving figures are pessimistic for short runs; a warm-up run
    of the same shape first (as `python -m jaxkv.demo` does) removes them.
    """
    return max(self.seconds - self.compile_seconds, 0.0)

  @property
  def tokens_per_second(self) -> float:
    """Generated tokens per second of serving time (after warm-up: compilation excluded)."""
    return self.generated / self.serve_seconds if self.serve_seconds > 0 else 0.0

  @property
  def step_seconds(self) -> float:
    """Mean wall time of one step, compilation excluded (`serve_seconds / steps`; 0 before any).

    Host time between loop entries (reading outputs, growth, bookkeeping) is
    spread over the steps, so step counts times this add up to the serving time.
    """
    return self.serve_seconds / self.steps if self.steps else 0.0


# Loop counters (`LoopState` scalars) copied into `EngineStats` after each loop entry.
PAGED_COUNTERS = ("preemptions", "evictions", "cached_tokens")


def read_paged_counters(stats: EngineStats, host: dict) -> None:
  """Copies the paged loop's counters from a host copy of the loop state into `stats`."""
  for name in PAGED_COUNTERS:
    setattr(stats, name, int(host[name]))


@dataclasses.dataclass(frozen=True)
class RequestTiming:
  """Latency figures of one request (incremental API) or one sample (`Engine.run`).

  Every figure counts from the request's arrival: `add_request` on the
  incremental API, the start of the run on `Engine.run`.

  **Incremental API** (`Delta.timing`): measured on the host with
  `time.perf_counter`, to the resolution of one loop entry (`k` steps); the
  step fields are None.

  **`Engine.run`** (`Completion.timing`): the whole queue is served inside
  jitted calls, so the host cannot time one request. The loop records, per
  output row (one per sample), its step counter when the sample's request was
  admitted, after the step that sampled the sample's first token and after
  the step that sampled its last (`admitted_step`, `first_token_step`,
  `finished_step`; every request arrives at step 0), and `Engine.run`
  converts each count to seconds by multiplying it by the run's measured mean
  step time, `EngineStats.step_seconds` = (wall time - compile time) / steps.
  The seconds are estimates: every step counts as the mean step (a wide
  prefill step costs more than a one-slot decode step), and host time between
  loop entries is spread over the steps.

  Attributes:
    queue_seconds: arrival until admission into the loop (None if the request
      was aborted before it).
    first_token_seconds: arrival until its first token: the time to first
      token (None if it produced none).
    total_seconds: arrival until it finished.
    inter_token_seconds: mean time between consecutive tokens, (last token -
      first token) / (tokens - 1); None with fewer than two tokens.
    admitted_step, first_token_step, finished_step: `Engine.run` only: the
      step counts above, `admitted_step < first_token_step <= finished_step`.
  """

  queue_seconds: float | None
  first_token_seconds: float | None
  total_seconds: float
  inter_token_seconds: float | None = None
  admitted_step: int | None = None
  first_token_step: int | None = None
  finished_step: int | None = None

  @classmethod
  def from_steps(cls, admitted: int, first: int, finished: int, tokens: int,
                 step_seconds: float) -> RequestTiming:
    """The figures of one `Engine.run` sample from its step counts and the mean step time."""
    if not 0 <= admitted < first <= finished:
      raise ValueError(f"step counts admitted={admitted}, first={first}, finished={finished} "
                       "must satisfy 0 <= admitted < first <= finished")
    between = (finished - first) / (tokens - 1) * step_seconds if tokens > 1 else None
    return cls(admitted * step_seconds, first * step_seconds, finished * step_seconds, between,
               admitted, first, finished)


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
    logprobs: one `TokenLogprob` per token of `tokens` when the request asked
      (`SamplingParams.logprobs`); None otherwise.
    speculation: the sample's `Speculation` on the delta that ends it by a stop or
      its limit, when the engine speculates (`Engine(speculative=)`); None otherwise
      (an aborted sample's last delta too).
  """

  request_id: object
  index: int
  tokens: tuple[int, ...]
  finish_reason: str | None
  seed: int
  timing: RequestTiming | None = None
  logprobs: tuple[TokenLogprob, ...] | None = None
  speculation: Speculation | None = dataclasses.field(default=None, compare=False)
