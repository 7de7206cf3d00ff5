"""The engine's failure report, shared by its fronts (`Engine.run`, the incremental API)."""

from __future__ import annotations

from jaxkv.serve.results import Completion


class EngineError(RuntimeError):
  """`Engine.run` failed; `completions` holds every sample finished before the failure."""

  def __init__(self, message: str, completions: list[Completion]):
    super().__init__(message)
    self.completions = completions
