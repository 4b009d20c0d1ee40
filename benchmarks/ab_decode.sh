#!/bin/bash
# Decode-only A/B (issue 27): base tree (.bases/$1) vs this tree, alternated $2 times (default 1); per-layer rows of
# bench_model (4 and 8 layers, batch 1 / 8 / 32, CUDA-graph decode at 4096 context) into $OUT/{base,head}N.md.
B=$1
ARGS="--geometry flash --flash-layers 4,8 --prefill '' --batches 1,8,32 --reps 7 --warmup 2 --backends triton"
for n in $(seq 1 ${2:-1}); do
  for t in base head; do
    if [ $t = base ]; then d=.bases/$B; c=$B; else d=.; c=$DSV4_COMMIT; fi
    (cd $d && eval DSV4_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout ${3:-200} python3 benchmarks/bench_model.py $ARGS \
      --markdown $OUT/$t$n.md > $OUT/$t$n.log 2>&1; echo "$t$n rc=$?")
    grep -A 8 "per layer" $OUT/$t$n.md | head -9
  done
done
