"""A tiny walk-forward study (2 seeds x 2 folds, synthetic bars) through benchmarks/real_bars.py: member runs,
best-by-validation networks, the joint report, `fitdqn evaluate` on the study, and the report's form."""

import io
import json

import numpy as np
import pandas as pd
import pytest
import torch
from rich.console import Console
from support.benchmarks import load_benchmark

from fitdqn.cli import main as cli
from fitdqn.config import dump_config, load_config
from fitdqn.deploy import act_on_bars, export_policy, load_exported, load_run_policy
from fitdqn.evaluate.ensemble import EnsemblePolicy
from fitdqn.evaluate.metrics import bar_returns, sharpe_ratio
from fitdqn.train.run import print_report
from fitdqn.train.study import member_market


def load_script():
    return load_benchmark("real_bars")


def test_walk_forward_study_end_to_end(two_epoch_config, tmp_path, capsys):
    config = two_epoch_config()
    toml = tmp_path / "small.toml"
    toml.write_text(dump_config(config))
    out = tmp_path / "bench"
    record = load_script().main(["--data", "synthetic", "--seeds", "2", "--folds", "2", "--config", str(toml),
                                 "--out", str(out)])
    study_dir = out / "synthetic"
    summary = record["studies"]["synthetic"]
    # four member runs, each an ordinary run directory with its fold, its best network and its report
    members = json.loads((study_dir / "study.json").read_text())
    assert sorted((m["seed"], m["fold"]) for m in members) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    layout = summary["folds_layout"]
    assert layout[0]["test"][1] == layout[1]["test"][0] and layout[1]["test"][1] == 1200
    for m in members:
        run = study_dir / m["dir"]
        for name in ("best.pt", "checkpoint.pt", "fold.json", "report.json", "report.md", "test_pnl.csv",
                     "equity_test.png"):
            assert (run / name).is_file(), (run, name)
        report = json.loads((run / "report.json").read_text())
        fold = json.loads((run / "fold.json").read_text())
        assert report["test"]["bars"] == fold["test"][1] - fold["test"][0] - 1
        candidates = [(e, s) for e, s in report["selection"]["candidates"] if s is not None]
        best = max(candidates, key=lambda c: c[1])  # chosen on validation only
        assert report["selection"]["epoch"] == best[0] and report["selection"]["validation_sharpe"] == best[1]
        assert (m["selected_epoch"], m["validation_sharpe"], m["test_sharpe"]) == (
            best[0], best[1], report["test"]["agent"]["sharpe"])  # what two studies compare member by member
        markdown = (run / "report.md").read_text()
        assert markdown.splitlines()[2].startswith("**Verdict.** On the test split")
        assert f"Run directory: {run}" in markdown.splitlines()[4] and markdown.rstrip().endswith(str(run))
        assert "Contract: generic" in markdown and "Account: capital" in markdown
        assert f"Code: fitdqn {report['code']['fitdqn']} (commit {report['code']['commit']})" in markdown
    # the joint report: pooled over folds, every baseline with an interval
    assert set(summary["pooled"]) == {"agent", "buy_and_hold", "sized_buy_and_hold", "ma_crossover",
                                      "time_series_momentum", "last_bar_momentum", "random"}
    assert summary["bars"] == sum(t[1] - t[0] - 1 for t in (f["test"] for f in layout))
    assert summary["pooled"]["agent"]["sharpe_ci"]["low"] <= summary["pooled"]["agent"]["sharpe"]
    assert "sharpe_minus_buy_and_hold" in summary["pooled"]["agent"]
    assert set(summary["pooled"]["agent"]["sharpe_minus_rules"]) == {"ma_crossover", "time_series_momentum",
                                                                     "last_bar_momentum", "sized_buy_and_hold"}
    assert "The best baseline sized by volatility as the agent is" in summary["verdict"]
    assert summary["pooled"]["agent"]["reality_check"]["baselines"] == ["buy_and_hold", "sized_buy_and_hold",
                                                                        "ma_crossover", "time_series_momentum",
                                                                        "last_bar_momentum"]
    assert "baselines at once" in summary["verdict"]
    # which code trained the members: every member's report says, and the study lists each version once
    assert summary["member_code"] == [json.loads((study_dir / members[0]["dir"] / "report.json").read_text())["code"]]
    assert set(summary["member_code"][0]) == {"fitdqn", "commit", "torch"}
    assert summary["verdict"].startswith("Across 2 seeds x 2 walk-forward folds")
    # the headline is the study's ensemble, each fold's from the members trained on that fold, beside the members
    assert summary["agent_book"] == "ensemble" and "the study's ensemble" in summary["verdict"]
    assert "seeds' average book" in summary["verdict"] and summary["average_book"]["sharpe"] is not None
    ensemble = pd.read_csv(study_dir / "ensemble_test_pnl.csv")
    capital = {m["fold"]: json.loads((study_dir / m["dir"] / "report.json").read_text())["test"]["capital"]
               for m in members}
    returns = np.concatenate([bar_returns(ensemble[ensemble["fold"] == f]["pnl"].to_numpy(), capital[f])
                              for f in (0, 1)])
    assert len(returns) == summary["bars"]
    assert summary["pooled"]["agent"]["sharpe"] == pytest.approx(sharpe_ratio(returns, summary["periods_per_year"]))
    assert [f["agent_book_sharpe"] is not None for f in summary["per_fold"]] == [True, True]
    check_study_policy(study_dir, ensemble[ensemble["fold"] == 1], tmp_path)
    table = (out / "real_bars.md").read_text()
    assert "| synthetic | MA 50/200 |" in table and "| synthetic | last-bar momentum |" in table
    top = (study_dir / "report.md").read_text()
    assert top.splitlines()[2].startswith("**Verdict.** Across 2 seeds")
    # `fitdqn evaluate` on the study re-runs each member's best network on its own fold: the same figures
    assert cli(["evaluate", str(study_dir), "--device", "cpu"]) == 0
    again = json.loads((study_dir / "evaluate_test.json").read_text())
    assert again["pooled"]["agent"]["sharpe"] == pytest.approx(summary["pooled"]["agent"]["sharpe"])
    assert again["pooled"]["ma_crossover"] == summary["pooled"]["ma_crossover"]
    assert "Across 2 seeds x 2 walk-forward folds" in capsys.readouterr().out
    member = study_dir / members[0]["dir"]
    # a member is an ordinary run on its fold's bars: `fitdqn train --resume MEMBER` stays on that fold
    member_config = load_config(member / "config.toml")
    assert (member_config.evaluate.seeds, member_config.evaluate.folds) == (1, 1)
    view = member_market(member_config, member)
    assert [view.splits[k].stop for k in ("train", "validation", "test")] == [layout[0][k][1] for k in (
        "train", "validation", "test")]
    (member / "best.pt").unlink()
    assert cli(["evaluate", str(member), "--device", "cpu", "--split", "validation"]) == 2
    assert "--network last" in capsys.readouterr().err
    assert cli(["evaluate", str(member), "--device", "cpu", "--network", "last"]) == 0
    assert json.loads((member / "evaluate_test.json").read_text())["network"] == "last"


