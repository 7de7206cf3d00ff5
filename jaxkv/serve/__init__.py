"""Serving on jaxkv: a continuous-batching engine whose decode loop is one `jax.jit`.

`Engine` serves a queue of `Request`s with any model that follows the step
protocol of `jaxkv.models.Decoder`: `model(tokens, state, rows=rows)` takes
`int32[W]` step tokens and a `CacheState` whose step is prepared, and returns
`(logits float32[R, vocab], new_state)` for the step tokens in `rows`; the model
exposes its `cache_config`.

How a batch runs:

- **Admission** (host, between loop entries): a request gets a column with
  `jaxkv.pure.seq_new` when one is free and the shared capacity can hold its
  prompt plus its token limit (reserved up front, so no step is ever refused
  for room inside the loop). Flat rows are grown with `jaxkv.pure.grow` on the
  host before the loop when the admitted requests could need more.
- **The loop** (`decode_loop`, one `jax.jit`, the loop state donated): a
  `lax.while_loop` whose body packs every active sequence's pending tokens onto
  the static `W`-wide step axis (decode tokens first, then chunked prefill),
  runs declare → prepare → model → commit through `jaxkv.pure`, samples one
  token for every sequence whose last pending token was in the step (greedy,
  temperature, top-k, top-p, per-request seeds), and retires finished
  sequences with `jaxkv.pure.seq_rm`. It returns to the host only when a
  request finished, a parallel-sampling prompt is ready to fork, or
  `max_steps` steps ran.
- **Parallel sampling** (`n > 1`): the prompt but its last token is prefilled
  once, then `jaxkv.pure.seq_clone` forks it `n - 1` times; every sample then
  feeds the last prompt token itself and samples with its own key.

`ModelRunner` is the host-level companion for step-by-step work (speculative
decoding, DFlash blocks, tests): jitted declare/prepare/model/commit steps and
the sequence verbs, one call each.

Rooms: `requests` (what users hand in and get back), `sampling`, `loop` (the jitted
loop), `engine` (`Engine`), `runner` (`ModelRunner`), `memory` (sizing), `decoding`
(host-level feeding and greedy decoding over a `ModelRunner`).
"""

from jaxkv.serve.engine import Engine
from jaxkv.serve.loop import LoopState, decode_loop, init_loop_state
from jaxkv.serve.memory import bytes_in_use, check_engine_fits, loop_buffer_bytes, storage_bytes
from jaxkv.serve.requests import Completion, EngineStats, Request, SamplingParams, check_request
from jaxkv.serve.runner import ModelRunner
from jaxkv.serve.sampling import sample

__all__ = ["Completion", "Engine", "EngineStats", "LoopState", "ModelRunner", "Request",
           "SamplingParams", "bytes_in_use", "check_engine_fits", "check_request", "decode_loop",
           "init_loop_state", "loop_buffer_bytes", "sample", "storage_bytes"]
