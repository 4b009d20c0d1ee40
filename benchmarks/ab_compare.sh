#!/bin/bash
# A/B: base tree (.bases/$1) vs this tree, one alternation; then the GPU unit checks of the gemm / moe kernels
B=$1
ARGS="--geometry flash --flash-layers 4,8 --prefill 1024,4096 --batches 1,8,32 --reps 5 --warmup 2 --backends triton"
for t in base head; do
  if [ $t = base ]; then d=.bases/$B; c=$B; else d=.; c=$DSV4_COMMIT; fi
  (cd $d && DSV4_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 270 python3 benchmarks/bench_model.py $ARGS --markdown $OUT/$t.md > $OUT/$t.log 2>&1; echo "$t rc=$?")
  grep -A 12 "per layer" $OUT/$t.md | head -14
done
