"""The rule baselines in one pass: a sequential env of P x K envs (P rules, K segments each) gives every rule the
Backtest of its own :func:`run_backtest` pass bit for bit; the random baseline keeps its own passes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from support.env import env_config

import fitdqn.evaluate.backtest as backtest_module
from fitdqn.config import Config, with_overrides
from fitdqn.evaluate.backtest import BarRule, SplitSizes, evaluate_policy, evaluate_rules, segment_layout
from fitdqn.evaluate.baselines import random_policy, rule_policies
from fitdqn.evaluate.compare import evaluate_split
from fitdqn.market.contract import ContractSpec
from fitdqn.market.data import normalise_bars, synthetic_bars
from fitdqn.market.env import FuturesEnv
from fitdqn.market.loader import load_market, market_from_bars

SIZES = dict(window=8, max_contracts=2, reward_scale=1e-3, reward="pnl", risk_penalty=0.0, target_volatility=0.0,
             branches=(5, 5, 5))
FIELDS = ("decision_bar", "timestamp", "pnl", "cost", "reward", "target", "position", "traded", "exit", "equity",
          "buy_and_hold")
# a currency pair's hourly bars near 1.1: a contract unlike the default index future (multiplier, tick, costs)
FX = ContractSpec("fx-test", multiplier=125_000.0, tick_size=0.00005, commission=3.1, slippage_ticks=1.0)


def small_synthetic():
    config = with_overrides(Config(), {"market.data": "synthetic", "market.synthetic_bars": 3000})
    return load_market(config.market, window=8)


def fx_market():
    """A CSV-like frame (text-free but user-shaped: Date/Open/High/Low/Close/Volume, hourly stamps) scaled to 1.1."""
    raw = synthetic_bars(2500, 0.3, 7)
    scale = 1.1 / float(raw["close"].iloc[0])
    frame = pd.DataFrame({
        "Date": pd.date_range("2017-01-13", periods=len(raw), freq="h"),
        **{c.capitalize(): (raw[c] * scale).round(5) for c in ("open", "high", "low", "close")},
        "Volume": raw["volume"],
    })
    bars = normalise_bars(frame, "fx.csv", date_format="auto")
    return market_from_bars(bars, FX, train_fraction=0.6, validation_fraction=0.2, name="fx")


def stop_and_take_rule(market, seed):
    """Every sub-action drawn in advance (stops and take-profits fire inside episodes)."""
    g = torch.Generator().manual_seed(seed)
    T = market.prices.shape[0]
    actions = torch.stack([torch.randint(0, 5, (T,), generator=g) for _ in range(3)], dim=1)  # [T, 3]
    return BarRule(f"draw{seed}", actions)


def assert_same(batched, lone):
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(batched, name), getattr(lone, name), err_msg=name)
    assert batched.segments == lone.segments and batched.split == lone.split
    assert batched.hold_contracts == lone.hold_contracts and batched.contract == lone.contract


@pytest.fixture(scope="module")
def markets():
    return {"synthetic": small_synthetic(), "fx": fx_market()}


@pytest.mark.parametrize("name", ["synthetic", "fx"])
@pytest.mark.parametrize("segments", [3, 64])
def test_one_pass_equals_each_rules_own_pass(markets, name, segments):
    market = markets[name]
    rules = [*rule_policies(market, with_overrides(Config(), {"evaluate.ma_slow": 100}), 252.0).values(),
             stop_and_take_rule(market, 0), stop_and_take_rule(market, 1)]
    for split in ("validation", "test"):
        sizes = SplitSizes(env_config(episode_length=32, **SIZES), segments=segments)
        batched = evaluate_rules(rules, market, split, sizes)
        assert len(batched) == len(rules)
        for rule, bt in zip(rules, batched, strict=True):
            assert_same(bt, evaluate_policy(rule, market, split, sizes))
        assert (batched[-1].exit == 1).any() and (batched[-1].exit == 2).any()  # stops and take-profits fired
        assert len({bt.pnl.tobytes() for bt in batched}) == len(rules)  # each rule got its own actions


@pytest.mark.parametrize("segments", [4, 40, 64, 1024])
def test_passes_never_step_more_envs_than_segments(monkeypatch, markets, segments):
    market = markets["synthetic"]
    rules = [stop_and_take_rule(market, s) for s in range(5)]
    built = []
    original = FuturesEnv.from_config

    def spy(*args, **kwargs):
        built.append(kwargs["num_envs"])
        return original(*args, **kwargs)

    monkeypatch.setattr(backtest_module.FuturesEnv, "from_config", spy)
    steps = market.splits["test"].stop - 1 - market.first_bar("test", 8)
    K, _ = segment_layout(steps, 32, segments)
    sizes = SplitSizes(env_config(episode_length=32, **SIZES), segments=segments)
    batched = evaluate_rules(rules, market, "test", sizes)
    monkeypatch.undo()
    per_pass = segments // K
    assert len(built) == -(-len(rules) // per_pass) and max(built) <= segments and sum(built) == len(rules) * K
    assert len(built) == {4: 5, 40: 3, 64: 2, 1024: 1}[segments]  # K = 4, 15, 15, 15 (15 episodes)
    for rule, bt in zip(rules, batched, strict=True):
        assert_same(bt, evaluate_policy(rule, market, "test", sizes))


def test_evaluate_split_keeps_every_baseline_figure(two_epoch_config):
    """The report's rules are their lone passes' numbers and the random baseline is its seeds' own passes."""
    from fitdqn.evaluate.backtest import evaluate_config
    from fitdqn.evaluate.metrics import trading_metrics
    from fitdqn.learn.learner import Learner

    config = two_epoch_config(**{"market.synthetic_bars": 3000, "evaluate.bootstrap_samples": 100})
    market = load_market(config.market, window=config.net.window)
    from fitdqn.resolve import resolve_for_market

    config, _ = resolve_for_market(config, market)
    learner = Learner(config, FuturesEnv.from_config(config, "train", market=market, num_envs=1).state_dim, "cpu")
    result = evaluate_split(learner, market, config, "test")
    capital, per_year = result.results["capital"], market.bars_per_year
    for name, rule in rule_policies(market, config, per_year).items():
        lone = evaluate_config(rule, config, "test", market=market)
        np.testing.assert_array_equal(result.pnl[name], lone.pnl)
        expected = trading_metrics(lone.pnl, lone.position, capital, per_year).to_json()
        assert {k: result.results[name][k] for k in expected} == expected
    runs = [evaluate_config(random_policy(config.net.branches, 1000 + s, market.device), config, "test",
                            market=market) for s in range(config.train.eval_seeds)]
    np.testing.assert_array_equal(result.pnl["random"], np.mean([r.pnl for r in runs], axis=0))
    # the agent against every rule on the same bars: the paired bootstrap of the two P&L series
    from fitdqn.evaluate.bootstrap import bootstrap_sharpe
    from fitdqn.evaluate.metrics import bar_returns

    e = config.evaluate
    agent = bar_returns(result.pnl["agent"], capital)
    differences = result.results["agent"]["sharpe_minus_rules"]
    assert set(differences) == set(rule_policies(market, config, per_year))
    for name, diff in differences.items():
        expected = bootstrap_sharpe(agent, per_year, baseline=bar_returns(result.pnl[name], capital),
                                    samples=e.bootstrap_samples, block_length=e.block_length,
                                    confidence=e.confidence, seed=e.bootstrap_seed).to_json()
        assert diff == expected
    assert "sharpe_minus_rules" not in result.results["ma_crossover"]


