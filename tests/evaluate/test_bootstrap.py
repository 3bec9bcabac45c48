"""The stationary block bootstrap against cases with known answers."""

import math

import numpy as np
import pytest

from fitdqn.evaluate.bootstrap import _Moments, auto_block_length, bootstrap_sharpe, stationary_blocks
from fitdqn.evaluate.metrics import sharpe_ratio

OPTIONS = dict(samples=400, block_length=0.0, confidence=0.95)



def block_indices(starts: np.ndarray, lengths: np.ndarray, n: int) -> np.ndarray:
    """[count, n] the bar indices the blocks of :func:`stationary_blocks` spell out (the reference the
    block sums are checked against)."""
    rows = []
    for row_starts, row_lengths in zip(starts, lengths, strict=True):
        offsets = np.arange(int(row_lengths.sum())) - np.repeat(np.cumsum(row_lengths) - row_lengths, row_lengths)
        rows.append((np.repeat(row_starts, row_lengths) + offsets) % n)
    return np.stack(rows)


def test_blocks_have_the_given_mean_length_and_cover_every_bar():
    rng = np.random.default_rng(0)
    starts, lengths = stationary_blocks(rng, 1000, 10.0, 200)  # [200, m] each
    assert (lengths.sum(axis=1) == 1000).all() and starts.min() >= 0 and starts.max() < 1000
    whole = lengths[:, :-1][lengths[:, 1:] > 0]  # blocks not cut by the end of the row
    assert whole.mean() == pytest.approx(10.0, rel=0.05)
    index = block_indices(starts, lengths, 1000)  # [200, 1000]
    continues = (np.diff(index, axis=1) % 1000) == 1  # the next bar of the same block (wrapping)
    assert 1 / (1 - continues.mean()) == pytest.approx(10.0, rel=0.1)
    counts = np.bincount(index.ravel(), minlength=1000)
    assert counts.min() > 0.7 * counts.mean()  # every bar is drawn about equally often (the wrap)


def test_block_sums_equal_the_statistic_of_the_spelled_out_resample():
    x = np.random.default_rng(2).normal(0.01, 0.02, 500) + 3.0  # a large mean: no cancellation
    starts, lengths = stationary_blocks(np.random.default_rng(3), 500, 7.0, 50)
    fast = _Moments(x).sharpe(starts, lengths, 252.0)
    rows = x[block_indices(starts, lengths, 500)]  # [50, 500]
    slow = [sharpe_ratio(r, 252.0) for r in rows]
    np.testing.assert_allclose(fast, slow, rtol=1e-9)


def test_interval_covers_the_true_sharpe_of_iid_normal_returns():
    mu, sigma, n = 0.0005, 0.01, 1000
    true = mu / sigma * math.sqrt(252)
    covered = []
    for trial in range(60):
        returns = np.random.default_rng(100 + trial).normal(mu, sigma, n)
        ci = bootstrap_sharpe(returns, 252.0, seed=trial, **OPTIONS)
        assert ci.low <= ci.estimate <= ci.high
        covered.append(ci.low <= true <= ci.high)
    assert 0.85 <= np.mean(covered) <= 1.0  # nominal 95 %


def test_seeded_and_reproducible():
    returns = np.random.default_rng(1).normal(0.001, 0.01, 300)
    a = bootstrap_sharpe(returns, 252.0, seed=7, **OPTIONS)
    assert a == bootstrap_sharpe(returns, 252.0, seed=7, **OPTIONS)
    assert a != bootstrap_sharpe(returns, 252.0, seed=8, **OPTIONS)


def test_constant_positive_series_is_above_zero():
    ci = bootstrap_sharpe(np.full(200, 0.001), 252.0, seed=0, **OPTIONS)
    assert ci.estimate == math.inf and ci.low == math.inf
    assert ci.to_json()["low"] is None  # JSON has no infinity


def test_width_shrinks_with_length():
    rng = np.random.default_rng(3)
    widths = []
    for n in (250, 4000):
        ci = bootstrap_sharpe(rng.normal(0.0005, 0.01, n), 252.0, seed=0, **OPTIONS)
        widths.append(ci.high - ci.low)
    assert widths[1] < widths[0] / 2.5  # ~ 1 / sqrt(n): a quarter


def test_blocks_widen_the_interval_of_autocorrelated_returns():
    rng = np.random.default_rng(4)
    noise = rng.normal(0.0, 0.01, 3000)
    returns = np.empty_like(noise)
    returns[0] = noise[0]
    for t in range(1, len(noise)):  # AR(1), phi 0.6: iid resampling understates the Sharpe's spread
        returns[t] = 0.6 * returns[t - 1] + noise[t]
    returns += 0.0005
    single = bootstrap_sharpe(returns, 252.0, samples=400, block_length=1.0, confidence=0.95, seed=0)
    blocks = bootstrap_sharpe(returns, 252.0, samples=400, block_length=30.0, confidence=0.95, seed=0)
    assert (blocks.high - blocks.low) > 1.4 * (single.high - single.low)  # sqrt((1 + phi) / (1 - phi)) = 2


def test_paired_difference_of_identical_and_of_scaled_series_is_zero():
    returns = np.random.default_rng(5).normal(0.0005, 0.01, 500)
    same = bootstrap_sharpe(returns, 252.0, baseline=returns, seed=0, **OPTIONS)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    scaled = bootstrap_sharpe(2 * returns, 252.0, baseline=returns, seed=0, **OPTIONS)
    assert abs(scaled.low) < 1e-9 and abs(scaled.high) < 1e-9
    better = bootstrap_sharpe(returns + 0.002, 252.0, baseline=returns, seed=0, **OPTIONS)
    assert better.low > 0
    with pytest.raises(ValueError, match="one length"):
        bootstrap_sharpe(returns, 252.0, baseline=returns[:-1], seed=0, **OPTIONS)


def test_auto_block_length():
    assert auto_block_length(1000) == 10 and auto_block_length(1) == 1
