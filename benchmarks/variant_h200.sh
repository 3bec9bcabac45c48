#!/usr/bin/env bash
# A config variant against the defaults on one H200, from the repository root (BENCHMARKS.md):
#   VARIANT="market.position_sizing=volatility" SEEDS=10 OUT=results bash benchmarks/variant_h200.sh
#   1. the synthetic market: `benchmarks/learning.py run` of the defaults and of the variant, seeds 0 .. SEEDS-1,
#      all side by side (their seconds share the GPU), then `learning.py compare` (paired by seed; validation
#      chooses, the test split is shown);
#   2. with REAL=1, real bars beside them: `benchmarks/real_bars.py` of the variant on sp500 and nasdaq, 5 seeds x
#      3 walk-forward folds, one process per data set and seed, then the table.
# VARIANT holds one or more KEY=VALUE overrides separated by spaces. $OUT gets the bundles, the comparison and the
# real-bars table; the run logs go to $RUNS (default /tmp/variant_runs: only a few files come back from the GPU machine).
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-results}
RUNS=${RUNS:-/tmp/variant_runs}
SEEDS=${SEEDS:-10}
REAL=${REAL:-0}
VARIANT=${VARIANT:?set VARIANT, e.g. VARIANT=market.position_sizing=volatility}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 FITDQN_CACHE_DIR=/tmp/fitdqn_variant_cache
export FITDQN_COMMIT=${FITDQN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
sets=()
for kv in $VARIANT; do sets+=(--set "$kv"); done
start=$(date +%s)
# one run first, alone: it fills the plan/trace cache the others then share
timeout 200 python3 benchmarks/learning.py run --seed 0 --out "$RUNS/base_s0.json" > "$RUNS/base_s0.log" 2>&1
pids=()
for s in $(seq 0 $((SEEDS - 1))); do
  if [ "$s" != 0 ]; then
    timeout 400 python3 benchmarks/learning.py run --seed "$s" --out "$RUNS/base_s$s.json" > "$RUNS/base_s$s.log" 2>&1 &
    pids+=($!)
  fi
  timeout 400 python3 benchmarks/learning.py run --seed "$s" --out "$RUNS/variant_s$s.json" "${sets[@]}" \
    > "$RUNS/variant_s$s.log" 2>&1 & pids+=($!)
done
if [ "$REAL" = 1 ]; then
  for d in sp500 nasdaq; do
    for k in 0 1 2 3 4; do
      timeout 480 python3 benchmarks/real_bars.py --data "$d" --seeds 5 --folds 3 --only-seed "$k" "${sets[@]}" \
        --out "$RUNS/real_bars" > "$RUNS/real_${d}_$k.log" 2>&1 & pids+=($!)
    done
  done
fi
for p in "${pids[@]}"; do wait "$p"; done
echo "all runs: $(( $(date +%s) - start )) s" | tee "$OUT/timeline.txt"
python3 benchmarks/learning.py summary "$RUNS"/base_s*.json --bundle "$OUT/base_runs.json" > "$OUT/summary.txt" 2>&1
python3 benchmarks/learning.py summary "$RUNS"/variant_s*.json --bundle "$OUT/variant_runs.json" >> "$OUT/summary.txt" 2>&1
python3 benchmarks/learning.py compare --base "$OUT/base_runs.json" --variant "$OUT/variant_runs.json" \
  >> "$OUT/summary.txt" 2>&1
if [ "$REAL" = 1 ]; then
  timeout 120 python3 benchmarks/real_bars.py --data sp500,nasdaq --seeds 5 --folds 3 "${sets[@]}" \
    --out "$RUNS/real_bars" > "$OUT/real_bars.log" 2>&1
  cp "$RUNS/real_bars/real_bars.json" "$RUNS/real_bars/real_bars.md" "$OUT/" 2>/dev/null
fi
cat "$OUT/summary.txt" "$OUT/timeline.txt"
[ "$REAL" = 1 ] && cat "$OUT/real_bars.md"
tail -n 3 "$RUNS"/*.log | grep -i -B2 "error\|traceback" | head -40
