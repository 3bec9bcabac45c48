"""Confidence intervals on Sharpe ratios: the stationary block bootstrap (Politis & Romano 1994).

Per-bar returns are serially dependent (volatility clusters, positions held for many bars), so resampling
single bars understates the uncertainty. The stationary bootstrap resamples blocks of geometric length
(mean ``block_length``), wrapping around the end of the series, which keeps the resampled series stationary.
The interval is the percentile interval of the resampled statistic. Paired statistics (the agent's Sharpe
minus buy-and-hold's) resample both series with the same indices, so what they share cancels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

CHUNK_ELEMENTS = 1 << 21  # resampled bars held at once (bounds memory for long series)


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap confidence interval."""

    estimate: float
    low: float
    high: float
    confidence: float
    samples: int
    block_length: float

    def excludes(self, value: float = 0.0) -> bool:
        """True when ``value`` lies outside the interval (the estimate is distinguishable from it)."""
        return bool(self.low > value or self.high < value)

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def auto_block_length(n: int) -> float:
    """Mean block length n^(1/3) (the rate that is optimal for the variance of a mean), at least 1."""
    return max(1.0, round(n ** (1.0 / 3.0)))


def stationary_indices(rng: np.random.Generator, n: int, block_length: float, count: int) -> np.ndarray:
    """[count, n] int64 resampling indices: blocks start uniformly at random, a new block begins at each bar
    with probability 1 / block_length, and a block runs on (wrapping at n) until the next one begins."""
    t = np.arange(n)
    new = rng.random((count, n)) < 1.0 / block_length  # [count, n] bool: a block begins here
    new[:, 0] = True
    starts = rng.integers(0, n, size=(count, n))  # [count, n] where a block beginning at t starts
    begun = np.maximum.accumulate(np.where(new, t, 0), axis=1)  # [count, n] bar where the current block began
    return (np.take_along_axis(starts, begun, axis=1) + t - begun) % n


def _sharpe_rows(x: np.ndarray, per_year: float) -> np.ndarray:
    """Annualised Sharpe of each row of ``x [c, n]`` (ddof 1; +-inf for constant non-zero rows)."""
    mean = x.mean(axis=1)
    std = x.std(axis=1, ddof=1)
    flat = std <= 1e-15 * np.maximum(np.abs(mean), 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = math.sqrt(per_year) * mean / np.where(flat, 1.0, std)
    return np.where(flat, np.where(mean == 0, 0.0, np.sign(mean) * np.inf), ratio)


def bootstrap_sharpe(
    returns: np.ndarray,
    periods_per_year: float,
    *,
    samples: int,
    block_length: float,
    confidence: float,
    seed: int,
    baseline: np.ndarray | None = None,
) -> Interval:
    """Bootstrap interval of the annualised Sharpe of ``returns [n]`` or, with ``baseline [n]`` (the same
    bars), of ``Sharpe(returns) - Sharpe(baseline)``. ``block_length <= 0``: :func:`auto_block_length`."""
    x = np.asarray(returns, dtype=np.float64)
    n = len(x)
    if baseline is not None:
        b = np.asarray(baseline, dtype=np.float64)
        if len(b) != n:
            raise ValueError(f"paired bootstrap needs series of one length, got {n} and {len(b)}")
    block = auto_block_length(n) if block_length <= 0 else float(block_length)

    def statistic(rows_x: np.ndarray, rows_b: np.ndarray | None) -> np.ndarray:
        s = _sharpe_rows(rows_x, periods_per_year)
        return s if rows_b is None else s - _sharpe_rows(rows_b, periods_per_year)

    estimate = float(statistic(x[None], None if baseline is None else b[None])[0])
    if n < 2:
        return Interval(estimate, math.nan, math.nan, confidence, 0, block)
    rng = np.random.default_rng(seed)
    chunk = max(1, CHUNK_ELEMENTS // n)
    values = []
    for first in range(0, samples, chunk):
        index = stationary_indices(rng, n, block, min(chunk, samples - first))  # [c, n]
        values.append(statistic(x[index], None if baseline is None else b[index]))
    stats = np.concatenate(values)
    stats = stats[~np.isnan(stats)]  # inf - inf (two constant series) has no sign
    if not stats.size:
        return Interval(estimate, math.nan, math.nan, confidence, int(samples), block)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail], method="inverted_cdf")  # no interpolation across inf
    return Interval(estimate, float(low), float(high), confidence, int(samples), block)