def check_study_policy(study_dir, latest, tmp_path):
    """`act` and `export` on a study: the ensemble of its latest fold, the one its report's last fold traded."""
    policy = load_run_policy(study_dir, "cpu")
    assert len(policy.members) == 2 and all(d.name == "fold_1" for d in policy.member_dirs)
    member = policy.member_dirs[0]
    view = member_market(load_config(member / "config.toml"), member)
    first = view.first_bar("test", policy.config.net.window)
    frame = act_on_bars(policy, view.bars, start=view.bars["timestamp"].iloc[first])
    n = len(latest)
    assert len(frame) == n + 1  # and the decision at the last bar, to trade at the next open
    # the decisions from the fold's first test bar are the ensemble's test backtest (its last step liquidates)
    np.testing.assert_allclose(frame["pnl"].to_numpy()[:n - 1], latest["pnl"].to_numpy()[:n - 1], rtol=1e-6,
                               atol=1e-6)
    assert len(np.unique(frame["target"])) > 2  # positions between the members' levels: the mean of two
    program, meta = load_exported(export_policy(policy, tmp_path / "ensemble.pt2"))
    obs = torch.randn(9, policy.config.net.window, policy.learner.state_dim)
    actions, q = program.module()(obs)
    assert torch.equal(actions, EnsemblePolicy(policy.members, policy.member_levels())(obs))
    assert q.shape == (9, 2, 3, 5) and meta["branches"]["target_contracts"] == policy.levels()
    assert meta["ensemble"]["members"] == [str(d) for d in policy.member_dirs]
    assert cli(["act", str(study_dir), "--data", "synthetic", "--out", str(tmp_path / "actions.csv")]) == 0


def test_printed_reports_do_not_wrap_in_a_pipe():
    long_row = "| " + " | ".join(f"column {i}" for i in range(14)) + " |"
    assert len(long_row) > 120
    pipe = io.StringIO()
    print_report(Console(file=pipe, width=80), f"# title\n\n{long_row}\n")
    assert pipe.getvalue().splitlines() == ["# title", "", long_row]


def test_two_studies_compare_member_by_member():
    def record(members):
        return {"studies": {"sp500": {"members": [
            {"seed": seed, "fold": fold, "validation_sharpe": v, "test_sharpe": t} for seed, fold, v, t in members]}}}

    first = record([(0, 0, 1.0, 0.5), (0, 1, 0.25, None), (1, 0, 2.0, 1.0)])
    second = record([(1, 0, 1.5, 1.5), (0, 0, 0.5, 0.0), (0, 1, 0.5, 0.5)])  # another order: matched by key
    comparison = load_script().paired(first, second)["sp500"]
    # validation: 0.5, -0.25, 0.5 -> mean 0.25, s.d. 0.433, s.e. 0.25; test: 0.5, -0.5 (one pair without a test)
    assert comparison["validation_sharpe"] == {"pairs": 3, "mean": 0.25, "standard_error": pytest.approx(0.25),
                                               "above": 2}
    assert comparison["test_sharpe"] == {"pairs": 2, "mean": 0.0, "standard_error": pytest.approx(0.5), "above": 1}
