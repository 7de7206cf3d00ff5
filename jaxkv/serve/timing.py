"""Compile time apart from serving time: a `jax.monitoring` listener, per thread.

JAX reports the tracing, lowering and backend-compile durations of every jit
compilation to `jax.monitoring` listeners, in the thread that compiles. One
listener (registered once, at import) adds them to a per-thread total, so an
engine measures the compilation inside one loop entry as
`compile_seconds()` after minus before, even while other threads compile.
"""

from __future__ import annotations

import threading

from jax import monitoring

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")
_local = threading.local()


def _listener(event: str, seconds: float, **_) -> None:
  if event in _EVENTS:
    _local.total = getattr(_local, "total", 0.0) + seconds


monitoring.register_event_duration_secs_listener(_listener)


def compile_seconds() -> float:
  """Seconds this thread has spent tracing, lowering and compiling jitted functions."""
  return getattr(_local, "total", 0.0)
