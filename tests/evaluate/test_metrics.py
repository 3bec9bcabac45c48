import math

import numpy as np
import pytest

from fitdqn.evaluate.metrics import bar_returns, drawdown, equity_curve, round_trips, sharpe_ratio, trading_metrics


def test_equity_and_drawdown_known_values():
    equity = equity_curve(np.array([10.0, -20.0, 5.0, 30.0]), 100.0)
    assert equity.tolist() == [100.0, 110.0, 90.0, 95.0, 125.0]
    assert drawdown(equity).tolist() == pytest.approx([0, 0, 20 / 110, 15 / 110, 0])


def test_round_trips_split_on_sign_changes():
    positions = np.array([0, 1, 2, 2, -1, -1, 0, 1])
    pnl = np.array([0.0, 1, 2, -1, 3, -5, 0, 4])
    assert round_trips(positions, pnl) == [2.0, -2.0, 4.0]


def test_metrics_against_direct_formulas():
    rng = np.random.default_rng(0)
    pnl = rng.normal(5.0, 100.0, 500)
    positions = rng.integers(-2, 3, 500)
    capital = 100_000.0
    m = trading_metrics(pnl, positions, capital, 252.0)
    equity = capital + np.concatenate([[0], np.cumsum(pnl)])
    r = equity[1:] / equity[:-1] - 1
    assert m.total_return == pytest.approx(equity[-1] / capital - 1)
    assert m.sharpe == pytest.approx(math.sqrt(252) * r.mean() / r.std(ddof=1))
    assert m.sortino == pytest.approx(math.sqrt(252) * r.mean() / math.sqrt(np.mean(np.minimum(r, 0) ** 2)))
    peak = np.maximum.accumulate(equity)
    assert m.max_drawdown == pytest.approx(((peak - equity) / peak).max())
    assert m.turnover == pytest.approx(np.abs(np.diff(np.r_[0, positions])).sum() / 500)


def test_flat_policy_has_zero_everything():
    m = trading_metrics(np.zeros(100), np.zeros(100), 1000.0, 252.0)
    assert (m.total_return, m.sharpe, m.max_drawdown, m.trades, m.win_rate) == (0, 0, 0, 0, 0)


def test_equity_at_or_below_zero_ends_the_backtest_without_a_sharpe():
    pnl = np.array([10.0, -60.0, -60.0, 500.0, 5.0])  # equity 100 -> 110, 50, -10 (ruined at step 3)
    m = trading_metrics(pnl, np.ones(5), 100.0, 252.0)
    assert m.ruined_at == 3 and m.bars == 3
    assert m.total_return == pytest.approx(-1.1)
    assert m.sharpe != m.sharpe and m.to_json()["sharpe"] is None  # nan -> None, never a figure like -37
    assert m.to_json()["sortino"] is None and m.to_json()["calmar"] is None
    assert bar_returns(pnl, 100.0).tolist() == pytest.approx([0.1, -60 / 110, -60 / 50])
    exactly_zero = trading_metrics(np.array([-100.0, 50.0]), np.ones(2), 100.0, 252.0)
    assert exactly_zero.ruined_at == 1 and exactly_zero.to_json()["sharpe"] is None
    assert trading_metrics(pnl[:2], np.ones(2), 100.0, 252.0).ruined_at is None


def test_sharpe_ratio_edge_cases():
    assert sharpe_ratio(np.full(10, 0.001), 252.0) == math.inf
    assert sharpe_ratio(np.zeros(10), 252.0) == 0.0
    assert sharpe_ratio(np.array([0.01, -0.01, 0.02, 0.0]), 1.0) == pytest.approx(0.005 / np.std(
        [0.01, -0.01, 0.02, 0.0], ddof=1))
