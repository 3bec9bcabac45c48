"""The trained policy's decisions on new bars: target position and bracket for every bar.

The bars go through the same pipeline as training (:func:`fitdqn.market.loader.market_from_bars`: causal
features, ATR(14)) and the policy is run by the backtest itself (:func:`fitdqn.evaluate.backtest.run_backtest` on a
sequential :class:`~fitdqn.market.env.FuturesEnv`), so the agent state it sees (position held, open P&L, time in
trade, last bracket, the episode's goal and progress) is built exactly as in the run's backtests: episodes of
``market.episode_length`` decisions, a position liquidated at each episode's end, the goal in the middle of the
training goal range. On the run's own bars, started at the test split's first decision bar, the decisions are
the test backtest's, action for action.

A decision at bar ``t`` is made at its close and fills at the open of bar ``t + 1``. The last bar of the file gets
a decision too (the one to trade at the next open): the env needs a bar to fill it on, so a copy of the last close
is appended for the fill and that row's P&L is left empty. The bracket's prices are measured from the fill bar's
open where it is known, else (the last row) from the last close: ``bracket_from`` says which price was used.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fitdqn.deploy.policy import RunPolicy
from fitdqn.errors import UserError
from fitdqn.evaluate.backtest import run_backtest
from fitdqn.files import atomic_write_bytes
from fitdqn.market.data import bars_from_config
from fitdqn.market.env import STOP_ATR, TAKE_PROFIT_ATR, FuturesEnv
from fitdqn.market.loader import market_from_bars
from fitdqn.market.splits import Split

ACTION_COLUMNS = ("action_position", "action_stop", "action_take_profit")  # sub-action index per branch


def with_fill_bar(bars: pd.DataFrame) -> pd.DataFrame:
    """``bars`` plus one bar after the last (OHLC = the last close, volume = the last volume) to fill the last
    decision on; its features are never observed (a decision at bar t sees bars <= t)."""
    last = bars.iloc[-1]
    spacing = bars["timestamp"].diff().median() if len(bars) > 1 else pd.Timedelta(days=1)
    extra = {column: last[column] for column in bars.columns}
    extra.update(timestamp=last["timestamp"] + spacing, open=last["close"], high=last["close"], low=last["close"])
    return pd.concat([bars, pd.DataFrame([extra])], ignore_index=True)


def first_decision_bar(bars: pd.DataFrame, warmup_bar: int, start: str | pd.Timestamp | None) -> int:
    """The first bar to decide at: at or after ``start`` (a timestamp) and after the features' warm-up."""
    if start is None:
        return warmup_bar
    try:
        when = pd.Timestamp(start)
    except (ValueError, TypeError):
        raise UserError(f"--start {start!r} is not a date or time; write it like 2016-01-04 or "
                        "'2016-01-04 09:30'") from None
    stamps = bars["timestamp"]
    if when.tzinfo is None and getattr(stamps.dt, "tz", None) is not None:
        when = when.tz_localize(stamps.dt.tz)
    later = np.flatnonzero((stamps >= when).to_numpy())
    if later.size == 0:
        raise UserError(f"--start {start}: the bars end at {stamps.iloc[-1]}; give an earlier start")
    return max(int(later[0]), warmup_bar)


