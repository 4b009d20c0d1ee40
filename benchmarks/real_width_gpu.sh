#!/usr/bin/env bash
# One-shot real-width GPU run (issue 12): build a Flash-geometry checkpoint on local disk, run the real-width GPU
# tests against it, dsv4 diagnose at world size 1 (and 2 when two GPUs are visible), and the memory measurement.
#
#   benchmarks/real_width_gpu.sh OUTDIR
#
# Environment: DSV4_REAL_LAYERS (default 4: SWA, SWA, CSA, HCA), DSV4_CKPT (reuse a checkpoint; default
# ${TMPDIR:-/tmp}/dsv4-flash<N>, built if absent), PYTHON (default python3), STEPS (default
# "build tests diagnose measure"). Every step's log goes to OUTDIR/<step>.log, its exit status and wall time to
# OUTDIR/steps.txt; the script runs every step and exits 1 if any failed.
set -u -o pipefail
OUT=${1:?usage: benchmarks/real_width_gpu.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LAYERS=${DSV4_REAL_LAYERS:-4}
CK=${DSV4_CKPT:-${TMPDIR:-/tmp}/dsv4-flash$LAYERS}
STEPS=${STEPS:-build tests diagnose measure}
export PYTHONUNBUFFERED=1
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
status=0
: > "$OUT/steps.txt"

step() {  # step NAME CMD...: run, log, time
    local name=$1; shift
    echo "== $name: $*"
    local t0; t0=$(date +%s%N)
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf '%-26s rc=%-3d %6d.%01d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) | tee -a "$OUT/steps.txt"
    tail -n 25 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

echo "GPUs: $NGPU; checkpoint: $CK (Flash geometry, $LAYERS layers); commit $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpus.txt"
mkdir -p "$(dirname "$CK")" && df -h "$(dirname "$CK")" | tail -1
if has build; then
    if [ -f "$CK/model.safetensors.index.json" ]; then
        echo "== build: reusing $CK"
    else
        step build $PY -m dsv4.cli make-checkpoint "$CK" --geometry flash --layers "$LAYERS" --device cuda
    fi
fi
export DSV4_CKPT=$CK
if has tests; then
    # the real-width tests (diagnose at W=1 in all four backend x weights combinations included); diagnose at
    # W=2 runs once, as its own step below
    step pytest_real $PY -m pytest -q -s -rA tests/gpu -k "(real or final_norm) and not world2" \
        --junitxml="$OUT/pytest_real.xml"
fi
if has diagnose; then
    step diagnose_w1_quantized $PY -m dsv4.cli diagnose --device cuda --weights quantized \
        --json "$OUT/diagnose_w1_quantized.json"
    if [ "$NGPU" -ge 2 ]; then
        step diagnose_w2_quantized $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m dsv4.cli \
            diagnose --device cuda --weights quantized --json "$OUT/diagnose_w2_quantized.json"
    else
        echo "diagnose_w2_quantized      skipped: $NGPU GPU visible" | tee -a "$OUT/steps.txt"
    fi
fi
if has measure; then
    step measure $PY benchmarks/measure_real_width.py --ckpt "$CK" --out "$OUT"
fi
echo "== summary"
cat "$OUT/steps.txt"
exit $status
