"""The agent's backtests as CUDA-graph replays (``fitdqn.evaluate.backtest_graphs``): equal to the eager backtest,
the network read as it is at each backtest, and captured into the collector graph's pool without growing it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rich.console import Console

from fitdqn.config import Config, for_device, with_overrides
from fitdqn.evaluate.backtest import SplitSizes, evaluate_policy
from fitdqn.evaluate.backtest_graphs import BacktestGraphs
from fitdqn.evaluate.baselines import greedy_policy
from fitdqn.learn.learner import Learner
from fitdqn.market.env import STATE_DIM, resolve_reward
from fitdqn.market.loader import load_market

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def setup():
    config = for_device(with_overrides(Config(), {"market.data": "synthetic"}), "cuda")
    market = load_market(config.market, window=config.net.window, device="cuda")
    config, _ = resolve_reward(config, market)
    learner = Learner(config, STATE_DIM, torch.device("cuda"))
    return config, market, learner


def _same(a, b) -> None:
    for name in ("pnl", "position", "target", "exit", "decision_bar", "equity"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_graphed_backtests_equal_the_eager_one_and_read_the_network_as_it_is_then(setup):
    config, market, learner = setup
    sizes = SplitSizes.of_config(config, market)
    graphs = BacktestGraphs(greedy_policy(learner), torch.cuda.Stream())
    for split in ("validation", "test"):
        eager = evaluate_policy(greedy_policy(learner), market, split, sizes)
        first = graphs.backtest(market, split, sizes)  # captures
        again = graphs.backtest(market, split, sizes)  # replays only
        _same(first, eager)
        _same(again, eager)
    with torch.no_grad():  # a new network, in place (as the optimizer changes it)
        for p in learner.online.parameters():
            p.mul_(-1.5)
    eager = evaluate_policy(greedy_policy(learner), market, "validation", sizes)
    _same(graphs.backtest(market, "validation", sizes), eager)
    assert len(graphs.passes) == 2


def test_a_run_captures_its_backtests_into_the_collector_pool_without_growing_it(tmp_path):
    from fitdqn.train.run import train

    seen = {}
    config = with_overrides(Config(), {"market.data": "synthetic", "train.device": "cuda", "train.epochs": 2,
                                       "train.out": str(tmp_path / "run")})
    report = train(config, tmp_path / "run", console=Console(quiet=True),
                   trainer_hook=lambda trainer: seen.setdefault("trainer", trainer))
    graphs = seen["trainer"].backtests
    assert len(graphs.passes) == 2  # validation (every epoch) and the report's test split
    assert all(graph is not None for _, _, graph in graphs.passes.values())
    assert graphs.grown_bytes == 0
    assert report["test"]["agent"]["sharpe"] is not None
