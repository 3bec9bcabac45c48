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

from fitdqn.evaluate.metrics import sharpe_ratio

CHUNK_ELEMENTS = 1 << 21  # blocks held at once (bounds memory for long series)


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap confidence interval."""

    estimate: float
    low: float
    high: float
    confidence: float
    samples: int
    block_length: float

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def auto_block_length(n: int) -> float:
    """Mean block length n^(1/3) (the rate that is optimal for the variance of a mean), at least 1."""
    return max(1.0, round(n ** (1.0 / 3.0)))


def stationary_blocks(rng: np.random.Generator, n: int, block_length: float, count: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """``count`` resamples of ``n`` bars as blocks: (starts, lengths), each ``[count, m]`` int64. Starts are
    uniform in [0, n), lengths geometric with mean ``block_length``, the last block cut so each row's lengths
    sum to exactly n (blocks past it have length 0). Block b of a row covers bars ``start_b, start_b + 1, ...``
    wrapping at n: the stationary bootstrap of Politis & Romano."""
    m = int(n / block_length * 1.25) + 16  # blocks per row: enough for almost every row, topped up below
    lengths = rng.geometric(1.0 / block_length, size=(count, m))  # [count, m] >= 1
    while (lengths.sum(axis=1) < n).any():
        lengths = np.concatenate([lengths, rng.geometric(1.0 / block_length, size=(count, m))], axis=1)
    begun = np.cumsum(lengths, axis=1) - lengths  # [count, m'] bars before each block
    lengths = np.clip(n - begun, 0, lengths)  # the block crossing n is cut, later ones are empty
    starts = rng.integers(0, n, size=lengths.shape)
    return starts, lengths


class _Moments:
    """Sums of x and x^2 over any wrapped block of a series in O(1) (prefix sums of the series twice over)."""

    def __init__(self, x: np.ndarray) -> None:
        self.n = len(x)
        self.shift = float(x.mean())  # sums of x - shift: no cancellation when the mean is large
        twice = np.concatenate([x, x]) - self.shift  # [2n]
        self.s1 = np.concatenate([[0.0], np.cumsum(twice)])  # [2n + 1]
        self.s2 = np.concatenate([[0.0], np.cumsum(twice * twice)])

    def sharpe(self, starts: np.ndarray, lengths: np.ndarray, per_year: float) -> np.ndarray:
        """[count] annualised Sharpe (ddof 1) of each resample, from its blocks."""
        ends = starts + lengths  # <= 2n - 1
        n = self.n
        total = (self.s1[ends] - self.s1[starts]).sum(axis=1)  # [count] sum of (x - shift)
        squares = (self.s2[ends] - self.s2[starts]).sum(axis=1)
        centred = total / n
        variance = np.maximum(squares - n * centred * centred, 0.0) / (n - 1)
        mean = centred + self.shift
        std = np.sqrt(variance)
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
    bars), of ``Sharpe(returns) - Sharpe(baseline)``. ``block_length <= 0``: :func:`auto_block_length`.
    Each resample costs O(n / block_length): its statistic is summed block by block from prefix sums."""
    x = np.asarray(returns, dtype=np.float64)
    n = len(x)
    if baseline is not None:
        b = np.asarray(baseline, dtype=np.float64)
        if len(b) != n:
            raise ValueError(f"paired bootstrap needs series of one length, got {n} and {len(b)}")
    block = auto_block_length(n) if block_length <= 0 else float(block_length)
    estimate = sharpe_ratio(x, periods_per_year) - (0.0 if baseline is None else sharpe_ratio(b, periods_per_year))
    if n < 2:
        return Interval(estimate, math.nan, math.nan, confidence, 0, block)
    sharpes = resampled_sharpes(x[None] if baseline is None else np.stack([x, b]), periods_per_year,
                                samples=samples, block_length=block, seed=seed)  # [samples, 1 or 2]
    stats = sharpes[:, 0] if baseline is None else sharpes[:, 0] - sharpes[:, 1]
    return percentile_interval(stats, estimate, confidence, block)


def percentile_interval(stats: np.ndarray, estimate: float, confidence: float, block_length: float) -> Interval:
    """The percentile interval of resampled statistics ``stats [samples]`` (what :func:`bootstrap_sharpe` returns
    for them; a NaN resample, inf - inf of two constant series, has no sign and is left out)."""
    samples, block = len(stats), block_length
    stats = stats[~np.isnan(stats)]
    if not stats.size:
        return Interval(estimate, math.nan, math.nan, confidence, int(samples), block)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail], method="inverted_cdf")  # no interpolation across inf
    return Interval(estimate, float(low), float(high), confidence, int(samples), block)


def resampled_sharpes(series: np.ndarray, periods_per_year: float, *, samples: int, block_length: float, seed: int
                      ) -> np.ndarray:
    """``[samples, K]`` annualised Sharpes of K series ``[K, n]`` of the same bars, every resample taking the same
    blocks of all K (what they share cancels in their differences). ``block_length <= 0``: :func:`auto_block_length`."""
    series = np.asarray(series, dtype=np.float64)
    n = series.shape[1]
    block = auto_block_length(n) if block_length <= 0 else float(block_length)
    moments = [_Moments(s) for s in series]
    rng = np.random.default_rng(seed)
    chunk = max(1, CHUNK_ELEMENTS // (int(n / block) + 16))
    values = []
    for first in range(0, samples, chunk):
        starts, lengths = stationary_blocks(rng, n, block, min(chunk, samples - first))  # [c, m] each
        values.append(np.stack([m.sharpe(starts, lengths, periods_per_year) for m in moments], axis=1))  # [c, K]
    return np.concatenate(values)
