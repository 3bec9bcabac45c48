"""The shapes of the market side, without the data: features, the agent state, actions, transitions, env state
and the market's device tensors. Everything here is constants and shape functions (torch dtypes, no pandas), so
the planner sizes the collector and the replay from them without importing the data pipeline; the modules that
build the real objects (``features``, ``env``, ``loader``) import them from here.
"""

from __future__ import annotations

import torch

from fitdqn.memory.component import tensor_bytes
from fitdqn.transitions import FieldSpec

RETURN_HORIZONS = (1, 2, 3, 5, 10, 20, 40, 60)
LAGS = (1, 2, 3, 4, 5)
SMA_PERIODS = (5, 10, 20, 50, 100)
EMA_PERIODS = (8, 21, 55)
CHANNELS = (10, 20, 60)
LONG = 120  # window of the rolling z-scores of slow-moving levels

VOLUME_FEATURES = (  # off (0) for bars without volume
    "volume_z_20",
    "volume_z_60",
    "volume_5_20",
    "volume_change",
    "signed_volume",
    "obv_10",
    "cmf_20",
    "dist_vwap_20",
)


FEATURE_NAMES: list[str] = (
    [f"ret_{h}" for h in RETURN_HORIZONS]
    + [f"ret_1_lag{k}" for k in LAGS]
    + ["gap", "open_to_close"]
    + ["candle_body", "candle_upper_wick", "candle_lower_wick", "range_atr", "true_range_atr"]
    + [
        "vol_5_20",
        "vol_10_20",
        "vol_20_60",
        "vol_60_120",
        "vol_20_z",
        "parkinson_20",
        "atr_pct_z",
        "atr_5_14",
    ]
    + ["rsi_7", "rsi_14", "rsi_28"]
    + ["macd", "macd_signal", "macd_hist", "macd_hist_change"]
    + [f"dist_sma_{n}" for n in SMA_PERIODS]
    + [f"dist_ema_{n}" for n in EMA_PERIODS]
    + ["sma_20_slope", "sma_50_slope"]
    + [f"channel_{n}" for n in CHANNELS]
    + ["dist_high_20", "dist_low_20", "bollinger_z", "bollinger_width_z"]
    + ["skew_20", "autocorr_20", "up_fraction_10", "up_fraction_20", "efficiency_10", "efficiency_30"]
    + list(VOLUME_FEATURES)
    + ["weekday_sin", "weekday_cos", "month_sin", "month_cos", "time_of_day_sin", "time_of_day_cos"]
)
NUM_FEATURES = len(FEATURE_NAMES)  # Fm
# Rows with too little history for the longest window: the z-score of log(20-bar vol) over 120 values
# needs rows 1..20 for the first vol and 119 more (row 139 is the first valid row); 140 keeps a margin of 1.
WARMUP = 140

AGENT_FIELDS: tuple[str, ...] = (
    "position",  # contracts held / max_contracts, in [-1, 1]
    "unrealised_pnl",  # open P&L in reward units (marked at the close)
    "time_in_trade",  # steps since the position was opened / episode_length
    "stop_distance",  # ATR multiple of the last stop chosen / max(STOP_ATR) (0 = none)
    "take_profit_distance",  # ATR multiple of the last take-profit chosen / max(TAKE_PROFIT_ATR)
    "goal",  # the episode's target cumulative reward (reward units)
    "achieved",  # the episode's cumulative reward so far (reward units)
    "episode_left",  # fraction of the episode's steps still to come, 1 -> 0
)
NUM_AGENT_FIELDS = len(AGENT_FIELDS)  # Fa
GOAL_COLUMN = AGENT_FIELDS.index("goal")
ACHIEVED_COLUMN = AGENT_FIELDS.index("achieved")
# S = Fm + Fa: the width of one observation token, the networks' input. The one definition: the env, the
# learner of a run, the planner and the exported policy all read this (FuturesEnv.state_dim is the same value).
STATE_DIM = NUM_FEATURES + NUM_AGENT_FIELDS
assert STATE_DIM == 80, "DESIGN.md: the state is 80 wide (Fm = 80 - Fa)"

STOP_ATR: tuple[float, ...] = (0.0, 1.0, 1.5, 2.0, 3.0)  # branch 1 (0 = no stop)
TAKE_PROFIT_ATR: tuple[float, ...] = (0.0, 1.0, 2.0, 3.0, 5.0)  # branch 2 (0 = no take-profit)
NUM_BRANCHES = 3

PRICE_COLUMNS = ("open", "high", "low", "close")


def transition_spec() -> dict[str, FieldSpec]:
    """The transition fields the env writes (DESIGN.md), one row per env per step."""
    return {
        "bar": FieldSpec((), torch.int32),
        "agent": FieldSpec((NUM_AGENT_FIELDS,), torch.float32),
        "action": FieldSpec((NUM_BRANCHES,), torch.uint8),
        "reward": FieldSpec((), torch.float32),
        "achieved": FieldSpec((), torch.float32),
        "next_agent": FieldSpec((NUM_AGENT_FIELDS,), torch.float32),
        "episode_step": FieldSpec((), torch.int32),
        "flags": FieldSpec((), torch.uint8),
    }


def state_shapes(num_envs: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The env's persistent per-episode tensors: name -> (shape, dtype). Allocation and byte counts use it."""
    E = int(num_envs)
    f32 = torch.float32
    return {
        "bar": ((E,), torch.int64),  # decision bar (the obs window ends here)
        "episode_step": ((E,), torch.int64),
        "position": ((E,), f32),  # contracts held at the close of `bar`
        "entry_price": ((E,), f32),  # average fill price of the open position (0 when flat)
        "time_in_trade": ((E,), f32),  # steps
        "stop_k": ((E,), f32),  # last stop ATR multiple chosen
        "take_k": ((E,), f32),  # last take-profit ATR multiple chosen
        "goal": ((E,), f32),
        "achieved": ((E,), f32),
        "agent": ((E, NUM_AGENT_FIELDS), f32),  # the agent state at `bar` (built from the above)
    }


def env_state_bytes(num_envs: int) -> int:
    """Device bytes of the persistent env state for ``num_envs`` episodes (market tensors not included:
    see :func:`market_bytes`)."""
    return sum(tensor_bytes(shape, dtype) for shape, dtype in state_shapes(num_envs).values())


def market_tensor_shapes(num_bars: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The device tensors a Market holds: name -> (shape, dtype). Allocation and byte counts both use it."""
    return {
        "features": ((num_bars, NUM_FEATURES), torch.float32),
        "prices": ((num_bars, len(PRICE_COLUMNS)), torch.float32),
        "atr": ((num_bars,), torch.float32),
    }


def market_bytes(num_bars: int) -> int:
    """Device bytes of a Market's tensors for ``num_bars`` bars."""
    return sum(tensor_bytes(shape, dtype) for shape, dtype in market_tensor_shapes(num_bars).values())
