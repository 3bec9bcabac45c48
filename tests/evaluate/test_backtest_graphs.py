"""Backtests as CUDA-graph replays (``fitdqn.evaluate.backtest_graphs``): equal to the eager passes (the agent, the
rules, the random baseline), the network read as it is at each backtest, and captured into the collector graph's
pool without growing it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rich.console import Console

from fitdqn.config import Config, for_device, with_overrides
from fitdqn.evaluate.backtest import SplitSizes, evaluate_policy, evaluate_rules
from fitdqn.evaluate.backtest_graphs import BacktestGraphs
from fitdqn.evaluate.baselines import greedy_policy, random_policy, rule_policies
from fitdqn.learn.learner import Learner
from fitdqn.market.layout import STATE_DIM
from fitdqn.market.loader import load_market
from fitdqn.resolve import resolve_for_market

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def setup():
    config = for_device(with_overrides(Config(), {"market.data": "synthetic"}), "cuda")
    market = load_market(config.market, window=config.net.window, device="cuda")
    config, _ = resolve_for_market(config, market)
    learner = Learner(config, STATE_DIM, torch.device("cuda"))
    return config, market, learner


def _same(a, b) -> None:
    for name in ("pnl", "position", "target", "exit", "decision_bar", "equity"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@pytest.mark.parametrize("network", ["online", "target"])
def test_graphed_backtests_equal_the_eager_one_and_read_the_network_as_it_is_then(setup, network):
    config, market, _ = setup
    config = with_overrides(config, {"evaluate.reported_network": network})
    learner = Learner(config, STATE_DIM, torch.device("cuda"))
    assert learner.evaluated is getattr(learner, network)
    sizes = SplitSizes.of_config(config, market)
    graphs = BacktestGraphs(torch.cuda.Stream())
    for split in ("validation", "test"):
        eager = evaluate_policy(greedy_policy(learner), market, split, sizes)
        first = evaluate_policy(greedy_policy(learner), market, split, sizes, runner=graphs, key="agent")  # captures
        again = evaluate_policy(greedy_policy(learner), market, split, sizes, runner=graphs, key="agent")  # replays
        _same(first, eager)
        _same(again, eager)
    with torch.no_grad():  # a new network, in place (as the optimizer changes it)
        for p in learner.evaluated.parameters():
            p.mul_(-1.5)
    eager = evaluate_policy(greedy_policy(learner), market, "validation", sizes)
    _same(evaluate_policy(greedy_policy(learner), market, "validation", sizes, runner=graphs, key="agent"), eager)
    assert len(graphs.passes) == 2


def test_graphed_rules_and_random_baselines_equal_their_eager_passes(setup):
    config, market, _ = setup
    sizes = SplitSizes.of_config(config, market)
    graphs = BacktestGraphs(torch.cuda.Stream())
    rules = list(rule_policies(market, config, market.bars_per_year).values())
    eager_rules = evaluate_rules(rules, market, "test", sizes)
    for _ in range(2):  # captured, then replayed
        for graphed, eager in zip(evaluate_rules(rules, market, "test", sizes, runner=graphs), eager_rules,
                                  strict=True):
            _same(graphed, eager)
    eager = evaluate_policy(random_policy(config.net.branches, 1000, market.device), market, "test", sizes)
    for _ in range(2):  # the generator reseeded at each start: the same draws as a fresh eager pass
        graphed = evaluate_policy(random_policy(config.net.branches, 1000, market.device), market, "test", sizes,
                                  runner=graphs, key="random 0")
        _same(graphed, eager)
    assert {key[0] for key in graphs.passes} == {"rules", "policy"}


def test_a_run_captures_its_backtests_into_the_collector_pool_without_growing_it(tmp_path):
    from fitdqn.train.run import train

    seen = {}
    config = with_overrides(Config(), {"market.data": "synthetic", "train.device": "cuda", "train.epochs": 2,
                                       "train.out": str(tmp_path / "run")})
    report = train(config, tmp_path / "run", console=Console(quiet=True),
                   trainer_hook=lambda trainer: seen.setdefault("trainer", trainer))
    graphs = seen["trainer"].backtests
    # the agent on validation (every epoch) and test; the rules and 3 random seeds on both (the report)
    assert {(key[0], key[1], key[3]) for key in graphs.passes} == {
        (kind, name, split) for split in ("validation", "test")
        for kind, name in [("policy", "agent"), ("rules", ("sized_buy_and_hold", "ma_crossover",
                                                            "time_series_momentum", "last_bar_momentum"))]
        + [("policy", f"random {s}") for s in range(3)]}
    assert all(graph is not None for _, _, graph in graphs.passes.values())
    assert graphs.grown_bytes == 0
    assert report["test"]["agent"]["sharpe"] is not None
