"""Significance that counts the tries: the deflated Sharpe ratio of a tuned configuration, and a test of the agent
against all the baselines at once.

**Deflated Sharpe ratio** (Bailey & Lopez de Prado 2014, "The Deflated Sharpe Ratio: Correcting for Selection
Bias, Backtest Overfitting and Non-Normality"). The best of N tried configurations has a high Sharpe by luck alone:
with the tries' Sharpes spread with variance V, the expected maximum of N of them under no skill is

    SR0 = sqrt(V) x ((1 - g) x Z^-1(1 - 1/N) + g x Z^-1(1 - 1/(N e)))         (g: Euler-Mascheroni's constant)

and the deflated Sharpe ratio is the probabilistic Sharpe ratio against SR0: the probability that the true Sharpe
exceeds SR0, given the estimate SR's standard error over T returns of skew g3 and kurtosis g4,

    PSR(SR*) = Z((SR - SR*) x sqrt(T - 1) / sqrt(1 - g3 x SR + (g4 - 1) / 4 x SR^2)).

Every Sharpe here is per bar (not annualised); :func:`deflated_sharpe` takes annualised figures and converts.

**Reality check.** The agent is compared with K baselines on the same bars. Pairwise intervals answer one question
each; two questions need all K at once, on the same stationary-bootstrap resamples (:mod:`fitdqn.evaluate.bootstrap`)
of the K + 1 return series, the statistic being the Sharpe difference:

* *does any baseline beat the agent?* Hansen's (2005) test for superior predictive ability, the agent as the
  benchmark and the baselines as the alternatives: ``T = max(0, max_k s_k / w_k)`` with ``s_k`` the baseline's
  Sharpe minus the agent's and ``w_k`` its bootstrap standard deviation, against the resampled statistics recentred
  to the null (``consistent``: Hansen's recentring; ``upper``: White's 2000 reality check, every alternative at the
  boundary of the null). A small p-value: some baseline beats the agent, counting that the best of K was looked at.
* *does the agent beat every baseline?* An intersection-union test: the null (some baseline at least as good) is
  rejected only when every pairwise one is, so its p-value is the largest of the K one-sided pairwise bootstrap
  p-values (the share of resamples in which the agent's Sharpe is not above the baseline's: the pairwise intervals'
  own resamples, so a p-value below (1 - confidence) / 2 is an interval above zero).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

from fitdqn.evaluate.bootstrap import auto_block_length, resampled_sharpes
from fitdqn.evaluate.metrics import sharpe_ratio

EULER_GAMMA = 0.5772156649015329
NORMAL = NormalDist()


# ------------------------------------------------------------------------------------- deflated Sharpe ratio
def return_moments(returns: np.ndarray) -> dict[str, float | int]:
    """``bars``, ``skew`` and ``kurtosis`` (not excess: 3 for a normal series) of per-bar returns, population
    moments as in Bailey & Lopez de Prado; a constant series has skew 0 and kurtosis 3."""
    x = np.asarray(returns, dtype=np.float64)
    centred = x - x.mean() if len(x) else x
    variance = float(np.mean(centred ** 2)) if len(x) else 0.0
    if variance <= 0:
        return {"bars": int(len(x)), "skew": 0.0, "kurtosis": 3.0}
    return {"bars": int(len(x)), "skew": float(np.mean(centred ** 3) / variance ** 1.5),
            "kurtosis": float(np.mean(centred ** 4) / variance ** 2)}


def probabilistic_sharpe(sharpe: float, benchmark: float, bars: int, skew: float = 0.0, kurtosis: float = 3.0
                         ) -> float:
    """PSR: the probability that the true per-bar Sharpe exceeds ``benchmark`` given the estimate ``sharpe`` over
    ``bars`` returns of ``skew`` and ``kurtosis`` (per bar, not annualised)."""
    spread = 1.0 - skew * sharpe + (kurtosis - 1.0) / 4.0 * sharpe * sharpe
    if bars < 2 or spread <= 0:
        return math.nan
    return NORMAL.cdf((sharpe - benchmark) * math.sqrt(bars - 1) / math.sqrt(spread))


def expected_max_sharpe(trials: int, variance: float) -> float:
    """SR0: the expected largest of ``trials`` Sharpes with no skill spread with ``variance`` (Bailey & Lopez de
    Prado's approximation, from extreme value theory); 0 for one trial."""
    if trials < 2 or variance <= 0:
        return 0.0
    return math.sqrt(variance) * ((1.0 - EULER_GAMMA) * NORMAL.inv_cdf(1.0 - 1.0 / trials)
                                  + EULER_GAMMA * NORMAL.inv_cdf(1.0 - 1.0 / (trials * math.e)))


def deflated_sharpe(sharpe: float, per_year: float, moments: dict[str, Any], trials: int, variance: float
                    ) -> dict[str, Any]:
    """The deflated Sharpe ratio of an annualised ``sharpe`` (``per_year`` bars a year) over returns of ``moments``
    (:func:`return_moments`), the best of ``trials`` tries whose annualised Sharpes have ``variance``. JSON-ready:
    ``deflated_sharpe`` (a probability), ``expected_max_sharpe`` (SR0, annualised) and what went in."""
    scale = math.sqrt(per_year)
    benchmark = expected_max_sharpe(trials, variance / per_year)  # per bar
    value = probabilistic_sharpe(sharpe / scale, benchmark, int(moments["bars"]), float(moments["skew"]),
                                 float(moments["kurtosis"]))
    return {"deflated_sharpe": value if math.isfinite(value) else None, "sharpe": sharpe,
            "expected_max_sharpe": benchmark * scale, "trials": int(trials), "trials_sharpe_variance": variance,
            "bars": int(moments["bars"]), "skew": float(moments["skew"]), "kurtosis": float(moments["kurtosis"])}


# ------------------------------------------------------------------------------------------- reality check
def reality_check(agent: np.ndarray, baselines: dict[str, np.ndarray], per_year: float, *, samples: int,
                  block_length: float, seed: int, confidence: float, resampled: np.ndarray | None = None
                  ) -> dict[str, Any] | None:
    """The agent's per-bar returns ``agent [n]`` against every baseline's ``[n]`` at once (module docstring), on
    ``samples`` stationary-bootstrap resamples of all of them together (``resampled [samples, K + 1]``: their
    Sharpes already drawn with these options by ``resampled_sharpes``, the agent's first, then the baselines of
    length n in order; else drawn here). JSON-ready, or None without a baseline:

    * ``some_baseline_beats_agent``: Hansen's SPA p-values, ``consistent`` and ``upper`` (White's reality check);
    * ``agent_beats_every_baseline``: the intersection-union p-value, and ``pairwise`` (name -> one-sided p);
    * ``baselines`` (the names tested; a baseline of another length is left out), ``samples``, ``block_length``.
    """
    x = np.asarray(agent, dtype=np.float64)
    n = len(x)
    names = [name for name, r in baselines.items() if r is not None and len(r) == n]
    if not names or n < 3:
        return None
    series = np.stack([x, *(np.asarray(baselines[k], dtype=np.float64) for k in names)])  # [K + 1, n]
    block = auto_block_length(n) if block_length <= 0 else float(block_length)
    observed = np.array([sharpe_ratio(s, per_year) for s in series])  # [K + 1]
    if resampled is None:  # [B, K + 1]
        resampled = resampled_sharpes(series, per_year, samples=samples, block_length=block, seed=seed)
    differences = resampled[:, 1:] - resampled[:, :1]  # [B, K] baseline minus agent
    edge = observed[1:] - observed[0]  # [K]
    finite = np.isfinite(differences).all(axis=0) & np.isfinite(edge)  # a constant series has an infinite Sharpe
    pairwise = {name: float(np.mean(differences[:, k] >= 0)) if finite[k] else None for k, name in enumerate(names)}
    spa = spa_pvalues(edge[finite], differences[:, finite], n)
    known = [p for p in pairwise.values() if p is not None]
    return {"some_baseline_beats_agent": spa, "agent_beats_every_baseline": max(known) if known else None,
            "pairwise": pairwise, "baselines": names, "samples": int(samples), "block_length": block,
            "confidence": confidence}


def spa_pvalues(edge: np.ndarray, resampled: np.ndarray, n: int) -> dict[str, float] | None:
    """Hansen's SPA p-values of H0 "no alternative beats the benchmark" from the alternatives' observed edges
    ``edge [K]`` (alternative minus benchmark; > 0 is better) and their resamples ``[B, K]`` over ``n`` bars:
    ``consistent`` (Hansen's recentring) and ``upper`` (every alternative at the null's boundary: White's reality
    check, studentised). None without an alternative."""
    if edge.size == 0:
        return None
    spread = resampled.std(axis=0)  # [K] bootstrap standard deviation of each edge
    usable = spread > 0  # an alternative identical to the benchmark adds nothing
    if not usable.any():
        return {"consistent": 1.0, "upper": 1.0}
    edge, resampled, spread = edge[usable], resampled[:, usable], spread[usable]
    observed = max(0.0, float(np.max(edge / spread)))
    threshold = -spread * math.sqrt(2.0 * math.log(math.log(max(n, 16))))
    # what each resampled edge is moved by to the null: all of it, except (consistent) a clearly inferior one's
    centres = {"consistent": np.where(edge >= threshold, edge, 0.0), "upper": edge}
    out = {}
    for name, centre in centres.items():
        null = np.maximum(0.0, ((resampled - centre) / spread).max(axis=1))  # [B]
        out[name] = float(np.mean(null >= observed))
    return out
