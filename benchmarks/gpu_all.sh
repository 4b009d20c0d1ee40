#!/usr/bin/env bash
# Every GPU check of the project in one call, spread over the visible GPUs (1 or 2), within a time budget.
#
#   benchmarks/gpu_all.sh OUTDIR [BUDGET_S]
#
# Lane A (GPU 0): build a Flash-geometry checkpoint of $DSV4_REAL_LAYERS (default 4: SWA, SWA, CSA, HCA) layers,
#   then the real-width single-GPU tests against it (final norm, diagnose in both backends x both weight modes,
#   quantized-resident, generator bits), then `bench_model.py $BENCH_ARGS` (default --quick).
# Lane B (GPU 1, or GPU 0 after lane A on one GPU): every other GPU test (kernels vs references at real sizes,
#   kernel edge values, GEMM/MoE, top-k, graph-captured decode, model backends).
# Phase 2 (both GPUs): world size 2 on the tiny model and at real width (distributed final-norm test, both weight
#   modes, diagnose under torchrun), then the measured memory (`measure_real_width.py`).
# $STEPS selects parts: "a b bench 2" (default), plus "kbench" (lane B, after the suite: $KERNEL_BENCH). Every step runs under `timeout`, so the script ends within
# BUDGET_S (default 540; the lanes stop at BUDGET_S - RESERVE_S, default 150, leaving phase 2 its time) and always
# writes OUTDIR/summary.txt and OUTDIR/logs.tgz (each step's log, junit XML, JSON, benchmark tables).
set -u -o pipefail
OUT=${1:?usage: benchmarks/gpu_all.sh OUTDIR [BUDGET_S]}
BUDGET=${2:-540}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LAYERS=${DSV4_REAL_LAYERS:-4}
CK=${DSV4_CKPT:-${TMPDIR:-/tmp}/dsv4-flash$LAYERS}
STEPS=${STEPS:-a b bench 2}
RESERVE=${RESERVE_S:-150}
DEADLINE=$(( BUDGET - RESERVE ))
BENCH_ARGS=${BENCH_ARGS:---quick}
LOG=$(mktemp -d)
T0=$(date +%s)
export PYTHONUNBUFFERED=1
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

step() {  # step NAME MAX_S CMD...: run under timeout (capped by what is left), log, time
    local name=$1 max=$2; shift 2
    local l; l=$(left); [ "$max" -gt "$l" ] && max=$l
    if [ "$max" -le 5 ]; then echo "$name: not run (budget spent)" >> "$LOG/summary.txt"; return; fi
    local t=$(date +%s)
    timeout -k 5 "$max" "$@" > "$LOG/$name.log" 2>&1
    local rc=$?
    printf '%-28s rc=%-3d %4d s%s\n' "$name" "$rc" $(( $(date +%s) - t )) \
        "$([ $rc -eq 124 ] && echo ' (timed out)')" >> "$LOG/summary.txt"
    grep -E "passed|failed|error" "$LOG/$name.log" | tail -n 2 | sed "s/^/    $name: /" >> "$LOG/summary.txt"
}

{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null) dirty=$(git status --porcelain 2>/dev/null | wc -l)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'GPUs', torch.cuda.device_count())"
    df -h "$(dirname "$CK")" | tail -1
} > "$LOG/summary.txt" 2>&1

lane_a() {
    if { has a || has 2; } && [ ! -f "$CK/model.safetensors.index.json" ]; then
        step build 150 env CUDA_VISIBLE_DEVICES=0 $PY -m dsv4.cli make-checkpoint "$CK" --geometry flash \
            --layers "$LAYERS" --device cuda --no-mtp
    fi
    has a && step real_w1 300 env CUDA_VISIBLE_DEVICES=0 DSV4_CKPT="$CK" $PY -m pytest -q -rA -p no:cacheprovider \
        tests/gpu/test_final_norm.py tests/gpu/test_real_width.py tests/gpu/test_resident_quant.py \
        -k "real" --junitxml="$LOG/real_w1.xml"
    # shellcheck disable=SC2086
    has bench && step bench_model "${BENCH_MAX_S:-240}" env CUDA_VISIBLE_DEVICES=0 $PY benchmarks/bench_model.py $BENCH_ARGS \
        --markdown "$LOG/bench_model.md" --json "$LOG/bench_model.json"
}
lane_b() {
    local dev=$1
    has b && step gpu_suite "${SUITE_MAX_S:-330}" env CUDA_VISIBLE_DEVICES=$dev $PY -m pytest -q -rfEs \
        -p no:cacheprovider tests/gpu -k "not real" --junitxml="$LOG/gpu_suite.xml"
    # kernel benchmarks after the suite on the same GPU (issue 14 rows): $KERNEL_BENCH, a shell command whose
    # tables go to $LOG (exported as BENCH_OUT)
    has kbench && step kernel_bench 400 env CUDA_VISIBLE_DEVICES=$dev BENCH_OUT="$LOG" bash -c "$KERNEL_BENCH"
}

if [ "$NGPU" -ge 2 ]; then
    lane_a &
    lane_b 1 &
    wait
else
    lane_a
    lane_b 0
fi
DEADLINE=$BUDGET
if has 2 && [ "$NGPU" -ge 2 ]; then
    export DSV4_CKPT=$CK
    step world2 200 $PY -m pytest -q -rA -p no:cacheprovider tests/gpu/test_parallel.py \
        tests/gpu/test_resident_quant.py tests/gpu/test_real_width.py -k "world2 or distributed or all_gpus" \
        --junitxml="$LOG/world2.xml"
    step measure 150 $PY benchmarks/measure_real_width.py --ckpt "$CK" --out "$LOG/measure"
fi
echo "total $(( $(date +%s) - T0 )) s of budget $BUDGET s" >> "$LOG/summary.txt"
cp "$LOG/summary.txt" "$OUT/summary.txt"
tar -czf "$OUT/logs.tgz" -C "$LOG" .
cat "$OUT/summary.txt"
