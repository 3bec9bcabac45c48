#!/usr/bin/env bash
# A config variant against a base (the defaults, or BASE's overrides) on one H200, from the repository root
# (BENCHMARKS.md):
#   BASE="market.position_sizing=contracts" VARIANT="market.position_sizing=volatility" SEEDS=10 OUT=results \
#     bash benchmarks/variant_h200.sh
#   1. the synthetic market: `benchmarks/learning.py run` of the base and of the variant, seeds 0 .. SEEDS-1,
#      all side by side (their seconds share the GPU), then `learning.py compare` (paired by seed; validation
#      chooses, the test split is shown);
#   2. with REAL="variant base" (or one of them), real bars: `benchmarks/real_bars.py` of that config on sp500 and
#      nasdaq, 5 seeds x 3 walk-forward folds, one process per data set, seed and config, then the tables; with
#      SEEDS=0 only these.
# BASE and VARIANT hold KEY=VALUE overrides separated by spaces (BASE may be empty: the defaults). $OUT gets the bundles, the comparison and the
# real-bars table; the run logs go to $RUNS (default /tmp/variant_runs: only a few files come back from the GPU machine).
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-results}
RUNS=${RUNS:-/tmp/variant_runs}
SEEDS=${SEEDS:-10}
REAL=${REAL:-}
VARIANT=${VARIANT:?set VARIANT, e.g. VARIANT=market.position_sizing=volatility}
BASE=${BASE:-}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 FITDQN_CACHE_DIR=/tmp/fitdqn_variant_cache
export FITDQN_COMMIT=${FITDQN_COMMIT:-$(PYTHONPATH=src python3 -c "from fitdqn.provenance import code_commit; print(code_commit())")}
sets=()
for kv in $VARIANT; do sets+=(--set "$kv"); done
base_sets=()
for kv in $BASE; do base_sets+=(--set "$kv"); done
start=$(date +%s)
pids=()
# one run first, alone: it fills the plan/trace cache the others then share
[ "$SEEDS" -gt 0 ] && timeout 200 python3 benchmarks/learning.py run --seed 0 --out "$RUNS/base_s0.json" ${base_sets[@]+"${base_sets[@]}"} \
  > "$RUNS/base_s0.log" 2>&1
for s in $(seq 0 $((SEEDS - 1))); do
  if [ "$s" != 0 ]; then
    timeout 400 python3 benchmarks/learning.py run --seed "$s" --out "$RUNS/base_s$s.json" \
      ${base_sets[@]+"${base_sets[@]}"} > "$RUNS/base_s$s.log" 2>&1 &
    pids+=($!)
  fi
  timeout 400 python3 benchmarks/learning.py run --seed "$s" --out "$RUNS/variant_s$s.json" "${sets[@]}" \
    > "$RUNS/variant_s$s.log" 2>&1 & pids+=($!)
done
overrides() {  # the --set options of "variant" or "base"
  if [ "$1" = variant ]; then echo "${sets[@]}"; else echo ${base_sets[@]+"${base_sets[@]}"}; fi
}
for which in $REAL; do
  for d in sp500 nasdaq; do
    for k in 0 1 2 3 4; do
      timeout 540 python3 benchmarks/real_bars.py --data "$d" --seeds 5 --folds 3 --only-seed "$k" $(overrides "$which") \
        --out "$RUNS/real_$which" > "$RUNS/real_${which}_${d}_$k.log" 2>&1 & pids+=($!)
    done
  done
done
for p in "${pids[@]}"; do wait "$p"; done
echo "all runs: $(( $(date +%s) - start )) s" | tee "$OUT/timeline.txt"
: > "$OUT/summary.txt"
if [ "$SEEDS" -gt 0 ]; then
  python3 benchmarks/learning.py summary "$RUNS"/base_s*.json --bundle "$OUT/base_runs.json" >> "$OUT/summary.txt" 2>&1
  python3 benchmarks/learning.py summary "$RUNS"/variant_s*.json --bundle "$OUT/variant_runs.json" \
    >> "$OUT/summary.txt" 2>&1
  python3 benchmarks/learning.py compare --base "$OUT/base_runs.json" --variant "$OUT/variant_runs.json" \
    >> "$OUT/summary.txt" 2>&1
fi
for which in $REAL; do
  timeout 120 python3 benchmarks/real_bars.py --data sp500,nasdaq --seeds 5 --folds 3 $(overrides "$which") \
    --out "$RUNS/real_$which" > "$RUNS/real_$which.log" 2>&1
  cp "$RUNS/real_$which/real_bars.json" "$OUT/real_bars_$which.json" 2>/dev/null
  { echo "== real bars, $which"; cat "$RUNS/real_$which/real_bars.md"; } >> "$OUT/summary.txt" 2>&1
done
cat "$OUT/summary.txt" "$OUT/timeline.txt"
tail -n 3 "$RUNS"/*.log | grep -i -B2 "error\|traceback" | head -40
