"""Significance that counts the tries: the deflated Sharpe ratio against the paper's worked example and closed forms,
the reality check on simulated returns with no edge and with a planted one."""

import math

import numpy as np
import pytest
from scipy import integrate, stats

from fitdqn.evaluate.bootstrap import bootstrap_sharpe, resampled_sharpes
from fitdqn.evaluate.significance import (
    deflated_sharpe,
    expected_max_sharpe,
    probabilistic_sharpe,
    reality_check,
    return_moments,
)


def test_the_papers_worked_example():
    # Bailey & Lopez de Prado (2014), section "A numerical example": 100 trials of annualised Sharpe variance 1/2,
    # the best 2.5 over 1250 daily returns of skew -3 and kurtosis 10: SR0 = 0.1132 a day, DSR = 0.9004
    assert expected_max_sharpe(100, 0.5 / 250) == pytest.approx(0.1132, abs=5e-5)
    got = deflated_sharpe(2.5, 250, {"bars": 1250, "skew": -3.0, "kurtosis": 10.0}, 100, 0.5)
    assert got["deflated_sharpe"] == pytest.approx(0.9004, abs=5e-4)
    assert got["expected_max_sharpe"] == pytest.approx(0.1132 * math.sqrt(250), abs=1e-3)


def test_expected_max_sharpe_is_the_mean_largest_of_iid_normal_trials():
    def exact(trials):  # E[max of N standard normals], by quadrature
        def density(x):
            return x * trials * stats.norm.pdf(x) * stats.norm.cdf(x) ** (trials - 1)

        return integrate.quad(density, -12, 12, limit=200)[0]

    for trials in (10, 100, 1000):
        assert expected_max_sharpe(trials, 4.0) == pytest.approx(2 * exact(trials), rel=0.03)  # sqrt(V) = 2
    assert expected_max_sharpe(1, 4.0) == 0.0
    rng = np.random.default_rng(0)
    assert rng.standard_normal((4000, 50)).max(axis=1).mean() == pytest.approx(expected_max_sharpe(50, 1.0), rel=0.03)


def test_probabilistic_sharpe_is_the_normal_cdf_of_the_standardised_gap():
    for sharpe, benchmark, bars in ((0.1, 0.0, 250), (0.05, 0.08, 1000), (-0.02, 0.0, 60)):
        z = (sharpe - benchmark) * math.sqrt(bars - 1) / math.sqrt(1 + sharpe ** 2 / 2)  # normal returns
        assert probabilistic_sharpe(sharpe, benchmark, bars) == pytest.approx(stats.norm.cdf(z), abs=1e-12)
    # fat tails and negative skew widen the Sharpe's error: less confidence in the same positive estimate
    assert probabilistic_sharpe(0.1, 0.0, 250, skew=-1.0, kurtosis=8.0) < probabilistic_sharpe(0.1, 0.0, 250)
    # one trial deflates nothing: the DSR is the PSR against zero
    one = deflated_sharpe(1.5, 252, {"bars": 500, "skew": 0.0, "kurtosis": 3.0}, 1, 0.0)
    assert one["deflated_sharpe"] == pytest.approx(probabilistic_sharpe(1.5 / math.sqrt(252), 0.0, 500))


def test_return_moments_match_scipy():
    x = np.random.default_rng(1).standard_t(5, size=2000)
    m = return_moments(x)
    assert m["bars"] == 2000
    assert m["skew"] == pytest.approx(stats.skew(x))
    assert m["kurtosis"] == pytest.approx(stats.kurtosis(x, fisher=False))
    assert return_moments(np.zeros(5)) == {"bars": 5, "skew": 0.0, "kurtosis": 3.0}


def test_resampled_sharpes_are_bootstrap_sharpes_resamples():
    rng = np.random.default_rng(2)
    a, b = rng.normal(0.001, 0.01, 300), rng.normal(0.0, 0.01, 300)
    resampled = resampled_sharpes(np.stack([a, b]), 252.0, samples=400, block_length=5, seed=3)  # [400, 2]
    interval = bootstrap_sharpe(a, 252.0, baseline=b, samples=400, block_length=5, confidence=0.9, seed=3)
    low, high = np.quantile(resampled[:, 0] - resampled[:, 1], [0.05, 0.95], method="inverted_cdf")
    assert (interval.low, interval.high) == (low, high)  # the same blocks, resample for resample


def check(agent, baselines, seed=0, samples=300):
    return reality_check(agent, baselines, 252.0, samples=samples, block_length=0, seed=seed, confidence=0.95)


def test_reality_check_under_the_null_is_not_small_and_roughly_uniform():
    """Agent and three baselines of one distribution (no one beats another): the p-values spread over [0, 1]."""
    rng = np.random.default_rng(4)
    spa, every = [], []
    for rep in range(40):
        series = rng.normal(0.0003, 0.01, size=(4, 250))
        got = check(series[0], {f"b{k}": series[k] for k in (1, 2, 3)}, seed=rep, samples=200)
        spa.append(got["some_baseline_beats_agent"]["consistent"])
        every.append(got["agent_beats_every_baseline"])
    spa, every = np.array(spa), np.array(every)
    assert 0.25 < spa.mean() < 0.75 and np.mean(spa < 0.05) <= 0.15  # about uniform: no false alarm
    assert np.mean(every < 0.05) <= 0.05  # the agent "beating all" three equals is rare (intersection-union)


def test_reality_check_finds_a_planted_edge():
    rng = np.random.default_rng(5)
    noise = rng.normal(0.0, 0.01, size=(4, 1000))
    strong = noise[0] + 0.003  # Sharpe about 4.8 a year above the others
    # a baseline with the edge: some baseline beats the agent, and the agent does not beat every baseline
    got = check(noise[1], {"edge": strong, "b2": noise[2], "b3": noise[3]})
    assert got["some_baseline_beats_agent"]["consistent"] < 0.01 and got["some_baseline_beats_agent"]["upper"] < 0.01
    assert got["agent_beats_every_baseline"] > 0.5
    # the agent with the edge: it beats every baseline, and no baseline beats it
    got = check(strong, {"b1": noise[1], "b2": noise[2], "b3": noise[3]})
    assert got["agent_beats_every_baseline"] < 0.01
    assert got["some_baseline_beats_agent"]["consistent"] > 0.5
    assert set(got["pairwise"]) == {"b1", "b2", "b3"} and max(got["pairwise"].values()) == got[
        "agent_beats_every_baseline"]


def test_reality_check_counts_the_baselines():
    """Many equal baselines: the best of them looks better than the agent by luck; the SPA's upper (White's) p-value
    counts them, where the best one's pairwise p-value alone would not."""
    rng = np.random.default_rng(6)
    series = rng.normal(0.0, 0.01, size=(31, 500))
    got = check(series[0], {f"b{k}": series[k] for k in range(1, 31)})
    best_pairwise = 1.0 - max(got["pairwise"].values())  # the best baseline's one-sided p of beating the agent
    assert got["some_baseline_beats_agent"]["upper"] > 2 * best_pairwise
    assert check(series[0], {"short": series[1][:-1]}) is None  # another length is left out: nothing to test
