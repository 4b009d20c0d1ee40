#!/bin/bash
# A/B of the decode rows in one call: base tree (.bases/$1) and this tree alternated twice (bench_model, Flash, 4
# and 8 layers, decode b = 1 / 8 / 32 at 4096, CUDA graphs; no prefill); then the graph-replay layer profile of this
# tree. On the device tool's machine: PYTHONPATH=/tmp/site DSV4_COMMIT=<local HEAD> bash benchmarks/ab_decode2.sh <base>
B=$1
O=${OUT:-/tmp/ab}; mkdir -p "$O"
ARGS="--geometry flash --flash-layers 4,8 --prefill=${AB_PREFILL:-} --batches ${AB_BATCHES:-1,8,32} --reps 5 --warmup 2 --backends triton"
for t in base head base2 head2; do
  case $t in base*) d=.bases/$B; c=$B;; *) d=.; c=$DSV4_COMMIT;; esac
  (cd $d && DSV4_COMMIT=$c PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_model.py $ARGS \
     --markdown "$O/$t.md" > "$O/$t.log" 2>&1; echo "$t ($c) rc=$?")
  grep -A 8 "^| geometry | row | backend | per layer" "$O/$t.md" | grep -v "^|---"
done
