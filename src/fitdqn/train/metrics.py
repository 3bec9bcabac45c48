"""Trading metrics of a backtest: from per-bar P&L and positions to the numbers a trader reads."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class TradingMetrics:
    total_return: float  # final equity / initial capital - 1
    sharpe: float  # annualised, from per-bar returns
    sortino: float  # annualised, downside deviation of per-bar returns
    max_drawdown: float  # largest peak-to-trough fall of equity, as a fraction of the peak (>= 0)
    calmar: float  # annualised return / max drawdown
    turnover: float  # contracts traded per bar
    trades: int  # round trips closed
    win_rate: float  # share of closed round trips with positive P&L

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def equity_curve(pnl: np.ndarray, capital: float) -> np.ndarray:
    """[T] per-bar P&L (currency) -> [T + 1] equity starting at ``capital``."""
    return capital + np.concatenate([[0.0], np.cumsum(pnl, dtype=np.float64)])


def drawdown(equity: np.ndarray) -> np.ndarray:
    """[T] fraction below the running peak (0 at a new high)."""
    peak = np.maximum.accumulate(equity)
    return np.where(peak > 0, (peak - equity) / np.where(peak > 0, peak, 1.0), 0.0)


def round_trips(positions: np.ndarray, pnl: np.ndarray) -> list[float]:
    """P&L of each closed round trip: a run of bars with the same non-zero position sign.

    ``positions[t]`` is held over bar t and earns ``pnl[t]``; a trip closes when the sign changes.
    """
    trips, current, sign = [], 0.0, 0
    for position, bar_pnl in zip(np.sign(positions).astype(int), pnl, strict=True):
        if position != sign:
            if sign != 0:
                trips.append(current)
            current, sign = 0.0, position
        current += float(bar_pnl)
    if sign != 0:
        trips.append(current)
    return trips


def trading_metrics(pnl: np.ndarray, positions: np.ndarray, capital: float, periods_per_year: float = 252.0
                    ) -> TradingMetrics:
    """All metrics of one backtest. pnl [T] net of costs (currency), positions [T] contracts held."""
    pnl = np.asarray(pnl, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.float64)
    equity = equity_curve(pnl, capital)
    returns = np.diff(equity) / np.maximum(equity[:-1], 1e-9)
    mean, std = returns.mean() if len(returns) else 0.0, returns.std(ddof=1) if len(returns) > 1 else 0.0
    downside = np.sqrt(np.mean(np.minimum(returns, 0.0) ** 2)) if len(returns) else 0.0
    annual = math.sqrt(periods_per_year)
    max_dd = float(drawdown(equity).max()) if len(equity) else 0.0
    years = max(len(pnl) / periods_per_year, 1e-9)
    final_ratio = max(equity[-1] / capital, 1e-12)
    annual_return = final_ratio ** (1.0 / years) - 1.0
    trips = round_trips(positions, pnl)
    changes = np.abs(np.diff(np.concatenate([[0.0], positions])))
    return TradingMetrics(
        total_return=float(equity[-1] / capital - 1.0),
        sharpe=float(annual * mean / std) if std > 0 else 0.0,
        sortino=float(annual * mean / downside) if downside > 0 else 0.0,
        max_drawdown=max_dd,
        calmar=float(annual_return / max_dd) if max_dd > 0 else 0.0,
        turnover=float(changes.sum() / max(len(positions), 1)),
        trades=len(trips),
        win_rate=float(np.mean([t > 0 for t in trips])) if trips else 0.0,
    )