def test_like_for_like_baselines_and_the_rules_that_cannot_run(two_epoch_config):
    from fitdqn.evaluate.backtest import evaluate_config
    """Volatility sizing: a buy-and-hold through the env at the largest long level, sized as the agent's positions
    are; a rule whose lookback the data cannot give before the split's first decision is n/a, not a flat row."""
    from fitdqn.evaluate.baselines import SIZED_HOLD, not_applicable
    from fitdqn.learn.learner import Learner
    from fitdqn.market.env import position_size
    from fitdqn.resolve import resolve_for_market

    config = two_epoch_config(**{"market.synthetic_bars": 3000, "evaluate.bootstrap_samples": 100,
                             "evaluate.momentum_years": 50.0})
    market = load_market(config.market, window=config.net.window)
    config, _ = resolve_for_market(config, market)
    per_year = market.bars_per_year
    first = market.first_bar("test", config.net.window)
    assert round(50 * per_year) > first  # the lookback is longer than the history before the test split
    reasons = not_applicable(market, config, per_year, "test")
    assert set(reasons) == {"time_series_momentum"}
    assert reasons["time_series_momentum"].endswith(f"before its first decision; the data have {first}")
    learner = Learner(config, FuturesEnv.from_config(config, "train", market=market, num_envs=1).state_dim, "cpu")
    result = evaluate_split(learner, market, config, "test")
    assert result.results["not_applicable"] == reasons
    assert "time_series_momentum" not in result.results["policies"] and "time_series_momentum" not in result.pnl
    assert "time_series_momentum" not in result.results["agent"]["sharpe_minus_rules"]
    tested = result.results["agent"]["reality_check"]["baselines"]
    assert tested == [n for n in result.pnl if n not in ("agent", "random")]
    # the sized buy-and-hold: long at every bar, max_contracts x the env's volatility size of the decision bar
    hold = evaluate_config(rule_policies(market, config, per_year)[SIZED_HOLD], config, "test", market=market)
    bars = torch.as_tensor(hold.decision_bar)
    size = position_size(market.atr[bars], market.prices[bars, 3], market.contract.tick_size,
                         config.market.target_volatility)
    np.testing.assert_allclose(hold.target, config.market.max_contracts * size.double().numpy(), rtol=1e-6)
    assert (size < 1).any() and (hold.target > 0).all()
    np.testing.assert_array_equal(result.pnl[SIZED_HOLD], hold.pnl)
    contracts = two_epoch_config(**{"market.position_sizing": "contracts"})
    assert SIZED_HOLD not in rule_policies(market, contracts, per_year)  # whole contracts: the plain one is
