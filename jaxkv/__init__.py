"""jaxkv: a multi-sequence KV cache for LLM inference in JAX.

The cache state is an immutable pytree (`CacheState`); every verb exists as a
pure jittable function in `jaxkv.pure` and, for host code, as a method of
`BatchedSequenceCache`.

`jaxkv.LLM` (text in, text out from a checkpoint, `jaxkv.llm`) and
`jaxkv.SamplingParams` (its parameters, spelled as vLLM's, with `jaxkv.StructuredOutputs`)
are imported on first use, so
`import jaxkv` does not load the models or the serving engine.
"""

__version__ = "0.1.0"

from jaxkv import pure
from jaxkv._config import CacheConfig, LayerConfig, LayerPolicy
from jaxkv._host import BatchedSequenceCache
from jaxkv._implementation import (KernelFallbackWarning, LayerImplementation,
                                   implementation_plan)
from jaxkv._state import CacheState, Phase, Status, Step, StepError, init_state

_LAZY = {"LLM": "jaxkv.llm", "SamplingParams": "jaxkv.llm",
         "StructuredOutputs": "jaxkv.structured.automaton"}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib   # pylint: disable=g-import-not-at-top
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


__all__ = [
    "__version__",
    "BatchedSequenceCache",
    "CacheConfig",
    "CacheState",
    "KernelFallbackWarning",
    "LLM",
    "LayerConfig",
    "LayerImplementation",
    "LayerPolicy",
    "Phase",
    "SamplingParams",
    "Status",
    "Step",
    "StepError",
    "StructuredOutputs",
    "implementation_plan",
    "init_state",
    "pure",
]
