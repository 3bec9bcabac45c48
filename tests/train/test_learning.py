"""The learning check: on the synthetic market with a planted edge, a short CPU run trades it profitably."""

from pathlib import Path

from fitdqn.config import load_config, with_overrides
from fitdqn.train.run import train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "synthetic_cpu.toml"


def test_learns_the_planted_edge_and_beats_the_baselines(tmp_path):
    config = with_overrides(load_config(EXAMPLE), {"train.eval_seeds": 3})
    report = train(config, tmp_path / "run")
    test = report["test"]
    assert test["agent"]["sharpe"] >= 1.0
    assert test["agent"]["sharpe"] > test["buy_and_hold"]["sharpe"]
    assert test["agent"]["sharpe"] > test["random"]["sharpe"]
    assert test["agent"]["total_return"] > max(test["buy_and_hold"]["total_return"], test["random"]["total_return"])
