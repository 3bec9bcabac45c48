"""The vectorised futures environment: E episodes stepped together as tensor ops on the device.

One step = one decision at the close of bar ``t`` for every env, made of three sub-actions (action branching):

* branch 0, target position: index i -> ``round((i - c) * max_contracts / c)`` contracts, ``c = (n - 1) / 2``
  (``net.branches[0] = 5``, ``max_contracts = 2``: -2, -1, 0, +1, +2); with volatility sizing
  (``target_volatility > 0``, ``market.position_sizing = 'volatility'``) those contracts x
  ``min(1, target_volatility / (ATR(14)_t / close_t))``: fractional, smaller when bar t's market is more volatile
  than the target, never more than the level;
* branch 1, protective stop: none, 1, 1.5, 2 or 3 x ATR(14) of bar t (:data:`STOP_ATR`);
* branch 2, take-profit: none, 1, 2, 3 or 5 x ATR(14) of bar t (:data:`TAKE_PROFIT_ATR`).

Execution on bar ``t + 1`` (all prices in points, ``slip = slippage_ticks x tick_size``):

1. the position held since the close of bar t is marked to bar t+1's open (the overnight gap);
2. the position moves to the target at the open: ``|target - held|`` contracts fill at ``open +- slip``
   and pay ``commission`` each;
3. a bracket is placed around the open for the rest of the bar: stop ``open -+ k_stop x ATR_t`` and target
   ``open +- k_take x ATR_t`` (rounded to the tick; none when k = 0). A long stops out when the low reaches
   the stop, takes profit when the high reaches the target (shorts mirrored); when both are touched in the
   same bar the **stop is assumed hit first**. A stop fills at the stop price with slippage (it becomes a
   market order), a take-profit at its limit price without slippage; both pay commission. The position is
   then flat until the next decision;
4. otherwise the position is marked to bar t+1's close.

The bracket is re-placed at every decision (relative to that bar's open), so choosing the same stop every
step is a stop that trails by whole bars. Reward (no goal bonus: :meth:`FuturesEnv.goal_reward` is added by the
replay at sample time), by ``market.reward``:

* ``'vol'``: the step's net P&L in currency / (ATR(14) of the decision bar x multiplier) x ``reward_scale`` --
  position x return / trailing volatility - costs, so a calm and a stressed year weigh the same;
* ``'pnl'``: the step's net P&L in currency x ``reward_scale``.

The agent state's unrealised P&L and cumulative reward are in the same units. ``market.reward_scale = 0``
(default) derives the scale from the training split (:func:`derive_reward_scale`): the standard deviation of the
full-position discounted return is ``net.v_max / market.reward_support_sigmas``, so returns sit inside the C51
support; :func:`fitdqn.resolve.resolve_for_market` writes the derived value into the run's config (train,
backtests, a resume and deploy use the same one).

Episodes are ``market.episode_length`` decisions from a random start bar in the split (start >= the feature
warm-up and >= ``window - 1``; start + episode_length <= the split's last bar). The last step liquidates any
position at bar t+1's close (slippage + commission), so an episode's reward is its full net P&L; it is flagged
terminal and last (the state carries the fraction of the episode left, so the end is part of the state).
Finished episodes reset inside :meth:`FuturesEnv.step` (static shapes, no host sync, no Python branch on a
tensor value: capturable in a CUDA graph; register ``env.generator`` with the graph,
``graph.register_generator_state(env.generator)``, when the graph is replayed more than once).

Goals (for HER): each episode draws a target cumulative reward uniformly in ``goal_range`` (default
``[0, goal_unit x sqrt(episode_length)]`` with ``goal_unit`` = the training split's median ATR in currency
for one contract in reward units: x reward_scale for 'pnl', reward_scale itself for 'vol'); the agent sees it
in the state (:data:`GOAL_COLUMN`); the bonus
``goal_reward`` is ``goal_unit`` when the episode's cumulative reward crosses the goal upwards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fitdqn.config import MarketConfig, knob_choices
from fitdqn.errors import UserError
from fitdqn.market.contract import ContractSpec
from fitdqn.market.layout import (
    AGENT_FIELDS,
    GOAL_COLUMN,
    NUM_AGENT_FIELDS,
    NUM_BRANCHES,
    NUM_FEATURES,
    STATE_DIM,
    STOP_ATR,
    TAKE_PROFIT_ATR,
    state_shapes,
    transition_spec,
)
from fitdqn.market.loader import Market, load_market
from fitdqn.market.observation import build_observation
from fitdqn.market.splits import Split
from fitdqn.ops.replay_gather import GoalCrossing
from fitdqn.transitions import EPISODE_END, TERMINAL, FieldSpec  # the transition contract: fields and flags bits

EXIT_NONE, EXIT_STOP, EXIT_TAKE_PROFIT, EXIT_EPISODE_END = 0, 1, 2, 3


def position_levels(levels: int, max_contracts: int) -> list[float]:
    """Contracts for each index of branch 0: ``levels`` (odd) values from -max to +max."""
    if levels < 3 or levels % 2 == 0:
        raise UserError(f"net.branches[0] must be odd and >= 3 (target positions -max..+max), got {levels}")
    if max_contracts < 1:
        raise UserError(f"market.max_contracts must be at least 1, got {max_contracts}")
    centre = (levels - 1) // 2
    return [float(round((i - centre) * max_contracts / centre)) for i in range(levels)]


def check_branches(branches: Sequence[int]) -> None:
    """The futures env's branches: (target positions, stop choices, take-profit choices), where a bracket branch
    offers all its choices or only the first, 'none' (``1``: the agent never places that order)."""
    branches = tuple(branches)
    if (len(branches) != NUM_BRANCHES or branches[1] not in (1, len(STOP_ATR))
            or branches[2] not in (1, len(TAKE_PROFIT_ATR))):
        raise UserError(
            f"net.branches = {branches}: the futures env has 3 branches (target position, stop, take-profit) "
            f"with {len(STOP_ATR)} stop and {len(TAKE_PROFIT_ATR)} take-profit choices, or 1 where the agent "
            "places none of them; use (5, 5, 5), (n, 5, 5), or (n, 1, 1) for target positions only"
        )


def typical_atr(atr: Tensor, start: int, stop: int) -> float:
    """Median ATR (points) over bars ``[start, stop)``; host sync."""
    span = atr[start:stop]
    return float(span.median()) if span.numel() else 1.0


def market_goal_unit(market: Market, window: int, reward_scale: float, reward: str) -> float:
    """The goal unit of every env on ``market``: the training split's median ATR for one contract in reward
    units (so train, validation and test envs share one goal scale and one HER bonus)."""
    if reward == "vol":  # one ATR of one contract is one reward unit before scaling
        return reward_scale
    train = market.split("train")
    atr = typical_atr(market.atr, market.first_bar(train, window), train.stop)
    return atr * market.contract.multiplier * reward_scale


REWARDS = knob_choices(MarketConfig, "reward")


@dataclass(frozen=True)
class RewardScale:
    """The derived reward scale and what it does to the training split's returns (host numbers)."""

    reward: str  # 'pnl' or 'vol'
    scale: float
    source: str  # 'derived' or 'given'
    return_std: float  # std of the full-position discounted return, in scaled reward units
    outside_one_step: float  # share of full-position one-step rewards outside [v_min, v_max]
    outside_n_step: float  # share of full-position n-step returns outside [v_min, v_max]
    target_volatility: float  # volatility sizing's ATR/close of a full level; 0: positions in contracts

    def describe(self) -> str:
        how = "derived from the training split" if self.source == "derived" else "market.reward_scale as given"
        sizing = (f"; positions sized by volatility: a level's full contracts at ATR/close <= "
                  f"{100 * self.target_volatility:.3g} %" if self.target_volatility > 0 else "")
        return (f"{self.reward} x {self.scale:.4g} ({how}); full-position discounted return std "
                f"{self.return_std:.2f}; outside the C51 support: {100 * self.outside_one_step:.2f} % of one-step "
                f"rewards, {100 * self.outside_n_step:.2f} % of n-step returns{sizing}")