def act_on_bars(policy: RunPolicy, bars: pd.DataFrame, *, start: str | pd.Timestamp | None = None,
                goal_unit: float | None = None) -> pd.DataFrame:
    """One row per decision bar of ``bars`` (canonical columns, :func:`fitdqn.market.data.normalise_bars`), from
    ``start`` (default: the first bar after the features' warm-up) to the last bar.

    Columns: ``timestamp``, ``close``, ``atr`` (ATR(14), points) of the decision bar; ``held`` (contracts held
    into the decision), ``target`` (contracts to hold after the next open: fractional under volatility sizing, as
    the backtests hold them), ``target_whole`` (the nearest whole number of contracts, halves away from zero: what
    an account can trade), ``stop_atr`` / ``take_profit_atr``
    (ATR multiples, 0 = none), ``stop_price`` / ``take_profit_price`` (empty when none or flat),
    ``bracket_from`` ('next_open' or 'close'), the sub-action indices, and ``pnl`` (net currency of the step,
    filled on the next bar; empty on the last row).
    """
    config = policy.config
    net, market_config = config.net, config.market
    window = net.window
    market = market_from_bars(
        with_fill_bar(bars), policy.contract, name="act", train_fraction=market_config.train_fraction,
        validation_fraction=market_config.validation_fraction, device=policy.device,
    )
    num_bars = len(bars)  # real bars; bar num_bars is the appended fill bar
    first = first_decision_bar(bars, max(market.warmup, window - 1), start)
    if first > num_bars - 1:
        raise UserError(
            f"the bars have {num_bars} rows; the features need {market.warmup} bars of history before the first "
            f"decision (and the observation window {window}): give at least {market.warmup + 1} bars"
        )
    unit = policy.goal_unit() if goal_unit is None else float(goal_unit)
    bars_to_act_on = Split("act", first, num_bars + 1)  # every decision bar from ``first``; the fill bar last
    env = FuturesEnv.from_config(config, bars_to_act_on, market=market, num_envs=1, seed=0, sequential=True,
                                 goal_unit=unit, levels=policy.levels())
    goal = 0.5 * (env.goal_range[0] + env.goal_range[1])  # as the backtests: the middle of the goal range
    env.goal_range = (goal, goal)

    act = policy.acting()  # a run's network, or a study's ensemble (branch 0 then indexes its mean positions)
    actions, held = [], []

    def recording(obs: torch.Tensor) -> torch.Tensor:
        held.append(env.position.clone())  # [1] contracts held into the decision
        action = act(obs)  # [1, 3]
        actions.append(action)
        return action

    backtest = run_backtest(env, recording, split="act", timestamps=None)  # one env: one segment, bar by bar
    # host sync: the decisions
    action = torch.cat(actions).cpu().numpy()  # [N, 3]
    held_np = torch.cat(held).double().cpu().numpy()  # [N]
    decision = backtest.decision_bar  # [N]
    prices = market.prices.double().cpu().numpy()  # [T + 1, 4]
    atr = market.atr.double().cpu().numpy()[decision]  # [N]
    close = prices[decision, 3]  # float32 on the device, as the env sees it
    known = decision + 1 < num_bars  # the fill bar is a real bar
    base = np.where(known, prices[decision + 1, 0], close)
    target = backtest.target
    side = np.sign(target)
    k_stop = np.asarray(STOP_ATR)[action[:, 1]]
    k_take = np.asarray(TAKE_PROFIT_ATR)[action[:, 2]]
    tick = float(policy.contract.tick_size)
    stop_price = np.round((base - side * k_stop * atr) / tick) * tick  # as FuturesEnv.step places them
    take_price = np.round((base + side * k_take * atr) / tick) * tick
    frame = pd.DataFrame({
        "timestamp": bars["timestamp"].to_numpy()[decision],
        "close": bars["close"].to_numpy()[decision],  # as given
        "atr": atr,
        "held": held_np,
        "target": target,
        "target_whole": whole_contracts(target),
        "stop_atr": k_stop,
        "take_profit_atr": k_take,
        "stop_price": np.where((k_stop > 0) & (side != 0), stop_price, np.nan),
        "take_profit_price": np.where((k_take > 0) & (side != 0), take_price, np.nan),
        "bracket_from": np.where(known, "next_open", "close"),
        **{name: action[:, i] for i, name in enumerate(ACTION_COLUMNS)},
        "pnl": np.where(known, backtest.pnl, np.nan),
    })
    return frame


def write_actions(frame: pd.DataFrame, out: str | Path) -> Path:
    """CSV (``.csv``) or Parquet (``.parquet``/``.pq``), chosen by the suffix."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".csv", ".parquet", ".pq"):
        raise UserError(f"--out {out}: write the decisions to a .csv or .parquet file")
    if suffix == ".csv":  # a temp file renamed into place: a full disk keeps the previous decisions whole
        return atomic_write_bytes(out, lambda file: frame.to_csv(file, index=False))
    return atomic_write_bytes(out, lambda file: frame.to_parquet(file, index=False))


def act_run(policy: RunPolicy, data: str | Path, *, start: str | None = None,
            goal_unit: float | None = None) -> pd.DataFrame:
    """:func:`act_on_bars` on ``data``: a CSV/Parquet file of bars or a built-in data set (``sp500``, ``nasdaq``,
    ``synthetic``: the run's own synthetic market), read as ``market.data`` is (``load_bars``)."""
    bars = bars_from_config(dataclasses.replace(policy.config.market, data=str(data)))
    return act_on_bars(policy, bars, start=start, goal_unit=goal_unit)


def whole_contracts(contracts: np.ndarray) -> np.ndarray:
    """The nearest whole number of contracts, halves away from zero (0.5 -> 1, -1.5 -> -2); float, like ``target``."""
    return np.sign(contracts) * np.floor(np.abs(contracts) + 0.5) + 0.0  # + 0.0: no -0
