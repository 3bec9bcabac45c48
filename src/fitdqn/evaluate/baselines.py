"""The policies an agent is judged against, and the agent itself as a policy.

Rules trade through the same env as the agent (next-open fills, costs, episodes), long or short at the agent's
largest position (``market.max_contracts``), deciding at each bar's close from closes up to that bar:

* ``ma_crossover``: long while the fast moving average of closes is above the slow one, short while below
  (flat until the slow average exists);
* ``time_series_momentum``: the sign of the return over the last ``evaluate.momentum_years`` of bars
  (Moskowitz, Ooi & Pedersen 2012; flat until that much history exists);
* ``last_bar_momentum``: the sign of the last bar's close-to-close return (the synthetic market's planted
  edge, :func:`fitdqn.market.data.synthetic_bars`).

Buy-and-hold is not a policy run on the env: it is the passive investment, ``max_contracts`` bought at the
first fill and held to the last close (:class:`~fitdqn.evaluate.backtest.Backtest`). Under volatility sizing
(``market.position_sizing = 'volatility'``) the agent's positions shrink when the market is more volatile than
the target, and a volatility-targeted long position alone is known to raise the Sharpe of equity indices; so
beside the plain one runs ``sized_buy_and_hold``: the largest long level at every bar, through the same env (the
agent's sizing, costs, capital and episode liquidations), like for like. The random policy draws every sub-action
uniformly (the mean over ``train.eval_seeds`` seeds is reported).

A rule whose signal does not exist at the split's first decision (too few bars of history before it for the slow
moving average or the momentum lookback) cannot run on that split: :func:`not_applicable` says why, and the
reports mark it "n/a" instead of showing the flat position it would hold.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fitdqn.config import Config
from fitdqn.evaluate.backtest import BarRule
from fitdqn.learn.learner import Learner
from fitdqn.market.env import position_levels
from fitdqn.market.layout import NUM_BRANCHES
from fitdqn.market.loader import Market

RULES = ("ma_crossover", "time_series_momentum", "last_bar_momentum")
SIZED_HOLD = "sized_buy_and_hold"  # the largest long level at every bar, through the env (volatility sizing)


def greedy_policy(learner: Learner):
    zero = torch.zeros((), device=learner.device)

    def act(obs: Tensor) -> Tensor:
        return learner.act(obs.to(learner.device), zero, network=learner.evaluated)

    return act


def random_policy(branches: tuple[int, ...], seed: int, device: torch.device):
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    high = torch.tensor(branches, device=device)

    def act(obs: Tensor) -> Tensor:
        u = torch.rand((obs.shape[0], len(branches)), generator=generator, device=device)
        return (u * high).long()

    act.seeded = (generator, seed)  # a backtest pass reseeds it at each start (the same draws every run)
    return act


def moving_average(close: Tensor, n: int) -> Tensor:
    """[T] trailing mean of ``n`` closes ending at each bar (NaN before ``n`` bars exist)."""
    sums = torch.cumsum(torch.cat([close.new_zeros(1), close]), dim=0)  # [T + 1]
    mean = (sums[n:] - sums[:-n]) / n  # [T - n + 1], the mean ending at bar n - 1 ..
    return torch.cat([close.new_full((n - 1,), float("nan")), mean])


def momentum_lookback(config: Config, per_year: float) -> int:
    """Bars of the time-series momentum rule's lookback: ``evaluate.momentum_years`` of bars, at least 1."""
    return max(1, round(config.evaluate.momentum_years * per_year))


def first_signal_bar(config: Config, per_year: float) -> dict[str, int]:
    """rule -> the first bar (of the whole series) at whose close its signal exists."""
    return {"ma_crossover": config.evaluate.ma_slow - 1, "time_series_momentum": momentum_lookback(config, per_year),
            "last_bar_momentum": 1}


def not_applicable(market: Market, config: Config, per_year: float, split: str) -> dict[str, str]:
    """rule -> why it cannot run on ``split``: its signal does not exist yet at the split's first decision bar
    (the rule would hold a flat position there instead of the rule). Rules that can run are not listed."""
    first = market.first_bar(split, config.net.window)
    e, lookback = config.evaluate, momentum_lookback(config, per_year)
    needs = {"ma_crossover": f"the {e.ma_slow}-bar moving average",
             "time_series_momentum": f"a {e.momentum_years * 12:g}-month lookback ({lookback} bars at {per_year:g} "
                                     "bars a year)",
             "last_bar_momentum": "the last bar's return"}
    return {name: f"n/a: {needs[name]} needs {bar} bars of history before its first decision; the data have {first}"
            for name, bar in first_signal_bar(config, per_year).items() if bar > first}


def rule_signals(close: Tensor, config: Config, per_year: float) -> dict[str, Tensor]:
    """name -> [T] direction in {-1, 0, +1} decided at each bar's close (causal: bars <= t only)."""
    e = config.evaluate
    T = close.shape[0]
    fast, slow = moving_average(close, e.ma_fast), moving_average(close, e.ma_slow)
    ma = torch.nan_to_num(torch.sign(fast - slow), nan=0.0)
    lookback = momentum_lookback(config, per_year)
    momentum = close.new_zeros(T)
    if lookback < T:
        momentum[lookback:] = torch.sign(close[lookback:] - close[:-lookback])
    last = close.new_zeros(T)
    last[1:] = torch.sign(close[1:] - close[:-1])
    return {"ma_crossover": ma, "time_series_momentum": momentum, "last_bar_momentum": last}


def rule_policies(market: Market, config: Config, per_year: float) -> dict[str, BarRule]:
    """The rule baselines as per-bar action tables, at +-market.max_contracts, no stop, no take-profit; under
    volatility sizing, ``sized_buy_and_hold`` too (the largest long level at every bar)."""
    levels = position_levels(config.net.branches[0], config.market.max_contracts)
    centre = (len(levels) - 1) // 2  # index of flat; 0 and 2 x centre are -max and +max
    close = market.prices[:, 3].double()  # [T]
    rules = {}
    if config.market.position_sizing == "volatility":
        actions = torch.zeros((close.shape[0], NUM_BRANCHES), dtype=torch.int64, device=market.device)
        actions[:, 0] = 2 * centre  # [T, 3] the largest long level, sized by the env as the agent's are
        rules[SIZED_HOLD] = BarRule(SIZED_HOLD, actions)
    for name, direction in rule_signals(close, config, per_year).items():
        actions = torch.zeros((close.shape[0], NUM_BRANCHES), dtype=torch.int64, device=market.device)
        actions[:, 0] = centre + direction.long() * centre  # [T, 3]
        rules[name] = BarRule(name, actions)
    return rules


def account_size(market: Market, config: Config, split: str) -> float:
    """train.capital, or (auto) the notional of market.max_contracts at the split's first open."""
    if config.train.capital > 0:
        return config.train.capital
    first = market.first_bar(split, config.net.window)
    price = float(market.prices[first, 0])  # host sync: one number
    return config.market.max_contracts * market.contract.multiplier * price
