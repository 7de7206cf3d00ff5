#!/usr/bin/env bash
# GPU checks on a Hopper host (one GPU or more: with one, the 2-device mesh tests skip), each stage
# time-boxed to fit one device call (`all` needs two). Logs go to $OUT (or ./gpu_logs).
# Usage: bash benchmarks/gpu_checks.sh [tests|bench|all]
#   tests: every GPU-gated test (compiled-kernel variants, Hopper-only tests, device meshes, the
#          live transformers oracle) under JAXKV_GPU_CHECK=1, which fails on any skip
#          tests/gpu_expected_skips.txt does not explain, a kernel refusal included.
#   bench: the sharded decode and model benchmarks (1 vs 2 GPUs) and the end-to-end engine one.
# Exits non-zero when the tests stage fails; the benchmarks only log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
stage="${1:-all}"
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
status=0
run() {  # run NAME SECONDS CMD...: the command's exit status is kept
  local name=$1 secs=$2 rc; shift 2
  echo "=== $name (<= ${secs}s)"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1; rc=$?
  echo "rc=$rc" >> "$out/$name.log"
  grep -E "^(\[gw[0-9]+\] \[ *[0-9]+%\] )?(FAILED|ERROR)" "$out/$name.log" | head -20
  tail -n 14 "$out/$name.log"
  return $rc
}
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  python3 -c "import torch, transformers" 2>/dev/null \
    || echo "note: no torch/transformers here; the live transformers tests will fail as unexpected skips"
  # The tests are compile-bound: several workers, none preallocating most of the GPU's memory.
  # -v names each result as it lands: a run cut by the time box still names its failures.
  JAXKV_GPU_CHECK=1 XLA_PYTHON_CLIENT_PREALLOCATE=false run gated_tests "${GPU_CHECK_SECONDS:-540}" \
      python3 -m pytest tests -v -n "${GPU_CHECK_WORKERS:-4}" -p no:cacheprovider -p no:benchmark -rs \
      --timeout 300 --junitxml "$out/gated_tests.xml" || status=1
fi
if [ "$stage" = bench ] || [ "$stage" = all ]; then
  run sharded_decode 80 python3 benchmarks/sharded.py --devices 2
  run e2e 150 python3 benchmarks/e2e.py --out "$out/e2e.json"
  run sharded_model 110 python3 benchmarks/sharded.py --devices 2 --model
fi
exit $status
