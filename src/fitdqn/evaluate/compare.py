"""One split, the agent beside every baseline: trading metrics, bootstrap intervals on Sharpe, the reality check of the
agent against all baselines at once and, for a tuned configuration, the deflated Sharpe ratio
(:mod:`fitdqn.evaluate.significance`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from fitdqn.config import Config
from fitdqn.evaluate.backtest import (
    Backtest,
    PassRunner,
    Progress_,
    evaluate_config,
    evaluate_rules_config,
    run_eagerly,
)
from fitdqn.evaluate.baselines import (
    RULES,
    SIZED_HOLD,
    account_size,
    greedy_policy,
    not_applicable,
    random_policy,
    rule_policies,
)
from fitdqn.evaluate.bootstrap import auto_block_length, bootstrap_sharpe, percentile_interval, resampled_sharpes
from fitdqn.evaluate.metrics import bar_returns, sharpe_ratio, trading_metrics
from fitdqn.evaluate.significance import deflated_sharpe, reality_check, return_moments
from fitdqn.learn.learner import Learner
from fitdqn.market.loader import Market

BUY_AND_HOLD = "buy_and_hold"
RANDOM = "random"
POLICIES = ("agent", BUY_AND_HOLD, SIZED_HOLD, *RULES, RANDOM)  # the order of every table


def own_sizing_baselines(config: Config) -> tuple[str, ...]:
    """The baselines sized as the agent is, the ones its verdict is judged against: under volatility sizing the
    volatility-sized buy-and-hold and the rules (they trade through the agent's env), under whole contracts the
    plain buy-and-hold and the rules."""
    hold = SIZED_HOLD if config.market.position_sizing == "volatility" else BUY_AND_HOLD
    return (hold, *RULES)


@dataclass
class SplitResult:
    """What :func:`evaluate_split` computed: the JSON-ready ``results`` and the per-bar series behind them."""

    results: dict[str, Any]
    agent: Backtest
    pnl: dict[str, np.ndarray] = field(default_factory=dict)  # policy -> [N] net P&L per bar (currency)

    def pnl_frame(self) -> pd.DataFrame:
        """[N] rows: the fill bar's time and each policy's P&L (the random policy: mean over its seeds)."""
        return pd.DataFrame({"timestamp": self.agent.timestamp, **self.pnl})

    def equity_curves(self) -> dict[str, np.ndarray]:
        """policy -> [N + 1] equity from the split's capital."""
        capital = self.results["capital"]
        return {name: capital + np.concatenate([[0.0], np.cumsum(p)]) for name, p in self.pnl.items()}


def bootstrap_options(config: Config) -> dict[str, Any]:
    """``bootstrap_sharpe``'s options from ``evaluate.*``."""
    e = config.evaluate
    return dict(samples=e.bootstrap_samples, block_length=e.block_length, confidence=e.confidence,
                seed=e.bootstrap_seed)


def sharpe_differences(returns: np.ndarray, others: dict[str, np.ndarray | None], per_year: float,
                       options: dict[str, Any]) -> dict[str, Any]:
    """The agent's Sharpe minus each other policy's on the same bars (resampled together), from per-bar returns:
    ``sharpe_minus_buy_and_hold`` and ``sharpe_minus_rules`` (name -> interval); None for a series given as None
    or of another length (a ruined account's returns stop early)."""
    differences = {name: bootstrap_sharpe(returns, per_year, baseline=other, **options).to_json()
                   if other is not None and len(other) == len(returns) else None for name, other in others.items()}
    return {"sharpe_minus_buy_and_hold": differences.pop(BUY_AND_HOLD, None), "sharpe_minus_rules": differences}


def sharpe_intervals(config: Config, pnl: np.ndarray, capital: float, per_year: float,
                     baselines: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """``sharpe_ci`` of ``pnl`` and, with ``baselines`` (name -> its P&L on the same bars), ``sharpe_differences``
    and the ``reality_check`` against all of them at once. None for a ruined account (its Sharpe is not defined),
    on either side of a difference."""
    options = bootstrap_options(config)
    returns = bar_returns(pnl, capital)
    whole = len(returns) == len(pnl)
    out: dict[str, Any] = {"sharpe_ci": bootstrap_sharpe(returns, per_year, **options).to_json() if whole else None}
    if baselines is not None:  # a ruined agent has no Sharpe, so no difference either (None)
        others = {name: bar_returns(other, capital) if whole else None for name, other in baselines.items()}
        out |= sharpe_differences(returns, others, per_year, options)
        out["reality_check"] = joint_test(returns, others, per_year, options) if whole else None
    return out


def joint_test(returns: np.ndarray, others: dict[str, np.ndarray | None], per_year: float,
               options: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`fitdqn.evaluate.significance.reality_check` of the agent's per-bar returns against ``others``, on the
    pairwise intervals' resamples (their seed, count and block length)."""
    return reality_check(returns, {n: r for n, r in others.items() if r is not None}, per_year,
                         samples=options["samples"], block_length=options["block_length"], seed=options["seed"],
                         confidence=options["confidence"])


def policy_intervals(config: Config, pnl: dict[str, np.ndarray], capital: float, per_year: float
                     ) -> dict[str, dict[str, Any]]:
    """:func:`sharpe_intervals` of every policy in ``pnl`` (name -> its P&L on the split's bars, the agent first),
    the agent's against all the others: the same figures, from one set of resamples of every series together
    instead of one per interval (the same seed draws the same blocks for each, so each interval is the one
    ``bootstrap_sharpe`` gives alone, and the reality check the one it draws itself)."""
    options = bootstrap_options(config)
    n = len(pnl["agent"])
    if n < 3:  # too few bars for a reality check: each interval on its own (their own short-series answers)
        others = {name: p for name, p in pnl.items() if name != "agent"}
        return {name: sharpe_intervals(config, p, capital, per_year, others if name == "agent" else None)
                for name, p in pnl.items()}
    returns = {name: np.asarray(bar_returns(p, capital), dtype=np.float64) for name, p in pnl.items()}
    whole = [name for name in pnl if len(returns[name]) == n]  # a ruined account's returns stop early: no Sharpe
    block = auto_block_length(n) if options["block_length"] <= 0 else float(options["block_length"])
    resampled = resampled_sharpes(np.stack([returns[k] for k in whole]), per_year, samples=options["samples"],
                                  block_length=block, seed=options["seed"]) if whole else None  # [B, whole]
    column = {name: resampled[:, i] for i, name in enumerate(whole)}

    def interval(name: str, minus: str | None = None) -> dict[str, Any]:
        estimate = sharpe_ratio(returns[name], per_year)
        stats = column[name]
        if minus is not None:
            estimate, stats = estimate - sharpe_ratio(returns[minus], per_year), stats - column[minus]
        return percentile_interval(stats, estimate, options["confidence"], block).to_json()

    alone = {name: bootstrap_sharpe(returns[name], per_year, **options).to_json()  # whole, on bars of its own
             for name in pnl if name not in column and len(returns[name]) == len(pnl[name])}
    out = {name: {"sharpe_ci": interval(name) if name in column else alone.get(name)} for name in pnl}
    agent_whole = "agent" in column
    differences = {name: interval("agent", name) if agent_whole and name in column else None
                   for name in pnl if name != "agent"}
    out["agent"] |= {"sharpe_minus_buy_and_hold": differences.pop(BUY_AND_HOLD, None),
                     "sharpe_minus_rules": differences}
    out["agent"]["reality_check"] = reality_check(
        returns["agent"], {k: returns[k] for k in whole if k != "agent"}, per_year, samples=options["samples"],
        block_length=options["block_length"], seed=options["seed"], confidence=options["confidence"],
        resampled=resampled) if agent_whole else None
    return out


def tries_counted(config: Config, returns: np.ndarray, sharpe: float | None, per_year: float) -> dict[str, Any] | None:
    """The deflated Sharpe ratio of ``sharpe`` over ``returns`` when the config says it was the best of
    ``evaluate.tried_configs`` > 1 tries (``fitdqn tune``'s best.toml does); None otherwise."""
    e = config.evaluate
    if e.tried_configs < 2 or sharpe is None:
        return None
    return {**deflated_sharpe(sharpe, per_year, return_moments(returns), e.tried_configs, e.tried_sharpe_variance),
            "tried_in": e.tried_in}


def evaluate_split(learner: Learner, market: Market, config: Config, split: str, *, baselines: bool = True,
                   progress: Progress_ = None, graphs: PassRunner | None = None) -> SplitResult:
    """The greedy agent on one split; with ``baselines``, buy-and-hold, the rules and random (mean over
    ``train.eval_seeds`` seeds) beside it, and bootstrap intervals on every Sharpe. ``graphs``: a runner that
    keeps its passes (``fitdqn.evaluate.backtest_graphs.BacktestGraphs``: every backtest a CUDA-graph replay; one
    per learner, its key ``agent`` is this learner's greedy policy); None runs every pass eagerly."""
    capital = account_size(market, config, split)
    per_year = market.bars_per_year
    runner = graphs if graphs is not None else run_eagerly
    agent = evaluate_config(greedy_policy(learner), config, split, market=market, progress=progress, runner=runner,
                            key="agent")
    hold_pnl = np.diff(agent.buy_and_hold)
    stamps = agent.timestamp
    results: dict[str, Any] = {
        "split": split,
        "bars": len(agent),
        "first_time": time_text(stamps[0]) if len(stamps) else None,
        "last_time": time_text(stamps[-1]) if len(stamps) else None,
        "capital": capital,
        "currency": market.contract.unit,  # "price units" for a contract without a currency
        "periods_per_year": per_year,
        "segments": agent.segments,
        "hold_contracts": agent.hold_contracts,
    }
    pnl = {"agent": agent.pnl}
    positions = {"agent": agent.position}
    if baselines:
        pnl[BUY_AND_HOLD] = hold_pnl
        positions[BUY_AND_HOLD] = np.full_like(hold_pnl, float(agent.hold_contracts))
        unusable = not_applicable(market, config, per_year, split)
        rules = {n: r for n, r in rule_policies(market, config, per_year).items() if n not in unusable}
        # the rules in one pass (each bit for bit its own backtest)
        passes = evaluate_rules_config(list(rules.values()), config, split, market=market, runner=runner)
        for name, backtest in zip(rules, passes, strict=True):
            pnl[name], positions[name] = backtest.pnl, backtest.position
        results["not_applicable"] = unusable  # name -> why: no row of figures, never a flat position's zeros
    results["policies"] = list(pnl) + ([RANDOM] if baselines and config.train.eval_seeds > 0 else [])
    for name in pnl:
        results[name] = trading_metrics(pnl[name], positions[name], capital, per_year).to_json()
    if baselines:  # every Sharpe's interval, the agent's against every other policy on the same bars
        for name, intervals in policy_intervals(config, pnl, capital, per_year).items():
            results[name] |= intervals
    returns = bar_returns(agent.pnl, capital)
    results["agent"]["return_moments"] = return_moments(returns)  # what a deflated Sharpe needs of these bars
    deflated = tries_counted(config, returns, results["agent"]["sharpe"], per_year)
    if deflated is not None:
        results["agent"]["deflated_sharpe"] = deflated
    if baselines and config.train.eval_seeds > 0:
        runs = [evaluate_config(random_policy(config.net.branches, 1000 + s, market.device), config, split,
                                market=market, runner=runner, key=f"random {s}")
                for s in range(config.train.eval_seeds)]
        metrics = [trading_metrics(r.pnl, r.position, capital, per_year).to_json() for r in runs]
        numeric = [k for k, v in metrics[0].items() if isinstance(v, (int, float)) or v is None]
        results[RANDOM] = {k: _mean([m[k] for m in metrics]) for k in numeric}
        results[RANDOM]["seeds"] = len(runs)
        pnl[RANDOM] = np.mean([r.pnl for r in runs], axis=0)  # [N] the seeds' average P&L
    return SplitResult(results, agent, pnl)


def time_text(stamp) -> str | None:
    """A bar time as text: the date alone for daily bars (midnight), else date and time."""
    t = pd.Timestamp(stamp)
    if pd.isna(t):
        return None
    return t.date().isoformat() if t == t.normalize() else t.isoformat(sep=" ")


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None
