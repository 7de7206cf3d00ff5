"""Every maintained benchmark runs with `--small` and prints its result (benchmarks/README.md).

Each script runs in a subprocess on the CPU, as a user would start it, and must exit 0
and print the line that carries its result: a script that crashes, or that returns early
without measuring, fails here before a device call finds it. The benchmarks that time GPU
kernels (there is nothing to time on a CPU) run their `--small` on a GPU machine only.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# script, arguments, a regex the output must match (the result line), extra environment.
CPU_RUNS = {
    # Front processes (p2) after the in-process front: the engine is served by one host at a time.
    "serve.py": (["--small", "--rates", "inf,16", "--rate-requests", "6", "--raw-client",
                  "--server-configs", "16:fcfs:steps,16:fcfs:steps:100:2:p2"],
                 r"(?s)server i\d+-fcfs-steps rate inf .* tok/s .* failed 0 short 0.*"
                 r"rate 16 \(bare HTTP client\) .* tok/s .* failed 0 short 0.*"
                 r"server i16-fcfs-steps-p2 rate inf .* tok/s .* failed 0 short 0", {}),
    "structured.py": (["--small", "--skip", "half_mix,cold_compile"],
                      r'schema_vs_none \{.*"valid": 4, "requests": 4.*\n.*schema_set \{"schemas": 4, '
                      r'"served": 4, "valid": 4', {}),
    "dispatch.py": (["--small"], r"state packed into \d+ +params +\d+ state +\d+ busy threads \d: +\d+\.\d us per call", {}),
    "http_front.py": (["--streams", "8", "--tokens", "10", "--fronts", "auto"],
                      r"on \w+ +wall +\d+\.\d+ s +\d+ events/s .* us/event", {}),
    "e2e.py": (["--small"], r"speed-up jaxkv / baseline: \d+\.\d+x; first tokens agree", {}),
    "e2e.py mixed paged": (
        ["--small", "--workload", "mixed", "--paged", "16"],
        r"jaxkv paged \(page_size 16\): \d+\.\d+ s, \d+ steps, .* = \d+\.\d+x the columns", {}),
    "paged_step_ops.py": (
        ["--small"],
        r"pages of \d+ - columns, kernels per call \(outside loops\): \{'prepare_step'", {}),
    "paged_memory.py": (["--small"], r"\| mix: [^|]+\| paged \| \d+\.\d+ \| \d+\.\d+x \|", {}),
    "prefix_cache.py": (["--small"], r'"mean_in_flight": \d', {}),
    "speculative.py": (["--small", "--accepts", "1"],
                       r"\| oracle k=3 accept 1 \| \d+\.\d+ \| \d+ \| \d+\.\d+x \| .*\n"
                       r"\| plain \(random model\), repetitive prompts \| .*\n"
                       r"\| ngram k=3 \(random model\), repetitive prompts \| .*\n"
                       r".*tokens equal plain decoding", {}),
    "sharded.py": (["--small"], r"(?s)max \|2-GPU - 1-GPU\| = .*\| 2 \| \d+\.\d+ \| .*"
                   r"greedy tokens equal between 1 and 2 devices: \d+/\d+ .*\| 2 \| \d+\.\d+ \|",
                   {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}),
}
GPU_RUNS = {
    "decode.py": (["--small"], r"\| jaxkv default \| \d+\.\d+ \|"),
    "paged_decode.py": (["--small"], r"page 64 scattered\s+\d+\.\d+"),
    "gemm_options.py": (["--small"], r"us/GEMM"),
}
GPU_REASON = ("needs an NVIDIA Hopper GPU (the GPU check runs it): it times Mosaic GPU kernels against "
              "cuDNN or XLA; without one its --small "
              "runs the kernels under the Mosaic GPU interpreter for minutes, or finds no GPU "
              "kernels in its trace")
# Run only on the GPU, without --small: not this suite's (its owner keeps it GPU-only).
NOT_RUN = {"kernel_trace.py": "GPU device traces of the attention call against cuDNN; no --small",
           "startup.py": "starts `jaxkv serve` twice, compiling its serving programs from nothing "
                         "then from its cache: over a minute of CPU for a check of its timing "
                         "(run by hand with --small; the GPU run is its measurement)",
           "skinny_gemm.py": "a module gemm_options.py imports, not a script"}


def _run(args, env=None, timeout=600):
  environment = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                     PYTHONPATH=str(ROOT))
  environment.update(env or {})
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=environment, capture_output=True,
                        text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, (
      f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return proc.stdout


def test_every_benchmark_script_is_listed_here():
  scripts = {p.name for p in BENCHMARKS.glob("*.py")}
  listed = {name.split()[0] for name in [*CPU_RUNS, *GPU_RUNS, *NOT_RUN, "hlo_kernel_map.py",
                                         "profile_step.py"]}
  assert scripts == listed, (
      f"unlisted: {sorted(scripts - listed)}, gone: {sorted(listed - scripts)}")
  readme = (BENCHMARKS / "README.md").read_text()
  for script in scripts - {"skinny_gemm.py"}:
    assert f"`{script}`" in readme, f"benchmarks/README.md does not describe {script}"


@pytest.mark.parametrize("name", sorted(CPU_RUNS))
def test_small_run_prints_its_result(name):
  args, pattern, env = CPU_RUNS[name]
  out = _run([str(BENCHMARKS / name.split()[0]), *args], env)
  assert re.search(pattern, out), f"no result line /{pattern}/ in:\n{out[-3000:]}"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason=GPU_REASON)
@pytest.mark.parametrize("name", sorted(GPU_RUNS))
def test_gpu_small_run_prints_its_result(name):
  args, pattern = GPU_RUNS[name]
  # `_run` defaults the child to the CPU; these time GPU kernels, so the child gets the GPU.
  out = _run([str(BENCHMARKS / name), *args], env={"JAX_PLATFORMS": "cuda"})
  assert re.search(pattern, out), f"no result line /{pattern}/ in:\n{out[-3000:]}"


def test_profile_step_small_and_its_kernel_map(tmp_path):
  """`profile_step.py --small --dump-hlo`, then `hlo_kernel_map.py` over what it wrote.

  A CPU trace has no GPU kernels, so the kernel list handed to the map names three of the
  loop's own fusions (from its HLO): each must come back with the jaxkv source line that built
  it, as a GPU trace's kernels do.
  """
  out = _run([str(BENCHMARKS / "profile_step.py"), "--small", "--dump-hlo", "--out",
              str(tmp_path)])
  assert re.search(r"engine W=512, decode-heavy .*: \d+\.\d+ s, \d+ steps", out), out[-3000:]
  hlo_path = tmp_path / "loop_W512.hlo.txt"
  hlo = hlo_path.read_text()
  fusion = r"^\s*(?:ROOT )?%([\w.\-]+) = \S+ .*kind=k\w+.*stack_frame_id="
  names = [m[1] for m in re.finditer(fusion, hlo, re.M)][:3]
  assert len(names) == 3, "the dumped loop HLO has no fusions with stack frames"
  kernels = tmp_path / "kernels.txt"
  kernels.write_text("".join(f"1.00 0.002 {n.replace('.', '_')}\n" for n in names))
  mapped = _run([str(BENCHMARKS / "hlo_kernel_map.py"), str(hlo_path), str(kernels)])
  assert "listed: 3.0 launches per step, 6.0 us per step" in mapped, mapped
  rows = [line for line in mapped.splitlines() if "| " in line]
  assert len(rows) == 3 and all(re.search(r"\w+\.py:\d+\(\w+\)", row) for row in rows), mapped
