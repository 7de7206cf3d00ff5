"""Fixtures only: the strict harness (dtype/rank promotion), the implementation and rng fixtures,
the skip of compiled-kernel variants the kernels refuse, the hypothesis profiles. Helpers live in
oracle.py (float64 oracle, tolerances), model.py (bookkeeping model), drivers.py (jitted drivers)
and the *_utils modules.

Property tests run under one of two hypothesis profiles (tests/README.md):
- "ci" (the default): derandomized, so CI replays the same examples every run; one bug is
  reported, and shrinking stops after SHRINK_SECONDS, so a failure reports within a minute.
- "random" (JAXKV_HYPOTHESIS_RANDOM=1): fresh examples from one seed per run, printed in the
  header and summary; `--hypothesis-seed=N` (or JAXKV_HYPOTHESIS_SEED=N) replays a run.

JAXKV_GPU_CHECK=1 (benchmarks/gpu_checks.sh) collects only the GPU-gated tests and fails every
skip tests/gpu_expected_skips.txt does not explain, so a kernel that wrongly refuses fails there.
"""

from __future__ import annotations

import os
import re

# Four host devices so the sharding tests can build a mesh on a CPU machine; it
# must be set before JAX initialises its backends.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=4").strip()

GPU_CHECK = os.environ.get("JAXKV_GPU_CHECK") == "1"

