#!/usr/bin/env bash
# The GPU measurements behind docs/PERFORMANCE.md's current numbers, one entry each (the entry
# names are the topics' "reproduce" commands). Logs and JSON go to $OUT (or ./gpu_logs).
# Usage (GPU machine, repository root): bash benchmarks/gpu_serving.sh ENTRY [ENTRY...]
# Entries marked x2 need two GPUs of one host.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name (<= ${secs}s)"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1; echo "rc=$?" >> "$out/$name.log"
  grep -v "^[WI][0-9]\{4\} " "$out/$name.log" | tail -n "${TAIL:-8}"
}
issue_cases="decode 64 seqs 32/8 D128 512..8192,decode 256 seqs 32/8 D128 128..2048,decode 64 seqs 32/8 D64 8..272,decode 64 seqs 32/8 D64 128..2304,decode 256 seqs 32/8 D64 128..2048,decode 64 seqs 32/32 D80 512..4096,mixed 8x512 over 2048 + 56 decodes 32/8 D128,prefill 4x4096 32/8 D128,prefill 1x16384 32/8 D128,prefill 1x2048 32/8 D64,decode 16 seqs 16/16 D64 1024..32768"
ring_cases="decode 64 seqs 32/8 D128 ring 1024 rows 1087,decode 64 seqs 32/8 D64 ring 512 rows 575,decode 64 seqs 16/8 D256 ring 1024 rows 1087"
for w in "$@"; do
  case $w in
    # Kernels against cuDNN (GPU time per call from a device trace).
    kernels_vs_cudnn) TAIL=60 run kernels_vs_cudnn 300 python3 benchmarks/kernel_trace.py --calls 10 --cases "$issue_cases";;
    kernel_head_layouts) TAIL=60 run kernel_head_layouts 300 python3 benchmarks/kernel_trace.py --calls 10 --cases layouts;;
    kernel_rings_in_place) TAIL=30 run kernel_rings_in_place 240 python3 benchmarks/kernel_trace.py --calls 10 --cases "$ring_cases";;
    kernels_host_timed) TAIL=30 run kernels_host_timed 300 python3 benchmarks/decode.py --quick --out "$out/kernels_host_timed.json";;
    decode_gemm_vs_xla) TAIL=30 run decode_gemm_vs_xla 400 python3 benchmarks/gemm_options.py --rows 64,100,128 --mgpu-entry --default-only --shapes o,down;;
    # The engine against the padded cuDNN loop and static batching, with the roofline.
    e2e_decode) run e2e_decode 200 python3 benchmarks/e2e.py --workload decode --out "$out/e2e_decode.json";;
    e2e_uniform) run e2e_uniform 300 python3 benchmarks/e2e.py --workload uniform --max-write 4096 --out "$out/e2e_uniform.json";;
    e2e_mixed) run e2e_mixed 330 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --out "$out/e2e_mixed.json";;
    decode_step_profile) TAIL=60 run decode_step_profile_64 200 python3 benchmarks/profile_step.py --decode-only --padded --out "$out/r64"
        TAIL=60 run decode_step_profile_128 240 python3 benchmarks/profile_step.py --decode-only --padded --requests 128 --out "$out/r128";;
    decode_step_kernel_map) run decode_step_trace 200 python3 benchmarks/profile_step.py --decode-only --dump-hlo --out "$out"
        TAIL=130 run decode_step_kernel_map 60 python3 benchmarks/hlo_kernel_map.py "$out/loop_W512.hlo.txt" "$out/kernels_engine_W512_decode.txt" --frames 5;;
    # The server under load: jaxkv serve's default engine beside the offline anchors (needs fastapi,
    # uvicorn and openai: on a machine without them, carry their wheels in .wheels/; benchmarks/README.md).
    serve_default) [ -d .wheels ] && python3 -m pip install -q --no-deps .wheels/*.whl
        TAIL=40 run serve_default 570 python3 benchmarks/serve.py --write-checkpoint /tmp/ck --rates inf,4,16,64 --rate-requests 96 --server-configs 16:fcfs:steps,16:fcfs:entries --trace /tmp/serve_trace --out "$out/serve_default.json" --png "$out/serve_default.png";;
    # The driver's interpreter-lock waits (switch interval, steps queued ahead) and the HTTP front
    # (uvloop+httptools or asyncio+h11), on one engine.
    serve_switch) [ -d .wheels ] && python3 -m pip install -q --no-deps .wheels/*.whl
        TAIL=6 JAX_PLATFORMS=cpu run http_front 90 python3 benchmarks/http_front.py --streams 256 --tokens 300 --fronts auto,asyncio,auto,asyncio --out "$out/http_front.json"
        TAIL=60 run serve_switch 480 python3 benchmarks/serve.py --write-checkpoint /tmp/ck --rates inf --server-configs 16:fcfs:steps:500:2:asyncio,16:fcfs:steps,16:fcfs:steps:100,16:fcfs:steps:100:3,16:fcfs:steps:50:3,16:fcfs:entries:500:2:asyncio,16:fcfs:entries,16:fcfs:entries:100 --out "$out/serve_switch.json";;
    # The defaults (stepping, in-process front) against 2 and 4 front processes and loop entries.
    serve_fronts) [ -d .wheels ] && python3 -m pip install -q --no-deps .wheels/*.whl
        TAIL=10 run dispatch 60 python3 benchmarks/dispatch.py --out "$out/dispatch.json"
        TAIL=60 run serve_fronts 500 python3 benchmarks/serve.py --write-checkpoint /tmp/ck --rates inf,4 --rate-requests 48 --skip-best --raw-client --server-configs 16:fcfs:steps,16:fcfs:steps:100:2:p2,16:fcfs:steps:100:2:p4 --out "$out/serve_fronts.json";;
    # Sampled traffic (temperature 1, OpenAI's default): stepping with the branch-free draw against loop entries.
    serve_sampled) [ -d .wheels ] && python3 -m pip install -q --no-deps .wheels/*.whl
        TAIL=40 run serve_sampled 570 python3 benchmarks/serve.py --write-checkpoint /tmp/ck --rates inf,4 --rate-requests 48 --skip-best --raw-client --temperature 1.0 --server-configs 16:fcfs:steps,16:fcfs:entries --out "$out/serve_sampled.json";;
    # jaxkv serve's start, cold and warm compilation cache, by program (issue 56's start targets).
    startup) [ -d .wheels ] && python3 -m pip install -q --no-deps .wheels/*.whl
        TAIL=40 run startup 400 python3 benchmarks/startup.py --write-checkpoint /tmp/ck --out "$out/startup.json";;
    # Structured output through jaxkv serve's defaults (issue 52's targets).
    structured) [ -d .wheels ] && python3 -m pip install -q --no-deps .wheels/*.whl
        TAIL=12 run structured 560 python3 benchmarks/structured.py --write-checkpoint /tmp/ck_structured --server-flags "--grammar-compile-timeout 30" --out "$out/structured.json";;
    # Speculative decoding (issue 54): the oracle drafter against acceptance, the pause on and off, n-gram.
    speculative) TAIL=30 run speculative 500 python3 benchmarks/speculative.py --seqs 16,64 --ks 4 --accepts 0,0.8,1 --max-pauses 64,0 --repeats 2 --out "$out/speculative.json";;
    # Paged storage.
    paged_decode_kernel) TAIL=60 run paged_decode_kernel 300 python3 benchmarks/paged_decode.py --page-sizes 16,32,64,128 --out "$out/paged_decode_kernel.json";;
    paged_mix_equal_slots) run paged_mix_equal_slots 540 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --paged 128 --paged-repeats 5 --out "$out/paged_mix_equal_slots.json";;
    paged32_mix_equal_slots) run paged32_mix_equal_slots 400 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --paged 32 --paged-repeats 5 --out "$out/paged32_mix_equal_slots.json";;
    paged_mix_same_memory) run paged_mix_same_memory 420 python3 benchmarks/e2e.py --workload mixed --mixed-requests 1024 --max-write 2048 --skip-baseline --paged 128 --paged-slots 128 --out "$out/paged_mix_same_memory.json";;
    paged_step_kernel_map) TAIL=30 run paged_step_trace 300 python3 benchmarks/profile_step.py --decode-only --page-size 128 --dump-hlo --out "$out"
        TAIL=150 run paged_step_kernel_map 60 python3 benchmarks/hlo_kernel_map.py "$out/loop_paged128_W512.hlo.txt" "$out/kernels_paged128_W512_decode.txt" --frames 5;;
    # Several GPUs of one host (x2).
    sharded_decode) run sharded_decode 120 python3 benchmarks/sharded.py --devices 2;;
    tensor_parallel_8b) run tensor_parallel_8b 480 python3 benchmarks/sharded.py --model --devices 2 --model-layers 32 --model-hidden 4096 --model-heads 32 --model-kv-heads 8 --model-head-dim 128 --model-intermediate 14336 --model-vocab 128256 --no-mesh-row;;
    data_parallel_mix) run data_parallel_mix 250 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --data-parallel 2 --out "$out/data_parallel_mix.json";;
    data_parallel_mix_1k) run data_parallel_mix_1k 420 python3 benchmarks/e2e.py --workload mixed --mixed-requests 1024 --max-write 2048 --skip-baseline --data-parallel 2 --out "$out/data_parallel_mix_1k.json";;
    *) echo "unknown entry: $w (see the case list in $0)"; exit 2;;
  esac
done
