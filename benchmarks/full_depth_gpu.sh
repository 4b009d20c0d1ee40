#!/usr/bin/env bash
# Full-depth multi-GPU run (issue 16): every main layer of Flash (43, 4 GPUs) or Pro (61, 8 GPUs) from a
# synthetic source (`--ckpt synth:GEOMETRY:LAYERS:SEED`: each rank generates exactly its tensors / parts on its
# GPU as it loads them, bitwise what `dsv4 make-checkpoint` would write; no file: a 61-layer Pro checkpoint is
# ~0.9 TB, more than the machines' disks). docs/multi_gpu.md "Full depth without the files".
#
#   benchmarks/full_depth_gpu.sh flash OUTDIR     # on nvidia-h200-x4: W=4, 43 layers, both modes where they fit
#   benchmarks/full_depth_gpu.sh pro OUTDIR       # on nvidia-h200-x8: W=8, 61 layers, quantized
#
# Steps (STEPS, default "plan diagnose final_norm measure"), each under `timeout $STEP_TIMEOUT` (default 570 s,
# so that one step fits one 10-minute device call; run one step per call with STEPS=...):
#   plan        per mode, dsv4.memory_plan's per-rank peak + 4 GiB (activations, decode state, allocator) against
#               the GPU's memory: modes that do not fit are not run, with the numbers (plan.txt)
#   diagnose    torchrun -m dsv4.cli diagnose --ckpt SPEC --device cuda --weights MODE, TEST_LAYERS=LAYERS,
#               for each fitting mode and each backend of BACKENDS (default "reference"): both decisive tests
#               must PASS (exit 0); JSON report per run (its checkpoint.source says SYNTHETIC)
#   final_norm  DSV4_CKPT=SPEC TEST_LAYERS=LAYERS torchrun ... pytest tests/gpu/test_final_norm.py -k real (the
#               fitting modes; both backends; negative control), as the user's harness would run it; one pytest
#               per rank (--basetemp per rank), junit XML of rank 0
#   measure     benchmarks/measure_real_width.py --ckpt SPEC --world W --modes FITTING: per-rank weights / held /
#               peak GiB measured vs dsv4.memory_plan (exit 1 if weights differ > 5 %), load time (generation on
#               the GPU, not a disk read), TTFT, decode ms per step (real_width.{json,md} under OUTDIR/measure)
# Environment: WORLD (default 4 flash / 8 pro), LAYERS (default 43 / 61), SEED (default 0), MODES (default
# "quantized dequantized" flash / "quantized" pro, then filtered by plan), BACKENDS, PYTHON (default python3),
# STEPS, STEP_TIMEOUT. Logs: OUTDIR/<step>.log; exit status and wall time of each: OUTDIR/steps.txt. Runs every
# selected step; exits 1 if any failed (a mode skipped by plan is not a failure: plan.txt says why).
set -u -o pipefail
GEOM=${1:?usage: benchmarks/full_depth_gpu.sh flash|pro OUTDIR}
OUT=${2:?usage: benchmarks/full_depth_gpu.sh flash|pro OUTDIR}
case "$GEOM" in
    flash) W=${WORLD:-4}; L=${LAYERS:-43}; MODES=${MODES:-quantized dequantized} ;;
    pro)   W=${WORLD:-8}; L=${LAYERS:-61}; MODES=${MODES:-quantized} ;;
    *) echo "full_depth_gpu.sh: GEOMETRY=$GEOM: expected flash or pro" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SPEC="synth:$GEOM:$L:${SEED:-0}"
STEPS=${STEPS:-plan diagnose final_norm measure}
BACKENDS=${BACKENDS:-reference}
STEP_TIMEOUT=${STEP_TIMEOUT:-570}
export PYTHONUNBUFFERED=1 TEST_LAYERS=$L
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if ! [[ "$NGPU" =~ ^[0-9]+$ ]]; then
    echo "full_depth_gpu.sh: could not count the GPUs with $PY (torch import failed?)" >&2
    exit 2
fi
if [ "$NGPU" -lt "$W" ]; then
    echo "full_depth_gpu.sh: $GEOM at world size $W needs $W GPUs, $NGPU visible" | tee "$OUT/steps.txt" >&2
    exit 2
