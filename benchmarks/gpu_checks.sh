#!/usr/bin/env bash
# One batched GPU session (a 2-GPU H200 host): the compiled kernel tests, the
# sharded decode and model benchmarks (1 vs 2 GPUs) and the end-to-end engine
# benchmark, each time-boxed so the whole run fits one device call. Logs go to
# $OUT (or ./gpu_logs). Usage: bash benchmarks/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name (<= ${secs}s)"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"
  tail -n 14 "$out/$name.log"
}
run kernels 170 python3 -m pytest tests/pallas_kernels -q -x -p no:cacheprovider -k "compiled or mosaic_gpu"
run sharded_decode 80 python3 benchmarks/sharded.py --devices 2
run e2e 150 python3 benchmarks/e2e.py --out "$out/e2e.json"
run sharded_model 110 python3 benchmarks/sharded.py --devices 2 --model
