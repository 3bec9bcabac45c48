"""Backtests: buy-and-hold over a split, consecutive training-length episodes, the synthetic edge, and the
batched (segmented) backtest against the plain sequential pass and a bar-by-bar reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.env import env_config, market_env

from fitdqn.config import Config, with_overrides
from fitdqn.evaluate.backtest import BarRule, SplitSizes, evaluate_policy, run_backtest, segment_layout
from fitdqn.evaluate.baselines import rule_policies
from fitdqn.market.env import EXIT_EPISODE_END
from fitdqn.market.features import FEATURE_NAMES
from fitdqn.market.loader import load_market

FLAT, LONG1, LONG2, SHORT1, SHORT2 = 2, 3, 4, 1, 0
SIZES = dict(window=8, max_contracts=2, reward_scale=1e-3, reward="pnl", risk_penalty=0.0, target_volatility=0.0,
             branches=(5, 5, 5))


@pytest.fixture(scope="module")
def sp500_market():
    return load_market(Config().market, window=8)


def test_buy_and_hold_backtest_over_a_whole_split(sp500_market):
    market = sp500_market
    split = market.splits["test"]
    env = market_env(market, "test", episode_length=len(split), sequential=True)
    bt = run_backtest(env, lambda obs: torch.tensor([[LONG1, 0, 0]]), split="test", timestamps=None)
    assert len(bt) == split.stop - 1 - split.start and bt.decision_bar[0] == split.start
    p = market.prices.double().numpy()
    es = market.contract
    one = (p[split.stop - 1, 3] - p[split.start + 1, 0]) * es.multiplier - 2 * es.cost_per_side
    assert bt.equity[-1] == pytest.approx(one, rel=1e-5)
    # buy-and-hold holds the agent's largest position (market.max_contracts = 2)
    assert bt.hold_contracts == 2 and bt.buy_and_hold[-1] == pytest.approx(2 * one, rel=1e-9)
    np.testing.assert_allclose(bt.equity[1:-1], bt.buy_and_hold[1:-1] / 2, rtol=1e-4, atol=1.0)
    assert (bt.position == 1).all() and bt.exit[-1] == EXIT_EPISODE_END and bt.traded.sum() == 2


def test_evaluate_policy_runs_consecutive_training_length_episodes(sp500_market):
    market = sp500_market
    bt = evaluate_policy(lambda obs: torch.zeros((obs.shape[0], 3), dtype=torch.long) + torch.tensor([FLAT, 0, 0]),
                         market, "validation", SplitSizes(env_config(episode_length=100, **SIZES), segments=1))
    split = market.splits["validation"]
    assert len(bt) == len(split) - 1 and (bt.pnl == 0).all() and bt.equity[-1] == 0
    assert list(bt.decision_bar[:2]) == [split.start, split.start + 1]
    assert bt.timestamp[0] == market.bars["timestamp"].iloc[split.start + 1]


def follow_last_bar(obs):
    z = obs[:, -1, FEATURE_NAMES.index("ret_1")]
    target = torch.where(z > 0, LONG1, torch.where(z < 0, SHORT1, FLAT))
    return torch.stack([target, torch.zeros_like(target), torch.zeros_like(target)], dim=1)


def test_synthetic_edge_is_learnable_and_absent_without_signal():
    """The planted component: following the last bar's direction (a policy reading the ret_1 feature of the
    observation) earns a test Sharpe >= 1 after costs; with synthetic_signal = 0 it does not."""

    def sharpe(signal, seed):
        config = with_overrides(
            Config(), {"market.data": "synthetic", "market.synthetic_signal": signal, "market.seed": seed}
        )
        pnl = evaluate_policy(follow_last_bar, load_market(config.market, window=8), "test",
                              SplitSizes(env_config(episode_length=256, **SIZES), segments=64)).pnl
        return pnl.mean() / pnl.std() * np.sqrt(252)

    for seed in (0, 1):
        assert sharpe(0.3, seed) > 1.0
    assert abs(sharpe(0.0, 0)) < 1.0


def test_segment_layout_covers_every_step_with_whole_episodes():
    assert segment_layout(1000, 100, 1) == (1, 1000)
    assert segment_layout(1000, 100, 4) == (4, 300)  # 10 episodes: 3 + 3 + 3 + 1
    assert segment_layout(1000, 100, 64) == (10, 100)  # never more segments than episodes
    assert segment_layout(50, 100, 8) == (1, 50)
    for steps, length, cap in ((12345, 256, 7), (999, 10, 1000), (256, 256, 3)):
        count, per = segment_layout(steps, length, cap)
        assert count <= cap and per % length == 0 or count == 1
        assert count * per >= steps > (count - 1) * per


def sequential_reference(market, policy, split, episode_length):
    """The backtest as it was: one env, one decision per bar (the segmented run's parity reference)."""
    env = market_env(market, split, episode_length=episode_length, sequential=True, **SIZES)
    g = 0.5 * sum(env.goal_range)
    env.goal_range = (g, g)
    env.reset()
    pnl, position = [], []
    for _ in range(env.last_bar - env.first_bar):
        out = env.step(policy(env.observation()))
        pnl.append(float(out["pnl"][0]))
        position.append(float(out["position"][0]))
    return np.array(pnl), np.array(position)


@pytest.mark.parametrize("segments", [1, 3, 16])
def test_segmented_backtest_equals_the_bar_by_bar_pass(sp500_market, segments):
    """Segments of whole episodes start flat where the one-env pass starts those episodes: the same P&L and
    positions for a policy that reads only its own observation (here the last-bar rule on ret_1, with stops)."""
    def policy(obs):
        actions = follow_last_bar(obs)
        actions[:, 1] = 2  # a 1.5 ATR stop: exits inside episodes too
        return actions

    pnl, position = sequential_reference(sp500_market, policy, "validation", 64)
    bt = evaluate_policy(policy, sp500_market, "validation",
                         SplitSizes(env_config(episode_length=64, **SIZES), segments=segments))
    assert bt.segments == min(segments, -(-len(pnl) // 64))
    np.testing.assert_array_equal(bt.pnl, pnl)
    np.testing.assert_array_equal(bt.position, position)
    split = sp500_market.splits["validation"]
    assert list(bt.decision_bar) == list(range(split.start, split.stop - 1))


def test_bar_rules_run_without_observations_and_match_a_policy(sp500_market):
    config = Config()
    rules = rule_policies(sp500_market, config, 252.0)
    rule = rules["last_bar_momentum"]
    assert isinstance(rule, BarRule)
    close = sp500_market.prices[:, 3].double()

    config = env_config(episode_length=256, **SIZES)
    batched = evaluate_policy(rule, sp500_market, "test", SplitSizes(config, segments=8))
    one = evaluate_policy(rule, sp500_market, "test", SplitSizes(config, segments=1))
    np.testing.assert_array_equal(batched.pnl, one.pnl)
    bars = one.decision_bar
    expected = 2 * torch.sign(close[bars] - close[bars - 1]).numpy()
    np.testing.assert_array_equal(one.target, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_segmented_backtest_on_cuda_equals_the_cpu():
    config = with_overrides(Config(), {"market.data": "synthetic"})
    cpu_market = load_market(config.market, window=8)
    gpu_market = load_market(config.market, window=8, device="cuda")
    rule = rule_policies(cpu_market, config, 252.0)["ma_crossover"]
    cpu = evaluate_policy(rule, cpu_market, "test", SplitSizes(env_config(episode_length=256, **SIZES), segments=1))
    cuda = evaluate_policy(rule_policies(gpu_market, config, 252.0)["ma_crossover"], gpu_market, "test",
                           SplitSizes(env_config(episode_length=256, **SIZES), segments=1024))
    assert cuda.segments > 1
    np.testing.assert_array_equal(cuda.position, cpu.position)
    np.testing.assert_allclose(cuda.pnl, cpu.pnl, rtol=1e-5, atol=1e-2)
