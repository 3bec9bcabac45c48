"""benchmarks/time_to_skill.py on a small CPU run: the clock's chosen network is the run's, and its test Sharpe
is the final report's (the extra test backtests change nothing in the run)."""

from __future__ import annotations

import json

from support.benchmarks import load_benchmark
from support.small_run import SMALL_RUN


def load_bench():
    return load_benchmark("time_to_skill")


def test_time_to_skill_small_cpu_run(tmp_path):
    bench = load_bench()
    out = tmp_path / "tts.json"
    overrides = {**SMALL_RUN, "train.epochs": 4, "train.eval_every": 2}
    sets = [x for key, value in overrides.items() for x in ("--set", f"{key}={value}")]
    # threshold -100: any Sharpe counts, so skill is reached at the first validation backtest
    assert bench.main(["--seeds", "0", "--threshold", "-100", "--keep", str(tmp_path / "runs"), "--out", str(out),
                       *sets]) == 0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert [p["epoch"] for p in run["curve"]] == [2, 4]
    assert run["skill_epoch"] == 2 and 0 < run["time_to_skill_s"] <= run["curve"][-1]["seconds"] <= run["run_s"]
    last = run["curve"][-1]
    assert last["chosen_epoch"] == run["final_chosen_epoch"]
    assert abs(last["chosen_test_sharpe"] - run["final_test_sharpe"]) < 1e-9
    report = json.loads((tmp_path / "runs" / "seed_0" / "report.json").read_text())
    assert report["test"]["agent"]["sharpe"] == run["final_test_sharpe"]
