#!/usr/bin/env bash
# The GPU checks of the learner and the plan, each part sized to one 10-minute call.
#
#   OUT=results_dir bash benchmarks/gpu_checks.sh tests    # the CUDA tests (about 5 min on an H100)
#   OUT=results_dir bash benchmarks/gpu_checks.sh sweep    # emulated cards 1.7 .. 80 GiB (about 5 min)
#   OUT=results_dir bash benchmarks/gpu_checks.sh ballast  # the same cards, emulated by a ballast process
#   OUT=results_dir bash benchmarks/gpu_checks.sh speed    # update times, kernel launch shapes, graph pool (about 4 min)
#   OUT=results_dir bash benchmarks/gpu_checks.sh pair REF # the update at git REF and at the working tree, in turn,
#                                                            twice (about 2 min): a change's speed on a noisy GPU
#
# Logs and JSON go to $OUT (default gpu_results/). Run from the repository root with fitdqn importable
# (installed, or PYTHONPATH=src). Each step has its own time limit, so one slow step cannot take the others down.
set -u
out=${OUT:-gpu_results}
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { echo; echo "=== $1 ($(date +%T))"; }
case "${1:-}" in
  tests)
    step "CUDA tests"
    # every file with CUDA cases (the Triton interpreter's cases are the CPU's: left out here)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 -k "not interpreter" tests/ops tests/nets \
      tests/learn tests/memory tests/plan tests/replay tests/device tests/market/test_market_env_cuda.py \
      tests/evaluate/test_backtest_graphs.py tests/train/test_resume.py tests/test_system.py \
      > "$out/gpu_tests.log" 2>&1
    tail -25 "$out/gpu_tests.log" ;;
  sweep)
    step "budget sweep"
    timeout 560 python3 benchmarks/budget_sweep.py --cards 1.7,2.5,4,8,16,24,40,80 --total-seconds 540 \
      --card-timeout 80 --out "$out/budget_sweep.json" > "$out/budget_sweep.log" 2>&1
    tail -14 "$out/budget_sweep.log" ;;
  ballast)
    step "budget sweep, ballast emulation"
    timeout 560 python3 benchmarks/budget_sweep.py --cards 1.7,2.5,4,8,16,24,40,80 --emulation ballast \
      --total-seconds 540 --card-timeout 80 --out "$out/budget_sweep_ballast.json" > "$out/budget_sweep_ballast.log" 2>&1
    tail -14 "$out/budget_sweep_ballast.log" ;;
  speed)
    step "update"
    timeout 150 python3 benchmarks/bench_update.py --batches 64,256,1024,2048,4096,8192,16384 --iters 30 \
      --warmup 5 --out "$out/update.json" > "$out/update.log" 2>&1
    tail -18 "$out/update.log"
    step "kernel launch shapes"
    timeout 90 python3 benchmarks/tune_kernels.py --out "$out/tune_kernels.json" > "$out/tune_kernels.log" 2>&1
    tail -3 "$out/tune_kernels.log"
    step "graph pool"
    timeout 150 python3 benchmarks/graph_pool_check.py --modes expandable --batches 1024,4096,8192,16384,32768 \
      --out "$out/graph_pool.json" > "$out/graph_pool.log" 2>&1
    tail -8 "$out/graph_pool.log" ;;
  pair)
    ref=$(git rev-parse --short "${2:?usage: gpu_checks.sh pair REF}") || exit 2
    step "update at $ref and at the working tree, in turn"
    base=$(mktemp -d)
    git archive "$ref" src benchmarks | tar -x -C "$base"
    for round in 1 2; do
      FITDQN_COMMIT=$ref PYTHONPATH="$base/src:$PYTHONPATH" timeout 90 python3 "$base/benchmarks/update_vs_compile.py" \
        --modes fitdqn --iters 100 --profile-batch 0 --out "$out/update_${ref}_$round.json" > "$out/update_${ref}_$round.log" 2>&1
      grep "^fitdqn" "$out/update_${ref}_$round.log" | tail -3
      timeout 90 python3 benchmarks/update_vs_compile.py --modes fitdqn --iters 100 --profile-batch 0 \
        --out "$out/update_head_$round.json" > "$out/update_head_$round.log" 2>&1
      grep "^fitdqn" "$out/update_head_$round.log" | tail -3
    done
    rm -rf "$base" ;;
  *)
    echo "usage: OUT=dir bash benchmarks/gpu_checks.sh tests|sweep|ballast|speed|pair REF" >&2
    exit 2 ;;
esac
