"""The one module that imports the Mosaic GPU interpreter, whose home moves.

jax 0.12 exports `plgpu.InterpretGPUParams`; jax 0.11.2 keeps it in
`jax._src.pallas.mosaic_gpu.interpret.params` (CONTRACT §10.7). Everything else in
jaxkv asks this module for interpreter parameters, and tests call
`reset_interpreter` after an expected exception, as the interpreter requires
before it can run again in the same process.
"""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import mosaic_gpu as plgpu

try:
  InterpretGPUParams = plgpu.InterpretGPUParams
except AttributeError:   # jax 0.11.x
  from jax._src.pallas.mosaic_gpu.interpret.params import (  # pylint: disable=g-import-not-at-top
      InterpretGPUParams)

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _interpret  # pylint: disable=g-import-not-at-top,g-bad-import-order


def interpret_params(*, detect_races: bool = True) -> InterpretGPUParams:
  """Strict interpreter parameters: races raise, OOB reads raise, fresh memory is NaN.

  Args:
    detect_races: run the happens-before race detector (raises on a race).
  """
  wanted = dict(detect_races=detect_races, on_race="raise", out_of_bounds_reads="raise",
                uninitialized_memory="nan")
  # jax 0.11.2's private params have no `on_race` (seen on the H200 machine): pass what exists.
  known = {f.name for f in dataclasses.fields(InterpretGPUParams)}
  return InterpretGPUParams(**{k: v for k, v in wanted.items() if k in known})


def resolve_interpret(interpret):
  """Maps the kernels' `interpret` argument to what `plgpu.kernel` takes.

  `False`/`None` compile for the GPU; `True` uses `interpret_params()`; an
  `InterpretGPUParams` instance is passed through.
  """
  if interpret is None or interpret is False:
    return None
  if interpret is True:
    return interpret_params()
  if isinstance(interpret, InterpretGPUParams):
    return interpret
  raise ValueError(f"{interpret=} must be a bool or InterpretGPUParams")


def reset_interpreter() -> None:
  """Clears the interpreter's global state after an exception inside a kernel."""
  _interpret.reset_gpu_interpret_mode_state()
