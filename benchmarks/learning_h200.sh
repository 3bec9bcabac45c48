#!/usr/bin/env bash
# "Does it learn" on one H200 (BENCHMARKS.md): the default synthetic run, seed 0 alone (its wall-clock time),
# then seeds 1 and 2 side by side with seeds 0-2 at batch 2048. Run from the repository root:
#   OUT=results bash benchmarks/learning_h200.sh
# then: python benchmarks/learning.py summary $OUT/h200_default_s*.json --plot curve.png
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FITDQN_COMMIT=${FITDQN_COMMIT:-$(git rev-parse --short HEAD)}
OUT=${OUT:-results}
mkdir -p "$OUT"
L="python3 benchmarks/learning.py run"
$L --seed 0 --out "$OUT/h200_default_s0.json" > "$OUT/d0.log" 2>&1
for s in 1 2; do $L --seed $s --out "$OUT/h200_default_s$s.json" > "$OUT/d$s.log" 2>&1 & done
for s in 0 1 2; do $L --seed $s --out "$OUT/h200_b2048_s$s.json" --set budget.batch_size=2048 > "$OUT/b$s.log" 2>&1 & done
wait