def position_size(atr: Tensor, close: Tensor, tick: float, target_volatility: float) -> Tensor:
    """Volatility sizing: the share of a level's contracts held at bars of ``atr`` and ``close`` (same shape),
    ``min(1, target_volatility / (ATR / close))`` (ATR at least one tick)."""
    return (target_volatility * close / atr.clamp(min=tick)).clamp(max=1.0)


def training_bars(market: Market, window: int) -> tuple[Tensor, Tensor]:
    """``atr [N]`` and ``close [N]`` (float64) of the training split's decision bars, close to close."""
    train = market.split("train")
    first = market.first_bar(train, window)
    return market.atr[first:train.stop - 1].double(), market.prices[first:train.stop - 1, 3].double()


def sizing_target(market_config: MarketConfig) -> float:
    """The target volatility an env of ``market_config`` sizes by: ``market.target_volatility`` under 'volatility'
    sizing, 0 (whole contracts) under 'contracts'."""
    return market_config.target_volatility if market_config.position_sizing == "volatility" else 0.0


def derives_target(market_config: MarketConfig) -> bool:
    """Whether the volatility sizing's target is left to the data (:func:`derive_target_volatility`)."""
    return market_config.position_sizing == "volatility" and market_config.target_volatility <= 0


def derive_target_volatility(market: Market, window: int) -> float:
    """'volatility' sizing's target derived from the data: the median ATR(14) / close of the training split.
    Host sync."""
    atr, close = training_bars(market, window)
    return float(np.median((atr.clamp(min=market.contract.tick_size) / close).cpu().numpy()))


