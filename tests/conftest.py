"""Fixtures only: the strict harness (dtype/rank promotion), the implementation and rng fixtures,
the skip of compiled-kernel variants the kernels refuse. Helpers live in oracle.py (float64
oracle, tolerances), model.py (bookkeeping model), drivers.py (jitted drivers) and the
*_utils modules."""

from __future__ import annotations

import os

# Four host devices so the sharding tests can build a mesh on a CPU machine; it
# must be set before JAX initialises its backends.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=4").strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import pytest

from drivers import KERNEL_IMPLEMENTATIONS  # pylint: disable=wrong-import-position
import scenario_utils  # pylint: disable=wrong-import-position

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
  # The scenario and reliability harnesses feed float32 probe content into float16
  # and bfloat16 caches on purpose. `attend` warns once per process and layer shape
  # about that, so as an error it would fail whichever test met a shape first;
  # tests/jaxkv/test_pure_traps.py checks the warning itself (pytest.warns records
  # it whatever this filter says).
  config.addinivalue_line("filterwarnings", "ignore::jaxkv.pure.KVDtypeWarning")


@pytest.fixture(params=KERNEL_IMPLEMENTATIONS)
def implementation(request):
  """Parametrizes a test over every implementation this machine can run."""
  return request.param


@pytest.fixture(params=["columns", "paged"])
def storage(request):
  """Runs a scenario with both storages: `scenario_utils.default_config` then builds
  column storage, or paged storage with `PAGED_PAGE_SIZE` (CONTRACT §3.1).

  Modules opt in with `pytestmark = pytest.mark.usefixtures("storage")`. Every
  implementation reads page tables: the interpreter serves any page size (its K/V
  tile shrinks to divide it), while the compiled kernels refuse page sizes that no
  K/V tile of theirs serves (neither a multiple of one nor a multiple of 8 dividing
  one; the hook below then skips that variant).
  """
  if request.param == "paged" and request.node.get_closest_marker("columns_only"):
    pytest.skip("inspects column storage; paged storage has its own tests (test_paged.py)")
  previous = scenario_utils.PAGE_SIZE
  scenario_utils.PAGE_SIZE = scenario_utils.PAGED_PAGE_SIZE if request.param == "paged" else None
  yield request.param
  scenario_utils.PAGE_SIZE = previous


@pytest.fixture
def rng():
  """A seeded NumPy generator; tests derive further seeds from it, never from time."""
  return np.random.default_rng(int(os.environ.get("JAXKV_TEST_SEED", "0")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  """A compiled-kernel variant the kernels cannot serve is skipped, with the kernel's reason.

  CONTRACT §10.7: an explicit `implementation="mosaic_gpu"` re-raises the kernel's
  NotImplementedError (e.g. CONTRACT §11's head_dim 8, float32 storage). The same
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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module.

  A long xdist worker otherwise keeps every module's executables alive; on the
  2-core, 24 GiB CI machine one such worker crashed inside XLA's compiler late in
  the run (segmentation fault while compiling). Modules share few programs, so
  little is recompiled.
  """
  yield
  jax.clear_caches()
