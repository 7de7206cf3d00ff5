"""`Engine`'s incremental API: requests that come and go over one persistent cache.

`IncrementalAPI` holds the methods `Engine` offers for it (`add_request`,
`abort`, `abort_many`, `step`, `stream`, `warm_up`, `counts`, ...); each hands
the work to the engine's `LiveQueue` (`live.py`), made on first use. `Engine`
(`engine.py`) inherits them; `Engine.run` serves a known queue instead.
"""

from __future__ import annotations

from typing import Iterator

from jaxkv.serve.live import LiveQueue
from jaxkv.serve.requests import Request, SamplingParams
from jaxkv.serve.results import Delta, EngineStats


class IncrementalAPI:
  """`Engine`'s incremental face (mixed into `Engine`; see `live.py` for how it serves)."""

  def _live_queue(self) -> LiveQueue:
    if self._live is None:
      self.state = None   # run's state goes before the persistent one is allocated
      self.stats = EngineStats(implementations=self.implementations)
      self._live = LiveQueue(self)
    return self._live

  @property
  def live(self) -> LiveQueue:
    """The incremental API's `LiveQueue` (made on first use): its `dispatch` and `collect`
    halves let a front run loop entries on one thread and read them back on another."""
    return self._live_queue()

  def add_request(self, request: Request):
    """Queues one request for `step`/`stream`; returns its id.

    The request is checked now (as by `run`); a refused request changes
    nothing. It may be called from any thread, also while a step runs; the
    request enters the loop at the next step. Its stop tokens may exceed
    `max_stop_tokens`: the rest are checked on the host after each step. A
    `seed` of None is drawn here and reported on every `Delta`.

    Args:
      request: the `Request`; its `request_id` (default: the lowest unused
        int) must not be in flight.

    Returns:
      The request id.

    Raises:
      ValueError, TypeError: a malformed request, one that can never fit, or
        an id already in flight.
    """
    return self._live_queue().add_request(request)

  def abort(self, request_id, index: int | None = None) -> bool:
    """Ends a request (or one running sample) at the next step, finish reason `"abort"`.

    Its columns are removed and their reserved room freed before the next
    loop entry, so waiting requests can take them.

    Args:
      request_id: the request.
      index: one sample of it (only once that sample has produced tokens);
        None: every unfinished sample.

    Returns:
      False (changing nothing) if the request or sample is not in flight.
    """
    return self._live is not None and self._live.abort(request_id, index)

  def abort_many(self, request_ids) -> int:
    """`abort` of every request in `request_ids` in one call (one lock, O(1) each): a client
    that sent many prompts and left. Returns how many of them were in flight."""
    return 0 if self._live is None else self._live.abort_many(request_ids)

  def has_unfinished(self) -> bool:
    """Whether a request added with `add_request` has not finished yet."""
    return self._live is not None and self._live.has_unfinished()

  def counts(self) -> tuple[int, int]:
    """`(running, waiting)` requests of the incremental API: admitted into the loop, and not yet."""
    return (0, 0) if self._live is None else self._live.counts()

  @property
  def waiting_tokens(self) -> int:
    """Prompt tokens of the incremental API's requests not yet admitted into the loop."""
    return 0 if self._live is None else self._live.waiting_tokens

  @property
  def held(self) -> int:
    """Cache positions held by the incremental API's sequences after its last step."""
    return 0 if self._live is None else self._live.held

  def step(self, max_steps: int | None = None, *, overlap: bool = False) -> list[Delta]:
    """One loop entry of at most `max_steps` steps over the persistent cache.

    Applies pending aborts, moves waiting requests into the device queue,
    runs the jitted loop (admission, forks, steps, retirement inside) and
    reports every sample's new tokens. One entry runs at a time.

    Args:
      max_steps: the streaming interval `k` (default: the engine's `max_steps`).
      overlap: dispatch the next entry before building this one's deltas, so
        the device never waits for the host's formatting: the call returns the
        deltas of the entry the previous call dispatched and leaves one entry in
        flight while work remains; aborts and host-side stop cuts then take
        effect one entry later. Off while a request that wants logprobs is in
        flight. `AsyncEngine` (and so the server) steps this way.

    Returns:
      `Delta`s of the samples that produced tokens or finished, in arrival
      order; the last delta of a request carries its `RequestTiming`.

    Raises:
      EngineError: the model, device or cache failed; the requests the
        device held are dropped (`error.failed`), requests still waiting on
        the host are kept, and the next step starts on a fresh cache;
        `error.deltas` holds the deltas read before the failure.
      RuntimeError: another step is running.
    """
    return self._live_queue().step(max_steps, overlap=overlap)

  def warm_up(self, steps=(1,)) -> float:
    """Compiles what the incremental API runs, before any request; returns the compile seconds.

    For each entry length in `steps` (the `max_steps` the caller will step
    with), a greedy and a sampled one-token request run one entry (the loop
    without and with the sampler, which `step` picks by what is in flight, and
    the entry's snapshot compile) and are aborted (the abort helper compiles);
    nothing of them stays in the engine.

    Raises:
      RuntimeError: requests added with `add_request` are in flight.
    """
    if self.has_unfinished():
      raise RuntimeError("warm_up: requests are in flight; call it before serving")
    before = self.stats.compile_seconds
    for temperature in (0.0, 1.0):
      for k in steps:
        rid = self.add_request(Request((0,), SamplingParams(max_tokens=2, temperature=temperature),
                                       request_id="warm-up"))
        self.step(k)
        self.abort(rid)
        while self.has_unfinished():
          self.step(k)
    return self.stats.compile_seconds - before

  def stream(self, max_steps: int | None = None) -> Iterator[Delta]:
    """Steps until every added request has finished, yielding the deltas as they come."""
    live = self._live_queue()
    while live.has_unfinished():
      yield from live.step(max_steps)
