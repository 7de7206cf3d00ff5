"""Serving on jaxkv: a continuous-batching engine whose decode loop is one `jax.jit`.

`Engine` serves a queue of `Request`s with any `StepModel` (`step_model.py`:
`model(tokens, state, rows=rows)` takes `int32[w]` step tokens and a `CacheState`
whose step is prepared, and returns `(logits float32[R, vocab], new_state)` for
the step tokens in `rows`; the model exposes `cache_config` and `vocab_size`).

How a queue runs (`Engine.run`): every request is checked, the queue is packed
into device arrays (`state.pack_queue`), flat rows are grown once for the
longest request, and one jitted call of `loop.serve_loop` (the loop state
donated) serves it all: admission (`jaxkv.pure.seq_new`, with the room of
prompt + token limit reserved so no step is refused inside the loop), parallel
sampling forks (`n > 1`: the prompt but its last token is prefilled once, then
`jaxkv.pure.seq_clone` forks it; every sample feeds the last prompt token
itself and samples with its own key), steps at a few compiled widths (a
decode-only step runs on one slot per column, prefill on `W` or a narrower
width, halving down to 512 rows, `default_widths`), sampling
(greedy, temperature, top-k, top-p, min_p, repetition/presence/frequency penalties, logprobs,
per-request seeds) and retirement
(`jaxkv.pure.seq_rm`). The host is visited once per `max_steps` steps.

The incremental API serves requests that come and go over one persistent
cache (`live.py`): `Engine.add_request`, `Engine.abort`, `Engine.step(k)` /
`Engine.stream(k)` (per-sample `Delta`s of new tokens with finish reasons,
every `k` steps), and `AsyncEngine` (`aio.py`) for asyncio; `jaxkv serve`
(`jaxkv.http`) puts an OpenAI-compatible HTTP server on top.

`ModelRunner` is the host-level companion for step-by-step work (speculative
decoding, DFlash blocks, tests): jitted declare/prepare/model/commit steps and
the sequence verbs, one call each.

Rooms: `requests` (what users hand in: `Request`, `SamplingParams`, the checks), `results`
(what they get back: `Completion`, `Delta`, `EngineStats`, ...), `step_model` (`StepModel`),
`sampling`, `state` (what the loop carries, the device queue), `loop` (the jitted loop), `columns`
(the per-column helpers both storages' admission share: admit, fork, column records),
`paged_claims` (claims, preemption and the prefix cache's page hashes over paged storage) and
`paged_admission` (the paged loop's admission, retirement and forks), `core` (`EngineCore`: the
one owner of the loop state and the programs over it), `engine` (`Engine`: composes the core
with its clients), `offline` (`Engine.run`'s client of the core), `parallel`
(`DataParallelEngine`: one engine per device), `live`, `live_records`, `live_read` and `live_ops` (the incremental API's driver:
its queue bookkeeping, request records, reading of an entry, jitted helpers), `aio`
(`AsyncEngine`), `timing` (compile time), `report` (which attention implementation serves each
layer, and why), `runner` (`ModelRunner`), `memory` (byte counts, engine size bounds),
`sizing` (`ServingPlan`: a checkpoint's cache sized from memory), `loading` (`load_for_serving`,
`build_engine`: the checkpoint-to-engine path of `jaxkv serve` and `LLM`), `decoding`
(host-level feeding and greedy decoding over a `ModelRunner`), `speculative`
(`SpeculativeConfig`, the on-device drafters and the acceptance rule of the loop's verify step).

The package exports what users call (`__all__`); the loop's internals (`serve_loop`,
`LoopState`, `pack_queue`, `sample_rows`, ...) are imported from their modules
(`jaxkv.serve.loop`, `jaxkv.serve.state`, `jaxkv.serve.sampling`, `jaxkv.serve.memory`).
"""

from jaxkv.serve.engine import Engine, default_widths
from jaxkv.serve.errors import EngineError
from jaxkv.serve.aio import AsyncEngine
from jaxkv.serve.parallel import DataParallelEngine
from jaxkv._memory import paged_cache_config
from jaxkv.serve.step_model import StepModel, check_step_model
from jaxkv.serve.requests import MAX_LOGPROBS, Request, SamplingParams, check_request
from jaxkv.serve.results import (Completion, Delta, EngineStats, RequestTiming, Speculation,
                                 TokenLogprob)
from jaxkv.serve.runner import ModelRunner
from jaxkv.serve.speculative import SpeculativeConfig

__all__ = ["MAX_LOGPROBS", "AsyncEngine", "Completion", "DataParallelEngine", "Delta", "Engine",
           "EngineError", "EngineStats", "ModelRunner", "Request", "RequestTiming",
           "SamplingParams", "Speculation", "SpeculativeConfig", "StepModel", "TokenLogprob", "check_request", "check_step_model",
           "default_widths", "paged_cache_config"]
