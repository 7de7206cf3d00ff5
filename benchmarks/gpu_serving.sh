#!/usr/bin/env bash
# One GPU call for the serving issue: e2e workloads (decode-only, uniform, mixed) with the
# roofline, and the decode workload again with XLA command buffers extended to WHILE and
# CONDITIONAL (CUDA graphs across the loop); `paged` times the decode kernel through page tables
# against the column layout (issue 13; `paged_small` adds pages of 16 and 32 rows). Usage: bash benchmarks/gpu_serving.sh [which...]
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
for w in "${@:-decode uniform}"; do
  case $w in
    decode4k) run e2e_decode4k 240 python3 benchmarks/e2e.py --workload decode --max-write 4096 --out "$out/e2e_decode4k.json";;
    decode) run e2e_decode 200 python3 benchmarks/e2e.py --workload decode --out "$out/e2e_decode.json";;
    decode_cb) XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1" \
        run e2e_decode_cb 200 python3 benchmarks/e2e.py --workload decode --skip-baseline --out "$out/e2e_decode_cb.json";;
    uniform) run e2e_uniform 240 python3 benchmarks/e2e.py --workload uniform --out "$out/e2e_uniform.json";;
    uniform2k) run e2e_uniform2k 240 python3 benchmarks/e2e.py --workload uniform --max-write 2048 --out "$out/e2e_uniform2k.json";;
    uniform8k) run e2e_uniform8k 300 python3 benchmarks/e2e.py --workload uniform --max-write 8192 --out "$out/e2e_uniform8k.json";;
    profile_uniform4k) TAIL=200 run profile_uniform4k 420 python3 benchmarks/profile_step.py --uniform --uniform-width 4096 --out "$out";;
    plan_search) TAIL=30 run plan_search 300 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,searches as before,defaults" --cases "mixed 8x512 over 2048 + 56 decodes 32/8 D128,prefill 1x16384 32/8 D128,prefill 4x4096 32/8 D128,prefill 1x2048 32/8 D64";;
    row_mask) TAIL=40 run row_mask 300 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,per-score mask,defaults" --cases "decode 64 seqs 32/8 D64 8..272,decode 64 seqs 32/8 D64 128..2304,decode 256 seqs 32/8 D64 128..2048,decode 256 seqs 32/8 D128 128..2048,prefill 1x2048 32/8 D64,prefill 4x512 32/8 D64,mixed 8x512 over 2048 + 56 decodes 32/8 D128"
        run row_mask_tests 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_paged_kernels.py -k "compiled_kernel_matches or compiled_paged_attention or compiled_masks";;
    row_mask_on) run row_mask_tests 330 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_paged_kernels.py -k "compiled_kernel_matches or compiled_paged_attention or compiled_masks"
        run e2e_decode 200 python3 benchmarks/e2e.py --workload decode --out "$out/e2e_decode.json";;
    gemm_mgpu) TAIL=60 run gemm_mgpu 420 python3 benchmarks/gemm_options.py --rows 64 --mgpu;;
    gemm_mgpu_quick) TAIL=50 run gemm_mgpu_quick 240 python3 benchmarks/gemm_options.py --rows 64 --mgpu --quick --default-only;;
    v_fixup) TAIL=30 run v_fixup 240 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,no V fix-up (timing only),defaults" --cases "decode 64 seqs 32/8 D64 8..272,decode 64 seqs 32/8 D64 128..2304,decode 256 seqs 32/8 D64 128..2048,prefill 4x512 32/8 D64";;
    col_parts_tests) run col_parts_tests 420 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_head_layouts.py tests/pallas_kernels/test_paged_kernels.py tests/jaxkv/test_kernel_sizes.py -k "compiled or mosaic_gpu";;
    col_parts_quick) run col_parts_quick 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_head_layouts.py -k "compiled and (d80 or d96 or d112)";;
    in_place) run in_place_tests 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py -k "compiled_kernel_serves_unaligned"
        TAIL=30 run in_place 240 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,padded copy,defaults" --cases "decode 64 seqs 32/8 D128 ring 1024 rows 1087,decode 64 seqs 32/8 D64 ring 512 rows 575,decode 64 seqs 16/8 D256 ring 1024 rows 1087";;
    back_to_back) TAIL=45 run back_to_back 300 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,items one at a time,defaults" --cases "decode 256 seqs 32/8 D128 128..2048,decode 64 seqs 32/8 D128 512..8192,decode 256 seqs 32/8 D64 128..2048,decode 64 seqs 32/8 D64 8..272,decode 64 seqs 32/32 D80 512..4096,decode 64 seqs 16/8 D256 512..8192 (G2),mixed 8x512 over 2048 + 56 decodes 32/8 D128,prefill 4x4096 32/8 D128,prefill 1x2048 32/8 D64";;
    back_to_back_tests) run back_to_back_tests 290 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_head_layouts.py tests/pallas_kernels/test_paged_kernels.py tests/pallas_kernels/test_paged_small_pages.py tests/jaxkv/test_kernel_sizes.py -x -k "compiled or mosaic_gpu";;
    back_to_back_rest) run back_to_back_rest 230 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_paged_kernels.py tests/pallas_kernels/test_head_layouts.py -k "compiled_items_back_to_back or compiled_paged or (compiled_kernel_serves_head_layout and not d256)";;
    tokens_in_place) TAIL=30 run tokens_in_place 270 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,tokens through partials,defaults" --cases "prefill 4x4096 32/8 D128,prefill 1x16384 32/8 D128,mixed 8x512 over 2048 + 56 decodes 32/8 D128,prefill 1x2048 32/8 D64,decode 64 seqs 32/8 D64 8..272"
        run tokens_in_place_tests 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_paged_kernels.py tests/pallas_kernels/test_head_layouts.py -k "compiled_tokens_in_place or compiled_items_back_to_back or compiled_paged or (compiled_kernel_serves_head_layout and not d256) or compiled_kernel_matches";;
    tokens_in_place2) TAIL=30 run tokens_in_place 250 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,tokens through partials,defaults" --cases "prefill 4x4096 32/8 D128,prefill 1x16384 32/8 D128,mixed 8x512 over 2048 + 56 decodes 32/8 D128,prefill 1x2048 32/8 D64,decode 64 seqs 32/8 D64 8..272"
        run tokens_in_place_tests 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_paged_kernels.py tests/pallas_kernels/test_head_layouts.py -k "compiled_tokens_in_place or (compiled_paged and (d80 or d96 or write)) or (compiled_kernel_serves_head_layout and not d256)";;
    atom_parts) TAIL=30 run atom_parts 300 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,atom parts,defaults" --cases "decode 64 seqs 32/8 D128 512..8192,decode 256 seqs 32/8 D128 128..2048,decode 64 seqs 32/8 D64 128..2304,decode 256 seqs 32/8 D64 128..2048,prefill 4x4096 32/8 D128,prefill 1x2048 32/8 D64";;
    mha_tiles_parts) TAIL=20 run mha_tiles_parts 150 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,128-key tiles,128-key tiles 3 stages" --cases "decode 64 seqs 32/32 D80 512..4096,decode 64 seqs 32/8 D112 512..8192";;
    col_parts) TAIL=60 run col_parts 330 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,one column part,defaults" --cases "decode 64 seqs 32/32 D80 512..4096,decode 64 seqs 32/32 D96 512..4096,decode 64 seqs 32/8 D96 512..8192,decode 64 seqs 32/8 D80 512..8192,decode 64 seqs 32/8 D112 512..8192,prefill 4x4096 32/8 D96,prefill 4x4096 32/8 D80";;
    mha_tiles) TAIL=40 run mha_tiles 300 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,128-key tiles,128-key tiles 3 stages,defaults" --cases "decode 64 seqs 32/32 D80 512..4096,decode 64 seqs 32/32 D96 512..4096,decode 64 seqs 32/8 D96 512..8192";;
    gemm_on) run gemm_tests 200 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_skinny_gemm.py tests/jaxkv/test_gemm.py -k "compiled or resolves or refused"
        TAIL=12 run step_levers_gemm 240 python3 benchmarks/step_levers.py --variants base,xla_gemm,base
        run e2e_decode 150 python3 benchmarks/e2e.py --workload decode --out "$out/e2e_decode.json";;
    gemm_e2e) run gemm_tests 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_skinny_gemm.py tests/jaxkv/test_gemm.py -k "compiled or resolves or refused"
        run e2e_decode 120 python3 benchmarks/e2e.py --workload decode --out "$out/e2e_decode.json"
        run e2e_mixed2k 200 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --out "$out/e2e_mixed2k.json"
        run e2e_uniform4k 150 python3 benchmarks/e2e.py --workload uniform --max-write 4096 --out "$out/e2e_uniform4k.json";;
    gemm128) run gemm128_tests 200 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_skinny_gemm.py -k "compiled"
        TAIL=30 run gemm128 400 python3 benchmarks/gemm_options.py --rows 64,100,128 --mgpu-entry --default-only --shapes o,down;;
    gemm128_e2e) TAIL=12 run step_levers_rows128 420 python3 benchmarks/step_levers.py --requests 128 --variants rows64,rows128,rows64;;
    levers_gemm) TAIL=12 run step_levers_gemm 300 python3 benchmarks/step_levers.py --variants base,xla_gemm,base;;
    table_rows) run table_rows_compiled 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py -k "compiled_kernel_serves_tables_with_fewer_rows"
        TAIL=30 run table_rows 240 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,segment rows" --cases "mixed 8x512 over 2048 + 56 decodes 32/8 D128,prefill 1x16384 32/8 D128,prefill 4x4096 32/8 D128";;
    plan_compare) TAIL=30 run plan_compare 300 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,plan compares as before,defaults" --cases "mixed 8x512 over 2048 + 56 decodes 32/8 D128,prefill 1x2048 32/8 D64";;
    mixed_step) TAIL=40 run mixed_step 200 python3 benchmarks/kernel_trace.py --calls 10 --top 12 --cases "mixed 8x512 over 2048 + 56 decodes 32/8 D128";;
    uniform4k) run e2e_uniform4k 300 python3 benchmarks/e2e.py --workload uniform --max-write 4096 --out "$out/e2e_uniform4k.json";;
    kernels_fixed) run kernels_fixed 200 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_head_layouts.py tests/jaxkv/test_implementation_plan.py -k "shrinks or refuses or plan or warn";;
    mixed2k) run e2e_mixed2k 330 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --out "$out/e2e_mixed2k.json";;
    mixed2k_widths) run e2e_mixed2k_widths 420 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --also-widths 2048,64 --out "$out/e2e_mixed2k_widths.json";;
    uniform2k_widths) run e2e_uniform2k_widths 330 python3 benchmarks/e2e.py --workload uniform --max-write 2048 --also-widths 2048,64 --out "$out/e2e_uniform2k_widths.json";;
    levers_epilogue) run step_levers_epilogue 240 python3 benchmarks/step_levers.py --variants base,kernel_epilogue,no_splits;;
    combine_kernels) run combine_kernels 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_combine.py tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_paged_kernels.py -k "compiled or lowers";;
    mixed2k_paged) run e2e_mixed2k_paged 480 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --paged 128 --out "$out/e2e_mixed2k_paged.json";;
    compiled_attention) run compiled_attention 420 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_paged_kernels.py -k "compiled_kernel_matches or compiled_kernel_serves or compiled_paged";;
    launch_cost) TAIL=20 run launch_cost 150 python3 benchmarks/launch_cost.py;;
    kernel_trace) TAIL=80 run kernel_trace 240 python3 benchmarks/kernel_trace.py;;
    kernel_variants) TAIL=60 run kernel_variants 420 python3 benchmarks/kernel_trace.py --calls 20 --variants "before,early K,early K+stages3" --cases "decode 64 seqs 32/8 D64 128..2304,decode 64 seqs 32/8 D64 8..272,decode 256 seqs 32/8 D64 128..2048,decode 64 seqs 32/8 D128 512..8192,prefill 1x2048 32/8 D64";;
    tile_loops) TAIL=40 run tile_loops 420 python3 benchmarks/kernel_trace.py --calls 10 --variants "defaults,one tile loop" --cases "prefill 1x16384 32/8 D128,prefill 4x4096 32/8 D128,prefill 1x2048 32/8 D64,prefill 4x512 32/8 D64,decode 64 seqs 32/8 D64 128..2304,decode 64 seqs 32/8 D128 512..8192,decode 256 seqs 32/8 D128 128..2048";;
    prefill_glue) TAIL=60 run prefill_glue 200 python3 benchmarks/kernel_trace.py --calls 5 --top 8 --cases "prefill 1x16384 32/8 D128,prefill 4x4096 32/8 D128,prefill 1x2048 32/8 D64";;
    kernel_sweep) TAIL=40 run kernel_sweep 300 python3 benchmarks/kernel_trace.py --sweep;;
    e2e_kernels) TAIL=30 run e2e_kernels 300 python3 benchmarks/decode.py --e2e --out "$out/e2e_kernels.json";;
    levers_bound) TAIL=12 run step_levers_bound 420 python3 benchmarks/step_levers.py --uniform --variants base,unbounded_splits,base;;
    levers_bound_decode) TAIL=12 run step_levers_bound_decode 240 python3 benchmarks/step_levers.py --variants base,unbounded_splits;;
    levers_merge) run step_levers_merge 300 python3 benchmarks/step_levers.py --variants base,compacted_merge,base;;
    levers_cond) run step_levers_cond 200 python3 benchmarks/step_levers.py --variants base,sample_cond;;
    mixed2k_lpt) run e2e_mixed2k_lpt 480 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --also-fcfs --also-sorted-static --paged 128 --out "$out/e2e_mixed2k_lpt.json";;
    mixed2k_paged32) run e2e_mixed2k_paged32 300 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --paged 32 --out "$out/e2e_mixed2k_paged32.json";;
    mixed2k_halving) run e2e_mixed2k_halving 420 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --also-widths 2048,512,128,64 --out "$out/e2e_mixed2k_halving.json";;
    mixeddp1k) run e2e_mixed_dp1k 420 python3 benchmarks/e2e.py --workload mixed --mixed-requests 1024 --max-write 2048 --skip-baseline --data-parallel 2 --out "$out/e2e_mixed_dp1k.json";;
    mixeddp) run e2e_mixed_dp 250 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --data-parallel 2 --out "$out/e2e_mixed_dp.json";;
    tp8b) run tp8b 480 python3 benchmarks/sharded.py --model --devices 2 --model-layers 32 --model-hidden 4096 --model-heads 32 --model-kv-heads 8 --model-head-dim 128 --model-intermediate 14336 --model-vocab 128256 --no-mesh-row;;
    levers_glue) TAIL=12 run step_levers_glue 400 python3 benchmarks/step_levers.py --variants base,mlp_apart,no_refusal_selects,base;;
    levers) run step_levers 400 python3 benchmarks/step_levers.py;;
    profile_prefill) TAIL=70 run profile_prefill 300 python3 benchmarks/profile_step.py --widths 2048 --dump-hlo --out "$out";;
    profile_paged) TAIL=70 run profile_paged 300 python3 benchmarks/profile_step.py --widths 2048 --decode-only --page-size 32 --dump-hlo --out "$out";;
    profile_paged128) TAIL=150 run profile_paged128 300 python3 benchmarks/profile_step.py --widths 2048 --decode-only --page-size 128 --dump-hlo --out "$out";;
    profile_paged_prefill) TAIL=80 run profile_paged_prefill 300 python3 benchmarks/profile_step.py --widths 2048 --prefill-only --page-size 128 --dump-hlo --out "$out";;
    profile_uniform) TAIL=200 run profile_uniform 420 python3 benchmarks/profile_step.py --uniform --dump-hlo --out "$out";;
    profile_map_paged) TAIL=30 run profile_pages 300 python3 benchmarks/profile_step.py --decode-only --page-size 128 --dump-hlo --out "$out"
        TAIL=150 run profile_map_cols 60 python3 benchmarks/hlo_kernel_map.py "$out/loop_W512.hlo.txt" "$out/kernels_engine_W512_decode.txt" --frames 5
        TAIL=150 run profile_map_pages 60 python3 benchmarks/hlo_kernel_map.py "$out/loop_paged128_W512.hlo.txt" "$out/kernels_paged128_W512_decode.txt" --frames 5;;
    profile_rows128) TAIL=60 run profile_rows64 200 python3 benchmarks/profile_step.py --decode-only --padded --out "$out/r64"
        TAIL=60 run profile_rows128 240 python3 benchmarks/profile_step.py --decode-only --padded --requests 128 --out "$out/r128";;
    profile_map128) run profile128 240 python3 benchmarks/profile_step.py --decode-only --dump-hlo --requests 128 --out "$out"
        TAIL=80 run profile_map128_layers 60 python3 benchmarks/hlo_kernel_map.py "$out/loop_W512.hlo.txt" "$out/kernels_engine_W512_decode.txt" --min 10 --max 40 --frames 4 --ops;;
    profile_map) run profile 200 python3 benchmarks/profile_step.py --decode-only --dump-hlo --out "$out"
        TAIL=130 run profile_map 60 python3 benchmarks/hlo_kernel_map.py "$out/loop_W512.hlo.txt" "$out/kernels_engine_W512_decode.txt" --frames 5
        TAIL=40 run profile_map_layers 60 python3 benchmarks/hlo_kernel_map.py "$out/loop_W512.hlo.txt" "$out/kernels_engine_W512_decode.txt" --frames 8 --min 14 --max 40 --ops;;
    profile) run profile 200 python3 benchmarks/profile_step.py --decode-only --dump-hlo --out "$out";;
    mixed) run e2e_mixed 330 python3 benchmarks/e2e.py --workload mixed --out "$out/e2e_mixed.json";;
    kernels) run kernels 330 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_head_layouts.py tests/pallas_kernels/test_varlen_attention.py tests/pallas_kernels/test_kv_write.py tests/jaxkv/test_kernel_sizes.py tests/jaxkv/test_implementation_plan.py -k "compiled or mosaic_gpu or plan or warn";;
    paged) TAIL=40 run paged_decode 120 python3 benchmarks/paged_decode.py --out "$out/paged_decode.json";;
    paged_small) TAIL=60 run paged_decode_small 300 python3 benchmarks/paged_decode.py --page-sizes 16,32,64,128 --out "$out/paged_decode_small.json";;
    paged_kernels) run paged_kernels 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_paged_kernels.py tests/jaxkv/test_paged.py -k "compiled or mosaic_gpu";;
    paged_small_kernels) run paged_small_kernels 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_paged_small_pages.py tests/jaxkv/test_paged.py -k "compiled or mosaic_gpu";;
    square_fixed) TAIL=6 run square_fixed 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_varlen_attention.py -k "square_tiles"
        TAIL=24 run square_tiles 100 python3 benchmarks/square_tiles.py;;
    square_repro) TAIL=12 run square_repro 120 python3 benchmarks/square_repro.py;;
    square_tiles) TAIL=40 run square_tiles 200 python3 benchmarks/square_tiles.py;;
    square_q_reload) SQUARE_MULTI_ONLY=1 SQUARE_Q_HOLD=1 TAIL=16 run square_multi_q_held 150 python3 benchmarks/square_tiles.py
        SQUARE_MULTI_ONLY=1 TAIL=16 run square_multi_q_reload 150 python3 benchmarks/square_tiles.py;;
    mixed2k_paged_memory) run e2e_mixed2k_paged_memory 540 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --paged 128 --paged-slots 128 --out "$out/e2e_mixed2k_paged_memory.json";;
    mixed1k_paged_memory) run e2e_mixed1k_paged_memory 420 python3 benchmarks/e2e.py --workload mixed --mixed-requests 1024 --max-write 2048 --skip-baseline --paged 128 --paged-slots 128 --out "$out/e2e_mixed1k_paged_memory.json";;
    gemm_options) TAIL=30 run gemm_options 200 python3 benchmarks/gemm_options.py;;
    gemm_pallas) TAIL=60 run gemm_pallas 400 python3 benchmarks/gemm_options.py --rows 64 --pallas;;
    profile_w2048) TAIL=70 run profile_w2048 300 python3 benchmarks/profile_step.py --widths 2048 --out "$out";;
    decode_opts) run e2e_decode_opts 240 python3 benchmarks/e2e.py --workload decode --also-compiler-options '{"xla_gpu_enable_triton_gemm": false}' --out "$out/e2e_decode_opts.json";;
    uniform2k_opts) run e2e_uniform2k_opts 300 python3 benchmarks/e2e.py --workload uniform --max-write 2048 --also-compiler-options '{"xla_gpu_enable_triton_gemm": false}' --out "$out/e2e_uniform2k_opts.json";;
    writes_compiled) run writes_compiled 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_kv_write.py tests/pallas_kernels/test_paged_kernels.py tests/jaxkv/test_paged.py -k "compiled or mosaic_gpu";;
    levers_splits_uniform) TAIL=12 run step_levers_splits_uniform 420 python3 benchmarks/step_levers.py --uniform --variants base,no_splits,base;;
    mixed2k_cb) run e2e_mixed2k_cb 300 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --also-compiler-options '{"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"}' --out "$out/e2e_mixed2k_cb.json";;
    levers_epilogue_uniform) TAIL=12 run step_levers_epilogue_uniform 330 python3 benchmarks/step_levers.py --uniform --variants base,kernel_epilogue,base;;
    mixed2k_paged_repeats) run e2e_mixed2k_paged_repeats 540 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --paged 128 --paged-repeats 5 --out "$out/e2e_mixed2k_paged_repeats.json";;
    trace_d256) TAIL=30 run kernel_trace_d256 240 python3 benchmarks/kernel_trace.py --cases "decode 64 seqs 16/8 D256 512..8192 (G2),decode 64 seqs 32/8 D128 512..8192";;
    trace_issue12) TAIL=8 run kernel_trace_issue12 200 python3 benchmarks/kernel_trace.py --cases "decode 64 seqs 32/8 D128 512..8192,decode 256 seqs 32/8 D128 128..2048,decode 16 seqs 16/16 D64 1024..32768";;
    mixed2k_paged256_repeats) run e2e_mixed2k_paged256_repeats 540 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --paged 256 --paged-repeats 5 --out "$out/e2e_mixed2k_paged256_repeats.json";;
    mixed2k_paged32_repeats) run e2e_mixed2k_paged32_repeats 400 python3 benchmarks/e2e.py --workload mixed --max-write 2048 --skip-baseline --paged 32 --paged-repeats 5 --out "$out/e2e_mixed2k_paged32_repeats.json";;
    kernel_sizes) run kernel_sizes 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/jaxkv/test_kernel_sizes.py -k mosaic_gpu;;
    paged_compiled) run paged_compiled 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_paged_kernels.py -k "compiled";;
    paged256) run paged256 200 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_paged_kernels.py -k "compiled and d256";;
    prefill_fa3) TAIL=30 run prefill_fa3 300 python3 benchmarks/decode.py --prefill;;
    prefill_ptxas) MOSAIC_GPU_DUMP_PTXAS=1 TAIL=14 run prefill_ptxas 300 python3 benchmarks/decode.py --prefill
      echo "ptxas resource lines (registers, spills) of the Mosaic GPU kernels compiled:"
      grep -i -E "spill|Used [0-9]+ registers" "$out/prefill_ptxas.log" | sort | uniq -c | head -40;;
    kernels256) run kernels256 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/pallas_kernels/test_head_layouts.py -k "compiled and d256";;
  esac
done
