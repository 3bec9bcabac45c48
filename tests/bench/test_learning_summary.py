"""benchmarks/learning.py summary: run files and bundles of runs read alike; a bundle keeps every run."""

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