def full_position_rewards(market: Market, window: int, max_contracts: int, reward: str,
                          target_volatility: float) -> np.ndarray:
    """Unscaled one-step rewards of holding the full position (``max_contracts``, sized by ``target_volatility``
    when it is positive) through the training split, close to close ``[N]`` float64 (costs left out: they are a
    small, policy-dependent share). Host sync."""
    train = market.split("train")
    first = market.first_bar(train, window)
    close = market.prices[first:train.stop, 3].double().cpu().numpy()
    change = np.diff(close)  # [N] points per contract, decision bar t -> t + 1
    if target_volatility > 0:
        atr, close = training_bars(market, window)
        change = change * position_size(atr, close, market.contract.tick_size, target_volatility).cpu().numpy()
    if reward == "vol":
        atr = market.atr[first:train.stop - 1].double().cpu().numpy()
        per_contract = change / np.maximum(atr, market.contract.tick_size)
    elif reward == "pnl":
        per_contract = change * market.contract.multiplier
    else:
        raise UserError(f"market.reward must be one of {REWARDS}, got {reward!r}")
    return max_contracts * per_contract


def discounted_returns(rewards: np.ndarray, gamma: float, horizon: int) -> np.ndarray:
    """``G_t = sum_{k < horizon} gamma^k r_{t+k}`` for every t with a whole horizon left ``[N - horizon + 1]``."""
    horizon = max(1, min(int(horizon), rewards.shape[0]))
    count = rewards.shape[0] - horizon + 1
    out = np.zeros(count)
    for k in range(horizon):
        out += gamma**k * rewards[k:k + count]
    return out


def derive_reward_scale(market: Market, config) -> RewardScale:
    """The reward scale of ``config`` on ``market`` (``market.reward_scale`` if positive, else derived from the
    training split, module docstring) and where the training split's returns then fall."""
    m, learn, net = config.market, config.learn, config.net
    raw = full_position_rewards(market, net.window, m.max_contracts, m.reward, sizing_target(m))
    horizon = min(m.episode_length, max(learn.n_step, round(3.0 / max(1.0 - learn.gamma, 1e-6))))  # 3 time constants
    full = discounted_returns(raw, learn.gamma, horizon)
    if m.reward_scale > 0:
        scale, source = m.reward_scale, "given"
    else:
        std = float(full.std())
        scale, source = (net.v_max / (m.reward_support_sigmas * std) if std > 0 else 1.0), "derived"
    n_step = discounted_returns(raw, learn.gamma, learn.n_step) * scale

    def outside(values: np.ndarray) -> float:
        return float(np.mean((values < net.v_min) | (values > net.v_max))) if values.size else 0.0

    return RewardScale(m.reward, float(scale), source, float(full.std() * scale), outside(raw * scale),
                       outside(n_step), sizing_target(m))


def needs_resolving(market_config: MarketConfig) -> bool:
    """Whether ``market_config`` leaves a value to derive from the data (:func:`fitdqn.resolve.resolve_for_market`)."""
    return market_config.reward_scale <= 0 or derives_target(market_config)


