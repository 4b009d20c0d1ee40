#!/bin/bash
# The first GPU call of a session (issue 27), within one `run` (10 min cap), in the order that matters most if the
# call is cut short: 1. the per-layer rows of bench_model (4 and 8 layers: decode b=1/8/32, prefill 1k/4k, floors,
# ratios, launches) at this tree - issue 27's "done when"; 2. the MoE decode probe (input forms / nibble decodes
# of the gemv path side by side: GEMV_CODES); 3. the GPU tests of the kernels fused on 2026-12-05 and
# of the packed FP4 decodes (bitwise claims made under the interpreter); 4. the MoE gemv / tiles crossover at
# decode batch sizes (GEMV_MAX_PAIRS) with the packed tiles; 5. three unit tests on the GPU without the interpreter.
# Outputs under $OUT (the device tool's folder) or /tmp/gpu_next; each stage writes as it goes.
#     PYTHONPATH=/tmp/site:$PWD DSV4_COMMIT=<the local HEAD> bash benchmarks/gpu_next.sh
# On the device tool's machine: do not run git there (no `git checkout -- .`, no `git rev-parse`): its copy of the
# working tree carries a stale .git of its own, and a checkout reverts the sent files to that old commit (it cost
# a call on 2026-12-06, benchmarks/RESULTS.md); pass the local commit in DSV4_COMMIT instead.
set -u
O=${OUT:-/tmp/gpu_next}; mkdir -p "$O"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python3 benchmarks/bench_model.py --geometry flash --flash-layers 4,8 --prefill 1024,4096 \
  --batches 1,8,32 --reps 3 --warmup 1 --backends triton --markdown "$O/bench.md" > "$O/bench.log" 2>&1
echo "bench rc=$?"; head -40 "$O/bench.md"; tail -5 "$O/bench.log"
timeout 100 python3 benchmarks/moe_decode_probe.py > "$O/probe.md" 2>&1; echo "probe rc=$?"; cat "$O/probe.md"
# -n 4 needs the H200's memory (on an 80 GB H100 the Flash-width graph tests run out of it: one worker there)
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
W=${GPU_NEXT_WORKERS:-$([ "${MEM:-0}" -ge 120000 ] && echo 4 || echo 1)}; echo "gpu check workers: $W (${MEM} MiB)"
timeout 300 python3 -m pytest -n "$W" -q -rf -p no:cacheprovider tests/gpu/test_mhc_kernels.py \
  tests/gpu/test_gemm_moe_kernels.py tests/gpu/test_model_backends.py tests/gpu/test_graph_decode.py \
  tests/gpu/test_batch_invariant.py -k "not real" > "$O/gpu_check.txt" 2>&1
echo "gpu check rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$O/gpu_check.txt" | tail -12
timeout 130 python3 benchmarks/bench_gemm.py --quick --sections moe_crossover > "$O/crossover.md" 2>&1
echo "crossover rc=$?"; grep -E "^\| flash|Traceback|Error" "$O/crossover.md" | head -12
timeout 40 python3 -m pytest -q -p no:cacheprovider -rf tests/unit/test_gemm_moe_kernels.py \
  tests/unit/test_norm_kernel.py -k "names_bad_fields or test_moe_names_bad_input or norms_run_the_kernel" > "$O/unit_gpu.txt" 2>&1
echo "unit-on-gpu rc=$?"; grep -E "FAILED|Error|passed|failed" "$O/unit_gpu.txt" | tail -8
timeout 200 python3 benchmarks/bench_model.py --quick --geometry flash --backends reference,triton,transformers \
  --markdown "$O/bench_cols.md" > "$O/bench_cols.log" 2>&1; echo "columns rc=$?"; head -14 "$O/bench_cols.md"
