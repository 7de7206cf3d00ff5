"""jaxkv: a multi-sequence KV cache for LLM inference in JAX.

The cache state is an immutable pytree (`CacheState`); every verb exists as a
pure jittable function in `jaxkv.pure` and, for host code, as a method of
`BatchedSequenceCache`.
"""

__version__ = "0.1.0"

from jaxkv import pure
from jaxkv._config import CacheConfig, LayerConfig, LayerPolicy
from jaxkv._host import BatchedSequenceCache
from jaxkv._implementation import (KernelFallbackWarning, LayerImplementation,
                                   implementation_plan)
from jaxkv._state import CacheState, Phase, Status, Step, StepError, init_state

__all__ = [
    "__version__",
    "BatchedSequenceCache",
    "CacheConfig",
    "CacheState",
    "KernelFallbackWarning",
    "LayerConfig",
    "LayerImplementation",
    "LayerPolicy",
    "Phase",
    "Status",
    "Step",
    "StepError",
    "implementation_plan",
    "init_state",
    "pure",
]