class FuturesEnv:
    """E futures-trading episodes on one device; all state is tensors updated in place.

    The core constructor takes the device tensors directly (``prices [T, 4]`` open/high/low/close,
    ``atr [T]`` in points, ``features [T, Fm]``) and the bar range ``[first_bar, stop_bar)`` episodes live in
    (decisions at ``first_bar .. stop_bar - 2``, fills up to ``stop_bar - 1``). Use :meth:`from_config` for
    real data. ``sequential=True`` (backtests) starts the first episode of every env
    at ``first_bar`` and each next one where the previous ended, wrapping to ``first_bar`` at the split end.
    """

    def __init__(
        self,
        prices: Tensor,
        atr: Tensor,
        features: Tensor,
        contract: ContractSpec,
        *,
        first_bar: int,
        num_envs: int,
        window: int,
        episode_length: int,
        max_contracts: int,
        reward_scale: float,
        reward: str,
        risk_penalty: float,
        target_volatility: float,
        branches: Sequence[int],
        seed: int,
        stop_bar: int | None = None,
        sequential: bool = False,
        goal_range: tuple[float, float] | None = None,
        goal_unit: float | None = None,
        levels: Sequence[float] | None = None,
        device=None,
    ) -> None:
        device = torch.device(device) if device is not None else features.device
        T = int(prices.shape[0])
        stop_bar = T if stop_bar is None else int(stop_bar)
        check_branches(branches)
        self.branches = tuple(int(n) for n in branches)  # (target positions, stop choices, take-profit choices)
        if num_envs < 1 or episode_length < 1 or window < 1:
            raise UserError("num_envs, episode_length and window must all be at least 1")
        if tuple(prices.shape) != (T, 4) or tuple(atr.shape) != (T,) or tuple(features.shape) != (T, NUM_FEATURES):
            raise ValueError(
                f"prices [T, 4], atr [T], features [T, Fm = {NUM_FEATURES}] disagree: {prices.shape}, {atr.shape}, "
                f"{features.shape}"
            )
        if first_bar < window - 1:
            raise UserError(
                f"first_bar {first_bar} < window - 1 = {window - 1}: the first obs window would "
                "start before bar 0"
            )
        if not 0 < stop_bar <= T:
            raise ValueError(f"stop_bar {stop_bar} outside 1..{T}")
        self.last_bar = stop_bar - 1  # the last bar a fill can happen on
        if sequential:
            if self.last_bar <= first_bar:
                raise UserError(f"bars {first_bar}..{stop_bar - 1}: nothing to trade (need at least 2 bars)")
            last_start = first_bar
        else:
            last_start = self.last_bar - episode_length
            if last_start < first_bar:
                raise UserError(
                    f"bars {first_bar}..{stop_bar - 1} ({stop_bar - first_bar} after the warm-up) "
                    f"cannot hold an episode of {episode_length} steps (needs {episode_length + 1} bars); "
                    "lower market.episode_length or give more bars"
                )
        self.device = device
        self.num_envs = int(num_envs)
        self.window = int(window)
        self.episode_length = int(episode_length)
        self.max_contracts = int(max_contracts)
        if reward not in REWARDS:
            raise UserError(f"market.reward must be one of {REWARDS}, got {reward!r}")
        if not reward_scale > 0:
            raise UserError("the reward scale must be positive: resolve market.reward_scale = 0 with "
                            "fitdqn.resolve.resolve_for_market(config, market) first")
        self.reward_scale = float(reward_scale)
        self.reward_mode = reward
        if not risk_penalty >= 0:
            raise UserError(f"market.risk_penalty must be at least 0, got {risk_penalty}")
        self.risk_penalty = float(risk_penalty)  # reward r -> r - risk_penalty x r^2 (0: the plain reward)
        if not (math.isfinite(target_volatility) and target_volatility >= 0):
            raise UserError("the volatility sizing's target must be >= 0 (0: positions in contracts); resolve "
                            "market.target_volatility = 0 with fitdqn.resolve.resolve_for_market(config, market)")
        self.target_volatility = float(target_volatility)  # 0: a level is its contracts
        self.sequential = bool(sequential)
        self.contract = contract
        self.first_bar = int(first_bar)
        self.stop_bar = stop_bar
        self.num_starts = last_start - self.first_bar + 1
        self.multiplier = float(contract.multiplier)
        self.tick = float(contract.tick_size)
        self.slip = float(contract.slippage)  # points per contract on market/stop fills
        self.commission = float(contract.commission)

        self.prices = prices.to(device=device, dtype=torch.float32).contiguous()  # [T, 4]
        self.atr = atr.to(device=device, dtype=torch.float32).contiguous()  # [T]
        self.features = features.to(device=device, dtype=torch.float32).contiguous()  # [T, Fm]
        # contracts of each branch-0 index: the config's levels, or ``levels`` (an ensemble of policies trades the
        # means of its members' levels: fitdqn.evaluate.ensemble)
        self.position_levels = torch.tensor(position_levels(branches[0], max_contracts) if levels is None
                                            else [float(v) for v in levels], device=device)
        self.stop_levels = torch.tensor(STOP_ATR, device=device)
        self.take_levels = torch.tensor(TAKE_PROFIT_ATR, device=device)

        if goal_unit is None and reward == "vol":
            goal_unit = self.reward_scale
        elif goal_unit is None:  # host sync (construction only): the range's typical ATR sets the goal scale
            goal_unit = typical_atr(self.atr, self.first_bar, stop_bar) * self.multiplier * self.reward_scale
        self.goal_unit = float(goal_unit)
        self.goal_bonus = self.goal_unit
        self.goal_range = (
            (0.0, self.goal_unit * math.sqrt(self.episode_length))
            if goal_range is None
            else tuple(goal_range)
        )

        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(seed))
        for name, (shape, dtype) in state_shapes(self.num_envs).items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
        self.reset()

    # ------------------------------------------------------------------------------------------ builders
    @classmethod
    def from_config(
        cls,
        config,
        split: str | Split,
        *,
        market: Market | None = None,
        device=None,
        num_envs: int | None = None,
        seed: int | None = None,
        sequential: bool = False,
        goal_unit: float | None = None,
        levels: Sequence[float] | None = None,
    ) -> FuturesEnv:
        """The env factory every run part builds its envs with (training, backtests, deploy): an env over ``split``
        of ``market`` (a split's name, or a :class:`Split` of bars for a range of one's own) as the resolved
        :class:`fitdqn.config.Config` sets it (``market.*``, ``net.window``, ``net.branches``; ``collect.num_envs``
        and ``train.seed`` unless given). The market's tensors are shared, not copied (without ``market`` one is
        loaded from ``config.market`` on ``device``). ``goal_unit``: HER's goal scale when it is known without
        reading the market's tensors (a stand-in market), else the training split's
        (:func:`market_goal_unit`); ``levels``: branch 0's contracts where not the config's (an ensemble's means)."""
        if needs_resolving(config.market):
            raise UserError("market.reward_scale or market.target_volatility is left to the data: resolve the config "
                            "with fitdqn.resolve.resolve_for_market(config, market) before building an env")
        if market is None:
            market = load_market(config.market, window=config.net.window, device=device)
        m, window = config.market, config.net.window
        s = market.split(split)
        return cls(
            market.prices,
            market.atr,
            market.features,
            market.contract,
            first_bar=market.first_bar(s, window),
            stop_bar=s.stop,
            num_envs=config.collect.num_envs if num_envs is None else num_envs,
            window=window,
            episode_length=m.episode_length,
            max_contracts=m.max_contracts,
            reward_scale=m.reward_scale,
            reward=m.reward,
            risk_penalty=m.risk_penalty,
            target_volatility=sizing_target(m),
            branches=config.net.branches,
            seed=config.train.seed if seed is None else seed,
            sequential=sequential,
            goal_unit=market_goal_unit(market, window, m.reward_scale, m.reward) if goal_unit is None else goal_unit,
            levels=levels,
        )

    # ------------------------------------------------------------------------------------------ contract
    @property
    def state_dim(self) -> int:
        """S of the observations ``[E, W, S]``: :data:`STATE_DIM` (the features are checked to be Fm wide)."""
        return STATE_DIM

    @staticmethod
    def transition_spec() -> dict[str, FieldSpec]:
        return transition_spec()

    @property
    def goal_reward(self) -> GoalCrossing:
        """HER bonus, ``goal_reward(achieved_before, achieved_after, goal)``: ``goal_bonus`` where the cumulative
        reward crosses ``goal`` upwards (pure tensor op; a :class:`~fitdqn.ops.replay_gather.GoalCrossing`, which the
        replay's gather operator takes by its bonus)."""
        return GoalCrossing(self.goal_bonus)

    def observation(self) -> Tensor:
        """Current observations ``[E, W, S]`` float32."""
        return build_observation(self.features, self.bar, self.agent, self.window)

    def target_contracts(self, position_index: Tensor, atr: Tensor, close: Tensor) -> Tensor:
        """Contracts that branch 0's ``position_index [E]`` aims for at a decision bar of ``atr [E]`` and
        ``close [E]``: the level, x ``min(1, target_volatility / (ATR / close))`` under volatility sizing."""
        target = self.position_levels[position_index]  # [E]
        if self.target_volatility > 0:  # a Python float fixed at construction: volatility sizing
            target = target * position_size(atr, close, self.tick, self.target_volatility)
        return target

    # ------------------------------------------------------------------------------------------ episodes
    def _draw(self) -> tuple[Tensor, Tensor]:
        """Fresh random start bars and goals for every env (``[E]`` each): always drawn, used where needed."""
        u = torch.rand((2, self.num_envs), generator=self.generator, device=self.device)  # [2, E]
        start = self.first_bar + (u[0] * self.num_starts).long().clamp(max=self.num_starts - 1)
        low, high = self.goal_range
        goal = low + u[1] * (high - low)
        return start, goal

    def _fresh_agent(self, goal: Tensor) -> Tensor:
        agent = torch.zeros((goal.shape[0], NUM_AGENT_FIELDS), device=self.device)
        agent[:, GOAL_COLUMN] = goal
        agent[:, AGENT_FIELDS.index("episode_left")] = 1.0
        return agent

    def reset(self, seed: int | None = None) -> Tensor:
        """Start a new episode in every env; returns the observations ``[E, W, S]``."""
        if seed is not None:
            self.generator.manual_seed(int(seed))
        start, goal = self._draw()
        if self.sequential:
            start = torch.full_like(start, self.first_bar)
        self.bar.copy_(start)
        for name in (
            "episode_step",
            "position",
            "entry_price",
            "time_in_trade",
            "stop_k",
            "take_k",
            "achieved",
        ):
            getattr(self, name).zero_()
        self.goal.copy_(goal)
        self.agent.copy_(self._fresh_agent(goal))
        return self.observation()

    def step(self, action: Tensor) -> dict[str, Tensor]:
        """Decide at the close of ``bar``, fill on ``bar + 1``; auto-reset finished episodes.

        ``action [E, 3]`` integer sub-action indices. Returns the transition fields (``transition_spec``:
        bar, agent, action, reward, achieved, next_agent, episode_step, flags), the post-reset inputs of the
        next observation (``current_bar [E]`` int64, ``current_agent [E, Fa]``) and backtest extras in
        currency and contracts: ``pnl`` (net), ``cost`` (commission + slippage), ``target`` (the contracts aimed
        for at the open), ``position`` (held at the fill bar's close, before an end-of-episode liquidation),
        ``traded`` (contracts filled) and ``exit`` (EXIT_* code). No host sync; no Python branch on tensor values.
        """
        L = self.episode_length
        a = action.long()  # [E, 3]
        b0 = self.bar.clone()  # [E] decision bar (a copy: self.bar is overwritten in place below)
        b1 = b0 + 1  # [E] fill bar
        px = self.prices[b1]  # [E, 4]
        o1, h1, l1, c1 = px.unbind(-1)  # [E] each
        c0 = self.prices[b0, 3]  # [E]
        atr0 = self.atr[b0]  # [E]
        agent_before = self.agent.clone()  # [E, Fa]
        step_before = self.episode_step.clone()

        held_before = self.position.clone()  # [E] contracts
        target = self.target_contracts(a[:, 0], atr0, c0)  # [E] (the decision bar's ATR and close, gathered above)
        k_stop = self.stop_levels[a[:, 1]]
        k_take = self.take_levels[a[:, 2]]
        trade = target - held_before  # contracts bought (+) / sold (-) at the open
        side = torch.sign(target)

        # bracket around the open, from the ATR known at the decision
        stop_px = torch.round((o1 - side * k_stop * atr0) / self.tick) * self.tick
        take_px = torch.round((o1 + side * k_take * atr0) / self.tick) * self.tick
        is_long, is_short = target > 0, target < 0
        stop_hit = (k_stop > 0) & ((is_long & (l1 <= stop_px)) | (is_short & (h1 >= stop_px)))
        take_hit = (k_take > 0) & ~stop_hit & ((is_long & (h1 >= take_px)) | (is_short & (l1 <= take_px)))
        exited = stop_hit | take_hit
        exit_px = torch.where(stop_hit, stop_px - side * self.slip, torch.where(take_hit, take_px, c1))
        held = torch.where(exited, torch.zeros_like(target), target)  # [E] at the fill bar's close

        last = (step_before == L - 1) | (b1 >= self.last_bar)  # [E] bool
        liquidated = torch.where(last, held, torch.zeros_like(held))
        held_after = held - liquidated

        # P&L in points, then currency
        traded_open = trade.abs()
        traded_liq = liquidated.abs()
        points = held_before * (o1 - c0) + target * (exit_px - o1) - self.slip * (traded_open + traded_liq)
        fills = traded_open + exited.to(target.dtype) * target.abs() + traded_liq  # contracts filled
        commission = self.commission * fills
        pnl = points * self.multiplier - commission  # [E] currency, net
        slip_stop = stop_hit.to(target.dtype) * target.abs() * self.slip
        cost = (self.slip * (traded_open + traded_liq) + slip_stop) * self.multiplier + commission
        # reward units per currency unit: 'vol' divides by the decision bar's ATR of one contract
        unit = (self.reward_scale / (atr0.clamp(min=self.tick) * self.multiplier) if self.reward_mode == "vol"
                else self.reward_scale)  # [E] or a float
        reward = pnl * unit
        if self.risk_penalty > 0:  # a Python float fixed at construction: mean-variance utility of the step
            reward = reward - self.risk_penalty * reward * reward

        # average entry price and time in trade of what is held after the step
        fill_px = o1 + torch.sign(trade) * self.slip
        same_side = held_before * target > 0
        grew = same_side & (target.abs() > held_before.abs())
        fresh = (target != 0) & ~same_side
        blended = (self.entry_price * held_before.abs() + fill_px * traded_open) / target.abs().clamp(min=1e-6)
        entry = torch.where(fresh, fill_px, torch.where(grew, blended, self.entry_price))
        open_after = held_after != 0
        entry = torch.where(open_after, entry, torch.zeros_like(entry))
        in_trade = torch.where(fresh, torch.ones_like(entry), self.time_in_trade + 1.0)
        in_trade = torch.where(open_after, in_trade, torch.zeros_like(in_trade))
        unrealised = held_after * (c1 - entry) * self.multiplier * unit

        achieved = self.achieved + reward
        step_after = step_before + 1
        left = (L - step_after).to(torch.float32) / L
        next_agent = torch.stack(
            [
                held_after / self.max_contracts,
                unrealised,
                in_trade / L,
                k_stop / STOP_ATR[-1],
                k_take / TAKE_PROFIT_ATR[-1],
                self.goal,
                achieved,
                left,
            ],
            dim=1,
        )  # [E, Fa]
        flags = last.to(torch.uint8) * (TERMINAL | EPISODE_END)
        u8 = torch.uint8  # the three exits are exclusive (a liquidation needs a position still held)
        exit_code = (
            stop_hit.to(u8) * EXIT_STOP
            + take_hit.to(u8) * EXIT_TAKE_PROFIT
            + (last & (held != 0)).to(u8) * EXIT_EPISODE_END
        )

        # auto-reset (computed for every env, applied where the episode ended)
        new_start, new_goal = self._draw()
        if self.sequential:  # Python bool fixed at construction: continue where the last episode ended
            new_start = torch.where(b1 >= self.last_bar, torch.full_like(b1, self.first_bar), b1)
        zero = torch.zeros_like(target)
        self.bar.copy_(torch.where(last, new_start, b1))
        self.episode_step.copy_(torch.where(last, torch.zeros_like(step_after), step_after))
        self.position.copy_(held_after)
        self.entry_price.copy_(entry)
        self.time_in_trade.copy_(in_trade)
        self.stop_k.copy_(torch.where(last, zero, k_stop))
        self.take_k.copy_(torch.where(last, zero, k_take))
        self.goal.copy_(torch.where(last, new_goal, self.goal))
        self.achieved.copy_(torch.where(last, zero, achieved))
        self.agent.copy_(torch.where(last[:, None], self._fresh_agent(new_goal), next_agent))

        return {
            "bar": b0.to(torch.int32),
            "agent": agent_before,
            "action": action.to(torch.uint8),
            "reward": reward,
            "achieved": achieved,
            "next_agent": next_agent,
            "episode_step": step_before.to(torch.int32),
            "flags": flags,
            "current_bar": self.bar.clone(),
            "current_agent": self.agent.clone(),
            "pnl": pnl,
            "cost": cost,
            "target": target,
            "position": held,
            "traded": fills,
            "exit": exit_code,
        }
