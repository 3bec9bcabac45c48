"""benchmarks/learning.py summary and compare: run files and bundles read alike; a bundle keeps every run; pairs
by seed."""

from __future__ import annotations

import json

from support.benchmarks import load_benchmark


def fake_run(seed: int, agent: float) -> dict:
    sharpe = {"agent": agent, "buy_and_hold": 0.1, "random": -0.2, "momentum": 1.0}
    return {"seed": seed, "device": "cpu", "batch_size": 256, "updates": 10, "commit": "abc", "seconds": 2.0 + seed,
            "curve": [], "validation": dict(sharpe), "test": dict(sharpe)}


def test_bundle_round_trip(tmp_path, capsys):
    learning = load_benchmark("learning")
    paths = []
    for seed, agent in enumerate([1.0, 3.0, 2.0]):
        path = tmp_path / f"run_s{seed}.json"
        path.write_text(json.dumps(fake_run(seed, agent)))
        paths.append(str(path))
    bundle = tmp_path / "bundle" / "runs.json"
    learning.main(["summary", *paths, "--bundle", str(bundle)])
    from_files = capsys.readouterr().out
    runs = json.loads(bundle.read_text())
    assert [r["seed"] for r in runs] == [0, 1, 2]
    assert learning.read_runs([str(bundle), paths[0]])[3] == fake_run(0, 1.0)  # a bundle and a run file together
    learning.main(["summary", str(bundle)])
    assert capsys.readouterr().out == from_files  # the same table from the bundle
    assert "| test | agent | 2.00 | 1.00 .. 3.00 |" in from_files


def test_compare_pairs_by_seed(tmp_path, capsys):
    learning = load_benchmark("learning")
    base = [fake_run(seed, agent) for seed, agent in enumerate([1.0, 2.0, 3.0, 4.0])]
    variant = [fake_run(seed, agent) for seed, agent in [(3, 4.5), (1, 2.0), (2, 3.5), (7, 9.0)]]  # seed 7 unpaired
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "variant.json").write_text(json.dumps(variant))
    result = learning.paired(base, variant, "validation")
    assert result["seeds"] == 3 and result["positive"] == 2
    assert abs(result["mean"] - 1 / 3) < 1e-12  # differences 0, 0.5, 0.5
    assert abs(result["standard_error"] - (1 / 12) ** 0.5 / 3 ** 0.5) < 1e-12  # their stdev is sqrt(1/12)
    assert result["base_median"] == 3.0 and result["variant_median"] == 3.5
    learning.main(["compare", "--base", str(tmp_path / "base.json"), "--variant", str(tmp_path / "variant.json")])
    assert "| validation | 3 | 3.00 | 3.50 | +0.333 +- 0.167 | 2 |" in capsys.readouterr().out


def test_summary_counts_the_agent_minus_rule_intervals():
    learning = load_benchmark("learning")
    runs = [fake_run(seed, 2.0) for seed in range(3)]
    for run, (estimate, low, high) in zip(runs, [(0.5, 0.1, 0.9), (-0.2, -0.8, 0.4), (-0.6, -1.0, -0.1)],
                                          strict=True):
        run["test"]["agent_minus"] = {"last_bar_momentum": {"estimate": estimate, "low": low, "high": high}}
    assert learning.split_differences(runs, "test") == (
        "test: agent minus last_bar_momentum, median -0.20; intervals above zero 1, below 1, straddling 1 of 3")
    assert learning.split_differences(runs, "validation").startswith("validation: no agent-minus")