# Workers, modules (each ends with jax.clear_caches) and the processes tests start compile many
# of the same programs: one persistent cache per run, set before jax reads the environment so
# all of them share it (tests/README.md "Suite time"). Unbounded, since a bound turns on jax's
# lock, which rescans the directory per write; an entry read half-written fails its checksum and
# jax compiles instead (pyproject lets that warning pass). The GPU check runs without it, as on
# the H200. JAXKV_TEST_XLA_CACHE=0 turns it off; an explicit JAX_COMPILATION_CACHE_DIR is kept.
if (os.environ.get("JAXKV_TEST_XLA_CACHE", "1") != "0" and not GPU_CHECK
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
  import atexit  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxkv-tests-xla-cache-")
  # Whichever process made it (the xdist controller, or pytest alone) removes it at exit.
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  # Only compiles that cost more than reading an entry back are worth a file.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# Most of the CPU suite is XLA compiling programs that then run for milliseconds: LLVM's
# optimisation passes cost more than they save (tests/README.md "Suite time" has the
# measurement). Set before jax reads it, so the processes tests start inherit it too; the GPU
# check and JAXKV_TEST_FAST_COMPILE=0 compile as users do.
if os.environ.get("JAXKV_TEST_FAST_COMPILE", "1") != "0" and not GPU_CHECK:
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

from hypothesis import settings  # pylint: disable=wrong-import-position
import hypothesis.internal.conjecture.engine as hypothesis_engine  # pylint: disable=wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import pytest

from drivers import KERNEL_IMPLEMENTATIONS  # pylint: disable=wrong-import-position
import scenario_utils  # pylint: disable=wrong-import-position

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Shrinking a stateful JAX example reruns it hundreds of times: without a bound a failure
# seen in seconds showed nothing for minutes. Hypothesis reads this module constant when
# shrinking starts (it has no setting for it); the test fails with the smallest example so far.
SHRINK_SECONDS = 30
assert hasattr(hypothesis_engine, "MAX_SHRINKING_SECONDS"), "hypothesis moved its shrink budget"
hypothesis_engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS
# The reliability tests' older switch selects the random profile too.
RANDOM = "1" in (os.environ.get("JAXKV_HYPOTHESIS_RANDOM"), os.environ.get("JAXKV_RELIABILITY_RANDOM"))
settings.register_profile("ci", derandomize=True, database=None, report_multiple_bugs=False,
                          print_blob=True)
settings.register_profile("random", derandomize=False, database=None, report_multiple_bugs=False,
                          print_blob=True)
settings.load_profile("random" if RANDOM else "ci")


def _hypothesis_seed(config) -> int | None:
  """The random profile's seed: the option's, else JAXKV_HYPOTHESIS_SEED, else a fresh one.

  A fresh seed is put in the environment so xdist workers (started after this) share it.
  """
  if not RANDOM:
    return None
  option = config.getoption("hypothesis_seed", None)
  if option is not None:
    return int(option)
  if "JAXKV_HYPOTHESIS_SEED" not in os.environ:
    os.environ["JAXKV_HYPOTHESIS_SEED"] = str(int.from_bytes(os.urandom(4), "little"))
  return int(os.environ["JAXKV_HYPOTHESIS_SEED"])


def pytest_report_header(config):
  seed = _hypothesis_seed(config)
  if seed is not None:
    return f"jaxkv hypothesis profile 'random', seed {seed} (replay: --hypothesis-seed={seed})"
  return None


def pytest_terminal_summary(terminalreporter, config):
  seed = _hypothesis_seed(config)
  if seed is not None:
    terminalreporter.write_line(f"hypothesis seed {seed} (replay: --hypothesis-seed={seed})")
  for line in _FILE_TIME_LINES:
    terminalreporter.write_line(line)


# Worker time per test file (setup, call and teardown), summed where the reports arrive: the
# xdist controller, or pytest alone. A full run fails if one file takes more than HEAVY_SHARE of
# it without a line in HEAVY_FILES saying why (tests/README.md "Suite time").
HEAVY_SHARE = 0.05
FULL_RUN_TESTS = 1000   # fewer tests than this: a subset, whose shares mean nothing
HEAVY_FILES: dict[str, str] = {   # shares of a full local run, 2026-12-06
    "tests/reliability/test_engine_property.py":
        "8.5%: the engine's state-machine property test compiles each example's geometry "
        "(issue 56 item 2 draws them from fixed geometries)",
    "tests/pallas_kernels/test_varlen_attention.py":
        "6.7%: the Mosaic GPU kernels run under the interpreter on the CPU, for every GQA "
        "group, head dim and layout the kernels serve",
    "tests/benchmarks/test_benchmarks_small.py":
        "5.4%: every maintained benchmark runs as a subprocess, importing jax and compiling "
        "its own programs, as a user would start it",
    "tests/examples/test_llm.py":
        "5.1% (2026-12-07, a run sharing the CPU): three LLMs built from checkpoints, each compiling "
        "its loop variants: the module's, the persistent-cache subprocess, and the README's quick "
        "start run verbatim at its default sizes",
    "tests/jaxkv/test_spans.py":
        "3.5-6.4% (2026-12-07): CONTRACT section 11's scenarios under every implementation, both "
        "drivers and both storages; the Mosaic GPU interpreter compiles each scenario's step "
        "shapes (engine tests, whose programs engines now share, left it a larger share)",
    "tests/jaxkv/test_live.py":
        "4.8%: the incremental API's schedules (aborts, failures, counters wrapping, a reader "
        "behind) each build an engine and compile its loop",
}
_FILE_SECONDS: dict[str, float] = {}
_FILE_TESTS: dict[str, set] = {}
_FILE_TIME_LINES: list[str] = []


def pytest_runtest_logreport(report):
  path = report.nodeid.split("::")[0]
  _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
  _FILE_TESTS.setdefault(path, set()).add(report.nodeid)


def heavy_files(seconds: dict[str, float], allowed: dict[str, str], *, share: float = HEAVY_SHARE,
                ) -> list[tuple[str, float]]:
  """`(file, its share)` of each file past `share` of the summed `seconds`, not in `allowed`."""
  total = sum(seconds.values())
  return [(f, s / total) for f, s in sorted(seconds.items(), key=lambda x: -x[1])
          if total > 0 and s / total > share and f not in allowed]


def pytest_sessionfinish(session, exitstatus):
  if hasattr(session.config, "workerinput") or not _FILE_SECONDS:   # an xdist worker
    return
  total = sum(_FILE_SECONDS.values())
  folders: dict[str, float] = {}
  for path, seconds in _FILE_SECONDS.items():
    folder = os.path.dirname(path)
    folders[folder] = folders.get(folder, 0.0) + seconds
  _FILE_TIME_LINES.append(f"worker time {total:.0f} s by folder: " + ", ".join(
      f"{folder} {seconds:.0f} s" for folder, seconds in sorted(folders.items(),
                                                                key=lambda x: -x[1])))
  top = sorted(_FILE_SECONDS.items(), key=lambda x: -x[1])[:8]
  _FILE_TIME_LINES.append("largest files: " + ", ".join(
      f"{path} {100 * seconds / total:.1f}%" for path, seconds in top))
  if sum(map(len, _FILE_TESTS.values())) < FULL_RUN_TESTS:
    return
  over = heavy_files(_FILE_SECONDS, HEAVY_FILES)
  if over:
    _FILE_TIME_LINES.append(
        "FAILED suite time: " + ", ".join(f"{f} takes {100 * share:.1f}%" for f, share in over)
        + f" of the worker time (more than {100 * HEAVY_SHARE:.0f}%): make it cheaper, or name "
        "it in tests/conftest.py HEAVY_FILES with the reason")
    if exitstatus == 0:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
  seed = _hypothesis_seed(config)
  if seed is not None:
    from hypothesis import core  # pylint: disable=g-import-not-at-top
    core.global_force_seed = seed   # what --hypothesis-seed sets (one pytest_configure: a second
    # definition in this module would replace this one)
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


def pytest_generate_tests(metafunc):
  """Parametrizes the `storage` fixture: both storages, or columns only for `columns_only` tests.

  A `columns_only` test gets no paged variant at all (rather than one that always skips);
  paged storage has its own tests (test_paged.py).
  """
  if "storage" in metafunc.fixturenames:
    columns_only = metafunc.definition.get_closest_marker("columns_only") is not None
    metafunc.parametrize("storage", ["columns"] if columns_only else ["columns", "paged"],
                         indirect=True)


@pytest.fixture
def storage(request):
  """Runs a scenario with both storages: `scenario_utils.default_config` then builds
  column storage, or paged storage with `PAGED_PAGE_SIZE` (CONTRACT §3.1).

  Modules opt in with `pytestmark = pytest.mark.usefixtures("storage")`. Every
  implementation reads page tables: the interpreter serves any page size (its K/V
  tile shrinks to divide it), while the compiled kernels refuse page sizes that no
  K/V tile of theirs serves (neither a multiple of one nor a multiple of 8 dividing
  one; the hook below then skips that variant).
  """
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
  Under JAXKV_GPU_CHECK=1 the skip says so in its reason (`KERNEL_REFUSAL`), and the GPU
  check fails on every such skip not listed in tests/gpu_expected_skips.txt.
  """
  outcome = yield
  callspec = getattr(item, "callspec", None)
  if callspec is None or callspec.params.get("implementation") != "mosaic_gpu":
    return
  error = outcome.excinfo[1] if outcome.excinfo else None
  if isinstance(error, NotImplementedError):
    outcome.force_exception(pytest.skip.Exception(
        f"{KERNEL_REFUSAL}: {error}", _use_item_location=True))


KERNEL_REFUSAL = "the compiled Mosaic GPU kernel does not serve this configuration"
EXPECTED_SKIPS = os.path.join(os.path.dirname(__file__), "gpu_expected_skips.txt")


def expected_gpu_skips() -> list[tuple[re.Pattern, str]]:
  """`(reason regex, why)` per entry of tests/gpu_expected_skips.txt."""
  with open(EXPECTED_SKIPS, encoding="utf-8") as f:
    lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
  return [(re.compile(pattern.strip()), why.strip())
          for pattern, why in (line.split(" | ", 1) for line in lines)]


# Whole modules the GPU check runs: device-count meshes, the GEMM and implementation choice
# (Hopper or not), the small-page lowering, and the live transformers oracle (torch on that host).
GPU_MODULES = {"test_sharding.py", "test_sharded_models.py", "test_data_parallel.py",
               "test_hf_sharded_load.py", "test_gemm.py", "test_implementation_plan.py",
               "test_paged_small_pages.py", "test_donation.py"}


def _gpu_gated(item) -> bool:
  """Whether `item` runs differently on a Hopper host than on CPU (what the GPU check runs)."""
  callspec = getattr(item, "callspec", None)
  if callspec is not None and "mosaic_gpu" in map(str, callspec.params.values()):
    return True
  # Skips for want of a Hopper GPU, torch or transformers: what the GPU check's host has.
  if any(word in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")
         for word in ("Hopper", "torch", "transformers")):
    return True
  return item.path.name in GPU_MODULES


# The property tests' CI budgets take minutes on a loaded 2-core machine: twice the ini limit,
# unless --timeout is given (long runs with larger budgets pass --timeout 0).
PROPERTY_TESTS = {"test_facade_matches_model", "test_pure_verbs_match_model",
                  "test_every_completion_equals_its_request_alone",
                  "test_facade_agrees_with_model"}


# Modules whose tests take minutes each (subprocess benchmark runs, property tests). They run
# first: at the end of the run one of them would keep a worker busy while the other idles.
LONG_MODULES = ("test_benchmarks_small.py", "test_engine_property.py", "test_stateful.py")


def pytest_collection_modifyitems(config, items):
  """Long modules first, longer limits for the property tests; under JAXKV_GPU_CHECK=1 only
  the GPU-gated tests run."""
  items.sort(key=lambda item: item.path.name not in LONG_MODULES)   # stable: order kept within
  if config.getoption("timeout", None) is None:
    for item in items:
      if getattr(item, "originalname", item.name) in PROPERTY_TESTS:
        item.add_marker(pytest.mark.timeout(1800))
  if not GPU_CHECK:
    return
  keep = [item for item in items if _gpu_gated(item)]
  config.hook.pytest_deselected(items=[item for item in items if not _gpu_gated(item)])
  items[:] = keep


def _host_lacks_devices(reason: str) -> bool:
  """A mesh test's skip is expected only where this host really has fewer devices than it needs."""
  needed = re.search(r"needs (\d+) devices", reason)
  return needed is not None and int(needed.group(1)) > len(jax.devices())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Under JAXKV_GPU_CHECK=1 a skip no entry of gpu_expected_skips.txt explains fails."""
  outcome = yield
  report = outcome.get_result()
  if not GPU_CHECK or not report.skipped or hasattr(report, "wasxfail"):
    return
  reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
  if _host_lacks_devices(reason):
    return
  if not any(pattern.search(reason) for pattern, _ in expected_gpu_skips()):
    report.outcome = "failed"
    report.longrepr = (f"unexpected skip on the GPU check (not in "
                       f"tests/gpu_expected_skips.txt): {reason}")


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
