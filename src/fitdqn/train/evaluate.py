"""Backtests on held-out bars: the agent beside buy-and-hold and a random policy, as trading metrics."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from fitdqn.config import Config
from fitdqn.learn.learner import Learner
from fitdqn.market.env import Backtest, evaluate_config
from fitdqn.market.loader import Market
from fitdqn.train.metrics import trading_metrics


def periods_per_year(timestamps: pd.Series) -> float:
    """Bars per year from the median bar spacing: 52 weekly, 252 daily, 252 x (6.5 h / spacing) intraday."""
    spacing = pd.Series(pd.to_datetime(timestamps)).diff().median()
    if pd.isna(spacing) or pd.Timedelta(hours=20) <= spacing < pd.Timedelta(days=5):
        return 252.0
    if spacing >= pd.Timedelta(days=5):
        return 52.0
    return 252.0 * (pd.Timedelta(hours=6.5) / spacing)


def greedy_policy(learner: Learner):
    zero = torch.zeros((), device=learner.device)

    def act(obs: torch.Tensor) -> torch.Tensor:
        return learner.act(obs.to(learner.device), zero)

    return act


def random_policy(branches: tuple[int, ...], seed: int, device: torch.device):
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    high = torch.tensor(branches, device=device)

    def act(obs: torch.Tensor) -> torch.Tensor:
        u = torch.rand((obs.shape[0], len(branches)), generator=generator, device=device)
        return (u * high).long()

    return act


def backtest_metrics(backtest: Backtest, capital: float, per_year: float) -> dict[str, Any]:
    return trading_metrics(backtest.pnl, backtest.position, capital, per_year).to_json()


def account_size(market: Market, config: Config, split: str) -> float:
    """train.capital, or (auto) the notional of market.max_contracts at the split's first open."""
    if config.train.capital > 0:
        return config.train.capital
    first = market.first_bar(split, config.net.window)
    price = float(market.prices[first, 0])  # host sync: one number
    return config.market.max_contracts * market.contract.multiplier * price


def evaluate_split(learner: Learner, market: Market, config: Config, split: str, seeds: int | None = None
                   ) -> tuple[dict[str, Any], Backtest]:
    """Agent, buy-and-hold and random (mean over ``train.eval_seeds`` seeds) on one split."""
    capital = account_size(market, config, split)
    timestamps = market.bars["timestamp"]
    per_year = periods_per_year(timestamps)
    agent = evaluate_config(greedy_policy(learner), config, split, market=market)
    hold_pnl = np.diff(agent.buy_and_hold)
    results: dict[str, Any] = {
        "split": split,
        "capital": capital,
        "bars": len(agent),
        "periods_per_year": per_year,
        "agent": backtest_metrics(agent, capital, per_year),
        "buy_and_hold": trading_metrics(hold_pnl, np.ones_like(hold_pnl), capital, per_year).to_json(),
    }
    random_runs = [
        backtest_metrics(
            evaluate_config(random_policy(config.net.branches, 1000 + s, market.device), config, split,
                            market=market), capital, per_year)
        for s in range(seeds if seeds is not None else config.train.eval_seeds)
    ]
    results["random"] = {
        key: float(np.mean([r[key] for r in random_runs if r[key] is not None] or [0.0])) for key in random_runs[0]
    } if random_runs else {}
    results["random_seeds"] = len(random_runs)
    return results, agent
