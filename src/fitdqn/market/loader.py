"""One call from a MarketConfig to everything the environment needs on the device.

:func:`load_market` reads the bars, resolves the contract (and checks it fits the prices), computes the
causal features and the raw ATR, splits the bars in time and checks there are enough of them, then moves
``features [T, Fm]``, ``prices [T, 4]`` and ``atr [T]`` to the device once (they stay there for every env
built on them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fitdqn.errors import UserError
from fitdqn.market.contract import ContractSpec, check_contract_fits, contract_for, shipped_contract_for
from fitdqn.market.layout import (
    PRICE_COLUMNS,
    WARMUP,
    market_tensor_shapes,
)
from fitdqn.market.splits import Split, split_bars

if TYPE_CHECKING:  # the data pipeline (pandas) is imported where bars are read, not by the planner's stand-in
    import pandas as pd

ATR_PERIOD = 14  # the ATR the env sizes stops and take-profits with (the state's atr feature uses it too)


@dataclass
class Market:
    """Bars, contract, splits and the device tensors built from them."""

    name: str
    bars: pd.DataFrame | None  # canonical columns: timestamp, open, high, low, close, volume (None: a stand-in)
    contract: ContractSpec
    splits: dict[str, Split]
    features: Tensor  # [T, Fm] float32, causal, rows < warmup are 0
    prices: Tensor  # [T, 4] float32: open, high, low, close
    atr: Tensor  # [T] float32: ATR(14) in price points (0 before it exists)
    warmup: int
    volume_features: bool  # False when the bars have no volume (the volume features are 0)

    @cached_property
    def bars_per_year(self) -> float:
        """Bars per year of these bars' own calendar (:func:`fitdqn.market.data.bars_per_year`)."""
        from fitdqn.market.data import bars_per_year

        return bars_per_year(self.bars["timestamp"])

    @property
    def notes(self) -> list[str]:
        """Lines for the plan and the report: the contract traded, volume features off, bars per year."""
        lines = [f"contract: {self.contract.summary}"]
        if not self.volume_features:
            missing = "volume_column" in self.bars.attrs and self.bars.attrs["volume_column"] is None
            lines.append(f"volume features off ({'no volume column' if missing else 'every volume is 0'})")
        lines.append(f"bars per year: {self.bars_per_year:,.0f} (from the bars' own calendar)")
        return lines

    @property
    def num_bars(self) -> int:
        return int(self.prices.shape[0])

    @property
    def device(self) -> torch.device:
        return self.features.device

    def split(self, name: str | Split) -> Split:
        if isinstance(name, Split):
            return name
        if name not in self.splits:
            raise UserError(f"unknown split '{name}'; use one of {', '.join(self.splits)}")
        return self.splits[name]

    def first_bar(self, split: str | Split, window: int) -> int:
        """First bar an episode may start at in ``split``: after the feature warm-up and a full obs window."""
        return max(self.split(split).start, self.warmup, window - 1)


def market_from_bars(
    bars: pd.DataFrame,
    contract: ContractSpec,
    *,
    train_fraction: float,
    validation_fraction: float,
    name: str = "bars",
    device=None,
) -> Market:
    """A Market from a canonical bar frame (see :func:`fitdqn.market.data.normalise_bars`)."""
    from fitdqn.market.features import atr, bar_tensors, compute_features, has_volume  # the data pipeline (pandas)

    features = compute_features(bars, device=device)
    b = bar_tensors(bars, device)
    raw_atr = torch.nan_to_num(atr(b["high"], b["low"], b["close"], ATR_PERIOD), nan=0.0)
    prices = torch.stack([b[k] for k in PRICE_COLUMNS], dim=1)
    shapes = market_tensor_shapes(len(bars))
    tensors = {"features": features, "prices": prices, "atr": raw_atr}
    tensors = {k: t.to(shapes[k][1]).contiguous() for k, t in tensors.items()}
    return Market(
        name=name,
        bars=bars,
        contract=contract,
        splits=split_bars(len(bars), train_fraction, validation_fraction),
        warmup=WARMUP,
        volume_features=has_volume(bars),
        **tensors,
    )


def check_enough_bars(market: Market, window: int, episode_length: int) -> None:
    """UserError unless the train split holds one episode after the warm-up and each other split one step."""
    train = market.splits["train"]
    first = market.first_bar(train, window)
    need_train = first + episode_length + 1  # bars 0 .. first + episode_length
    if train.stop < need_train:
        need_total = math.ceil(need_train * market.num_bars / max(train.stop, 1))
        raise UserError(
            f"market data '{market.name}' has {market.num_bars} bars, so the training split has "
            f"{train.stop}; an "
            f"episode needs {need_train} (feature warm-up {market.warmup} bars, observation window {window}, "
            f"episode_length {episode_length} + 1); give about {need_total} bars or more, or lower "
            "market.episode_length (or net.window), or raise market.train_fraction"
        )
    for name in ("validation", "test"):
        split = market.splits[name]
        if split.stop - market.first_bar(split, window) < 2:
            raise UserError(
                f"market data '{market.name}': the {name} split has {len(split)} bars, too few to trade "
                "after "
                f"the warm-up; give more bars or change market.train_fraction / market.validation_fraction"
            )


def market_contract(market_config, bars: pd.DataFrame | None = None) -> ContractSpec:
    """The contract a :class:`fitdqn.config.MarketConfig` trades, as :func:`load_market` resolves it: 'auto' on
    a user's file derives the spec from the training split of its bars (``bars``: all of them, loaded from the
    config when not given and only when needed)."""
    spec = shipped_contract_for(market_config.contract, market_config.data)
    if spec is not None:
        return spec
    from fitdqn.market.data import bars_from_config  # the data pipeline (pandas): only where bars are read

    bars = bars_from_config(market_config) if bars is None else bars
    train = split_bars(len(bars), market_config.train_fraction, market_config.validation_fraction)["train"]
    return contract_for(market_config.contract, market_config.data, bars.iloc[: max(train.stop, 1)])


def load_market(market_config, *, window: int, device=None) -> Market:
    """Everything for a :class:`fitdqn.config.MarketConfig`, checked for ``window`` (``net.window``) and
    ``market.episode_length``; the tensors on ``device`` (None: the CPU)."""
    from fitdqn.market.data import bars_from_config  # the data pipeline (pandas): only where bars are read

    bars = bars_from_config(market_config)
    contract = market_contract(market_config, bars)
    check_contract_fits(contract, bars, market_config.max_contracts, f"'{market_config.data}'")
    market = market_from_bars(
        bars,
        contract,
        name=market_config.data,
        train_fraction=market_config.train_fraction,
        validation_fraction=market_config.validation_fraction,
        device=device,
    )
    check_enough_bars(market, window, market_config.episode_length)
    return market
