"""Trading metrics of a backtest: from per-bar P&L and positions to the numbers a trader reads.

Returns are per bar on the account's equity (``capital`` plus the cumulative net P&L: fixed contracts, no
compounding). An account whose equity reaches zero or below is ruined: the backtest ends at that bar, the
return is what was lost, and Sharpe, Sortino and Calmar are not defined (``None`` in JSON) instead of the
meaningless figures a near-zero denominator gives.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class TradingMetrics:
    total_return: float  # final equity / initial capital - 1
    sharpe: float  # annualised, from per-bar returns (nan when ruined)
    sortino: float  # annualised, downside deviation of per-bar returns (nan when ruined)
    max_drawdown: float  # largest peak-to-trough fall of equity, as a fraction of the peak (>= 0)
    calmar: float  # annualised return / max drawdown (nan when ruined)
    turnover: float  # contracts traded per bar
    trades: int  # round trips closed
    win_rate: float  # share of closed round trips with positive P&L
    bars: int  # bars the metrics cover (up to the ruin bar when ruined)
    ruined_at: int | None  # step at which equity reached <= 0 (the backtest ends there); None if never

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def equity_curve(pnl: np.ndarray, capital: float) -> np.ndarray:
    """[T] per-bar P&L (currency) -> [T + 1] equity starting at ``capital``."""
    return capital + np.concatenate([[0.0], np.cumsum(pnl, dtype=np.float64)])


def ruin_step(equity: np.ndarray) -> int | None:
    """The first k >= 1 with ``equity[k] <= 0`` (the step that wiped the account out), or None."""
    hits = np.flatnonzero(np.asarray(equity)[1:] <= 0)
    return int(hits[0]) + 1 if hits.size else None


def bar_returns(pnl: np.ndarray, capital: float) -> np.ndarray:
    """[T'] per-bar returns on equity, ending at the ruin bar when equity reaches 0 (T' <= T)."""
    equity = equity_curve(np.asarray(pnl, dtype=np.float64), capital)
    ruin = ruin_step(equity)
    if ruin is not None:
        equity = equity[: ruin + 1]
    return np.diff(equity) / equity[:-1]


def sharpe_ratio(returns: np.ndarray, periods_per_year: float) -> float:
    """Annualised Sharpe of per-bar returns (ddof 1); +-inf for a constant non-zero series, 0 for zeros."""
    returns = np.asarray(returns, dtype=np.float64)
    if len(returns) < 2:
        return 0.0
    mean, std = returns.mean(), returns.std(ddof=1)
    if std <= 1e-15 * max(abs(mean), 1e-300):
        return 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return float(math.sqrt(periods_per_year) * mean / std)


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


def trading_metrics(pnl: np.ndarray, positions: np.ndarray, capital: float, periods_per_year: float
                    ) -> TradingMetrics:
    """All metrics of one backtest. pnl [T] net of costs (currency), positions [T] contracts held."""
    pnl = np.asarray(pnl, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.float64)
    equity = equity_curve(pnl, capital)
    ruin = ruin_step(equity)
    if ruin is not None:  # the account is gone: the backtest ends at that bar
        pnl, positions, equity = pnl[:ruin], positions[:ruin], equity[: ruin + 1]
    returns = np.diff(equity) / equity[:-1]
    downside = np.sqrt(np.mean(np.minimum(returns, 0.0) ** 2)) if len(returns) else 0.0
    annual = math.sqrt(periods_per_year)
    max_dd = float(drawdown(equity).max()) if len(equity) else 0.0
    years = max(len(pnl) / periods_per_year, 1e-9)
    final_ratio = max(equity[-1] / capital, 1e-12)
    annual_return = final_ratio ** (1.0 / years) - 1.0
    trips = round_trips(positions, pnl)
    changes = np.abs(np.diff(np.concatenate([[0.0], positions])))
    undefined = math.nan if ruin is not None else None
    return TradingMetrics(
        total_return=float(equity[-1] / capital - 1.0),
        sharpe=undefined if undefined is not None else sharpe_ratio(returns, periods_per_year),
        sortino=undefined if undefined is not None else (float(annual * returns.mean() / downside)
                                                         if downside > 0 else 0.0),
        max_drawdown=max_dd,
        calmar=undefined if undefined is not None else (float(annual_return / max_dd) if max_dd > 0 else 0.0),
        turnover=float(changes.sum() / max(len(positions), 1)),
        trades=len(trips),
        win_rate=float(np.mean([t > 0 for t in trips])) if trips else 0.0,
        bars=int(len(pnl)),
        ruined_at=ruin,
    )