fi
status=0
touch "$OUT/steps.txt"
TORCHRUN=($PY -m torch.distributed.run --standalone --nproc_per_node "$W")

step() {  # step NAME CMD...: run under the step timeout, log, time
    local name=$1; shift
    echo "== $name: $*"
    local t0; t0=$(date +%s%N)
    timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    printf '%-34s rc=%-3d %6d.%01d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000 / 100)) | tee -a "$OUT/steps.txt"
    tail -n 30 "$OUT/$name.log"
    [ "$rc" -eq 0 ] || status=1
}

has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

echo "source $SPEC (synthetic: random weights generated on load), world size $W, TEST_LAYERS=$L, commit" \
     "$(git rev-parse --short HEAD 2>/dev/null)" | tee "$OUT/run.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpus.txt"

# plan: which modes fit (always computed: the later steps use it; written to plan.txt)
FIT=""
for m in $MODES; do
    $PY - "$SPEC" "$W" "$m" >> "$OUT/plan.txt" 2>&1 <<'PYEOF'
import sys

import torch

from dsv4.checkpoint import open_source
from dsv4.config import layers_from_env
from dsv4.memory_plan import rank_memory

spec, w, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = open_source(spec).args
args = args.with_layers(layers_from_env(args.n_layers))
GiB = 2 ** 30
peak = max(rank_memory(args, w, r, "bf16" if mode == "dequantized" else "quantized").peak for r in range(w))
have = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
fits = peak + 4 * GiB <= have
print(f"{spec} W={w} {mode}: plan peak {peak / GiB:.2f} GiB/rank + 4 GiB; GPU {have / GiB:.1f} GiB -> "
      f"{'fits' if fits else 'DOES NOT FIT: not run'}")
sys.exit(0 if fits else 3)
PYEOF
    rc=$?
    if [ "$rc" -eq 0 ]; then
        FIT="$FIT $m"
    elif [ "$rc" -ne 3 ]; then  # 3: does not fit (stated in plan.txt); anything else is an error
        echo "plan for $m failed (rc $rc): see plan.txt" | tee -a "$OUT/steps.txt"
        status=1
    fi
done
cat "$OUT/plan.txt"
FIT=${FIT# }
if [ -z "$FIT" ]; then
    echo "no weight mode fits (plan.txt); nothing to run" | tee -a "$OUT/steps.txt"
    exit 1
fi
echo "modes to run: $FIT" | tee -a "$OUT/run.txt"

if has diagnose; then
    for m in $FIT; do
        for b in $BACKENDS; do
            step "diagnose_w${W}_${m}_${b}" "${TORCHRUN[@]}" -m dsv4.cli diagnose --ckpt "$SPEC" --device cuda \
                --weights "$m" --backend "$b" --json "$OUT/diagnose_w${W}_${m}_${b}.json"
        done
    done
fi
if has final_norm; then
    case " $FIT " in
        *" dequantized "*) K="real" ;;                # both modes (the negative control loads quantized)
        *) K="real and not dequantized" ;;            # quantized runs and the negative control
    esac
    # one pytest per rank (every rank must run the same tests in the same order: the model's collectives);
    # --basetemp per rank so that the ranks never share pytest's temporary directories
    step "final_norm_w${W}" env DSV4_CKPT="$SPEC" "${TORCHRUN[@]}" --no-python bash -c \
        'exec "$0" -m pytest -q -rA -p no:cacheprovider --basetemp="$1/pytest.rank$RANK" \
             --junitxml="$1/final_norm.rank$RANK.xml" tests/gpu/test_final_norm.py -k "$2"' "$PY" "$OUT" "$K"
fi
if has measure; then
    step "measure_w${W}" $PY benchmarks/measure_real_width.py --ckpt "$SPEC" --world "$W" \
        --modes "$(echo "$FIT" | tr ' ' ',')" --decode-steps 8 --out "$OUT/measure"
fi
echo "== summary"
cat "$OUT/plan.txt" "$OUT/steps.txt"
exit $status
