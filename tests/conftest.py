"""Strict harness shared by every test: dtype/rank promotion, tolerances, seeds."""

from __future__ import annotations

import os

# Four host devices so the sharding tests can build a mesh on a CPU machine; it
# must be set before JAX initialises its backends.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=4").strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Absolute tolerances against float32/float64 oracles, keyed by storage dtype.
# 16-bit storage rounds every K/V to 3 or fewer significant digits (SPEC §11: 1e-2);
# float32 differs from a float64 oracle only by accumulation order.
TOLS = {
    np.dtype(jnp.float32): 1e-5,
    np.dtype(jnp.float16): 1e-2,
    np.dtype(jnp.bfloat16): 1e-2,
}


def tol(dtype) -> float:
  """Tolerance for results computed over K/V stored as `dtype`."""
  return TOLS[np.dtype(dtype)]


def has_hopper_gpu() -> bool:
  """True on an NVIDIA GPU of compute capability >= 9.0."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return False
  return any(float(getattr(d, "compute_capability", "0")) >= 9.0 for d in devices)


# Implementations every kernel-backed scenario runs with: the reference always,
# the Mosaic GPU interpreter on CPU, the compiled kernels on a Hopper GPU.
KERNEL_IMPLEMENTATIONS = ["reference", "interpret"] + (
    ["mosaic_gpu"] if has_hopper_gpu() else [])


@pytest.fixture(params=KERNEL_IMPLEMENTATIONS)
def implementation(request):
  """Parametrizes a test over every implementation this machine can run."""
  return request.param


@pytest.fixture
def rng():
  """A seeded NumPy generator; tests derive further seeds from it, never from time."""
  return np.random.default_rng(int(os.environ.get("JAXKV_TEST_SEED", "0")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  """A compiled-kernel variant the kernels cannot serve is skipped, with the kernel's reason.

  SPEC §10.7: an explicit `implementation="mosaic_gpu"` re-raises the kernel's
  NotImplementedError (e.g. SPEC §11's head_dim 8, float32 storage). The same
  scenario still runs with "reference" and "interpret"; any other error fails.
  """
  outcome = yield
  callspec = getattr(item, "callspec", None)
  if callspec is None or callspec.params.get("implementation") != "mosaic_gpu":
    return
  error = outcome.excinfo[1] if outcome.excinfo else None
  if isinstance(error, NotImplementedError):
    outcome.force_exception(pytest.skip.Exception(
        f"the compiled Mosaic GPU kernel does not serve this configuration: {error}",
        _use_item_location=True))
