#!/usr/bin/env bash
# "Does it learn" on one H200 (BENCHMARKS.md), from the repository root: OUT=results bash benchmarks/learning_h200.sh
#   1. `fitdqn train --data synthetic` with the defaults, seed 0 alone (its wall-clock time is a figure of the
#      code), then seeds 1 and 2 side by side with the batch-invariance runs;
#      (their wall clock shares the GPU: only seed 0's is a figure of the code; about 4-5 minutes in all)
#   2. batch invariance with the DEFAULT nets: the same config (so the same sample budget, train.sample_reuse x
#      env steps) at batch 2048 and 8192 beside the profile's 16384 (the default runs), seeds 0, 1, 2;
#   3. time to skill (benchmarks/time_to_skill.py), seeds 0, 1, 2 alone, and its learning-curve plot.
# Every run writes one JSON (benchmarks/learning.py run: test/validation Sharpe of the agent, buy-and-hold, random,
# last-bar momentum; wall seconds; updates; samples) and its log under $RUNS (default $OUT/runs); $OUT gets a few
# files only: all the runs in one JSON ($OUT/learning_runs.json), the summary ($OUT/summary.txt), the timeline and
# the time-to-skill results. Where only a few files come back (the device machine), set RUNS outside $OUT.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-results}
RUNS=${RUNS:-$OUT/runs}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 FITDQN_CACHE_DIR=/tmp/fitdqn_learning_cache
export FITDQN_COMMIT=${FITDQN_COMMIT:-$(PYTHONPATH=src python3 -c "from fitdqn.provenance import code_commit; print(code_commit())")}
L="python3 benchmarks/learning.py run"
start=$(date +%s)
# seed 0 alone, with a cold plan/trace cache (a first run's wall time, tracing included)
rm -rf "$FITDQN_CACHE_DIR"
timeout 170 $L --seed 0 --out "$RUNS/h200_default_s0.json" > "$RUNS/default_s0.log" 2>&1
echo "seed 0 alone: rc=$? $(( $(date +%s) - start )) s" | tee "$OUT/timeline.txt"
pids=()
for s in 1 2; do
  timeout 320 $L --seed $s --out "$RUNS/h200_default_s$s.json" > "$RUNS/default_s$s.log" 2>&1 & pids+=($!)
done
for b in 2048 8192; do
  for s in 0 1 2; do
    timeout 320 $L --seed $s --out "$RUNS/h200_b${b}_s$s.json" --set budget.batch_size=$b \
      > "$RUNS/b${b}_s$s.log" 2>&1 & pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p"; done
echo "all: $(( $(date +%s) - start )) s" | tee -a "$OUT/timeline.txt"
{
  echo "== defaults (profile batch), seeds 0 1 2"; python3 benchmarks/learning.py summary "$RUNS"/h200_default_s*.json
  for b in 2048 8192; do echo "== batch $b"; python3 benchmarks/learning.py summary "$RUNS"/h200_b${b}_s*.json; done
} > "$OUT/summary.txt" 2>&1
python3 benchmarks/learning.py summary "$RUNS"/h200_*.json --bundle "$OUT/learning_runs.json" > /dev/null
# 3. time to skill, seeds 0 1 2 one after another, alone on the GPU (warm caches: the runs above), with the curves
timeout 200 python3 benchmarks/time_to_skill.py --seeds 0,1,2 --out "$OUT/time_to_skill.json" \
  --plot "$OUT/time_to_skill.png" > "$OUT/time_to_skill.log" 2>&1
echo "time to skill: rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/timeline.txt"
cat "$OUT/summary.txt" "$OUT/timeline.txt"
tail -3 "$RUNS"/*.log "$OUT"/*.log | grep -i -B2 "error\|traceback" | head -40
