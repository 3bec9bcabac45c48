"""train.patience: a run ends once that many validation backtests in a row have not beaten the best so far; the
report is about the best and says the run stopped early."""

from __future__ import annotations

import json

from rich.console import Console

from fitdqn.train.logs import read_jsonl
from fitdqn.train.run import train, validations_since_best


def scores(*values):
    return [{"epoch": i + 1, "validation_sharpe": v} for i, v in enumerate(values)]


def test_validations_since_best_counts_after_the_first_of_equal_bests():
    assert validations_since_best([]) == 0
    assert validations_since_best(scores(1.0)) == 0
    assert validations_since_best(scores(1.0, 2.0, 1.5, 0.3)) == 2
    assert validations_since_best(scores(1.0, 2.0, 2.0)) == 1  # a tie does not replace the best (keep_best)
    assert validations_since_best(scores(None, None)) == 2  # nothing to beat: every one counts
    assert validations_since_best(scores(None, 0.5, None)) == 1
    # epochs without a validation do not count
    assert validations_since_best([*scores(1.0, 0.5), {"epoch": 3}, {"epoch": 4}]) == 1


def expected_stop(sharpes, patience, epochs):
    """The epoch the rule stops at, from the validation Sharpe of every epoch (eval_every = 1)."""
    for epoch in range(1, epochs + 1):
        if validations_since_best(scores(*sharpes[:epoch])) >= patience:
            return epoch
    return epochs


def test_a_run_stops_at_the_first_epoch_the_rule_says_and_reports_the_best(small_config, tmp_path):
    epochs, patience = 8, 1
    run = tmp_path / "early"
    report = train(small_config(**{"train.epochs": epochs, "train.eval_every": 1, "train.patience": patience}), run,
                   console=Console(quiet=True))
    records = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "epoch"]
    sharpes = [r["validation_sharpe"] for r in records]
    stop = expected_stop(sharpes, patience, epochs)
    assert len(records) == stop == report["epochs"]
    selection = json.loads((run / "report.json").read_text())["selection"]
    best = max((s, -i) for i, s in enumerate(sharpes) if s is not None)
    assert selection["epoch"] == -best[1] + 1  # the first of the best validation Sharpes
    assert bool(selection["stopped_early"]) == (stop < epochs)
    if stop < epochs:
        assert "stopped early" in (run / "report.md").read_text()


def test_patience_zero_runs_every_epoch(small_config, tmp_path):
    report = train(small_config(**{"train.epochs": 3, "train.eval_every": 1}), tmp_path / "all",
                   console=Console(quiet=True))
    assert report["epochs"] == 3
