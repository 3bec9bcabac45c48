"""Contract specs: what one point of price is worth and what a fill costs.

Specs are TOML files shipped in ``fitdqn/market/contracts/`` (``es``, ``nq``, ``generic``) or any TOML file
of the same shape given by path. ``market.contract = 'auto'`` picks the spec whose ``data`` list names the
data source (``sp500`` -> ``es``, ``nasdaq`` -> ``nq``, ``synthetic`` -> ``generic``); for a user's file it
derives a spec from the prices (:func:`derive_contract`: multiplier 1, the prices' own tick, costs in basis
points of the price). Every spec is checked against the bars it trades (:func:`check_contract_fits`).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fitdqn.errors import UserError

if TYPE_CHECKING:  # bars come as frames; the env and the planner import this module without pandas
    import pandas as pd

PRICE_UNITS = "price units"  # the unit of a spec without a currency (ContractSpec.unit)
CONTRACTS_PACKAGE = "fitdqn.market"
CONTRACTS_DIR = "contracts"


@dataclass(frozen=True)
class ContractSpec:
    """One futures contract.

    A fill of ``q`` contracts costs ``|q| * commission`` plus, for market and stop orders,
    ``|q| * slippage_ticks * tick_size * multiplier`` (the fill price is that many ticks worse).
    """

    name: str
    multiplier: float  # currency per price point per contract
    tick_size: float  # price points
    commission: float  # currency per contract per fill
    slippage_ticks: float  # ticks per contract on market/stop fills
    currency: str = "USD"
    description: str = ""
    data: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        source = f"contract spec '{self.name}'"
        if not self.name:
            raise UserError("contract spec: 'name' is empty; give the contract a name")
        for key, low, rule in (
            ("multiplier", 0.0, "a positive number (currency per price point per contract)"),
            ("tick_size", 0.0, "a positive number (price points)"),
            ("commission", None, "a number >= 0 (currency per contract per fill)"),
            ("slippage_ticks", None, "a number >= 0 (ticks per contract per market/stop fill)"),
        ):
            value = getattr(self, key)
            finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not finite or (value <= low if low is not None else value < 0):
                raise UserError(f"{source}: {key} = {value!r}; it must be {rule}; fix the spec")

    @property
    def unit(self) -> str:
        """What P&L is counted in: the currency, or "price units" for a spec without one (a spec derived from
        the prices: multiplier 1, so P&L in the price's own units)."""
        return self.currency or PRICE_UNITS

    @property
    def summary(self) -> str:
        """One line naming the spec and every number it trades with (for plans and reports)."""
        unit = self.unit
        text = (
            f"{self.name}: {self.multiplier:g} {unit} per price point, tick {self.tick_size:g}, commission "
            f"{self.commission:.4g} {unit} + slippage {self.slippage_ticks:.4g} tick(s) per contract per fill "
            f"({self.cost_per_side:.4g} {unit} a side)"
        )
        return f"{text}; {self.description}" if self.description else text

    @property
    def slippage(self) -> float:
        """Slippage in price points per contract per market/stop fill."""
        return self.slippage_ticks * self.tick_size

    @property
    def cost_per_side(self) -> float:
        """Currency per contract for one market fill: commission + slippage."""
        return self.commission + self.slippage * self.multiplier


_FIELDS = {
    "name": str,
    "multiplier": float,
    "tick_size": float,
    "commission": float,
    "slippage_ticks": float,
    "currency": str,
    "description": str,
    "data": list,
}


def _shipped_dir():
    return resources.files(CONTRACTS_PACKAGE).joinpath(CONTRACTS_DIR)


def available_contracts() -> list[str]:
    """Names of the shipped contract specs."""
    return sorted(p.name[: -len(".toml")] for p in _shipped_dir().iterdir() if p.name.endswith(".toml"))


def parse_contract(text: str, source: str) -> ContractSpec:
    """A ContractSpec from TOML text; ``source`` names the file in error messages."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"contract spec {source} is not valid TOML: {error}; fix the file") from None
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise UserError(
            f"contract spec {source}: unknown key(s) {unknown}; allowed keys: {', '.join(_FIELDS)}"
        )
    required = ("name", "multiplier", "tick_size", "commission", "slippage_ticks")
    missing = [k for k in required if k not in raw]
    if missing:
        raise UserError(f"contract spec {source}: missing key(s) {missing}; add them (see es.toml)")
    values = {}
    for key, value in raw.items():
        kind = _FIELDS[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(
                f"contract spec {source}: '{key}' must be a {kind.__name__}, got {value!r}; fix the file"
            )
        values[key] = tuple(str(v) for v in value) if kind is list else value
    try:
        return ContractSpec(**values)
    except UserError as error:
        raise UserError(f"{error} (file {source})") from None


def load_contract(name_or_path: str) -> ContractSpec:
    """A shipped spec by name (``'es'``, ``'nq'``, ``'generic'``) or a TOML file by path."""
    shipped = _shipped_dir().joinpath(f"{name_or_path}.toml")
    if shipped.is_file():
        return parse_contract(shipped.read_text(), f"'{name_or_path}'")
    path = Path(name_or_path)
    if path.suffix.lower() == ".toml" or path.exists():
        if not path.is_file():
            raise UserError(f"market.contract: file '{path}' not found; give a TOML contract spec path")
        return parse_contract(path.read_text(), f"'{path}'")
    raise UserError(
        f"market.contract: unknown contract '{name_or_path}'; use 'auto', one of "
        f"{', '.join(available_contracts())}, or a path to a TOML spec"
    )


# ---------------------------------------------------------------------------------------------- derived
# Costs of a derived spec, in basis points of the typical price, a side: about ES's (0.25-point slippage plus
# $2.25 on $50 a point is 0.295 points, 1.2 bp at 2,500) for a market whose costs fitdqn does not know.
DERIVED_SLIPPAGE_BP = 1.0
DERIVED_COMMISSION_BP = 0.5
MAX_DECIMALS = 8  # finest price grid looked for: 1e-8
# A grid tick is used when it lies within these fractions of the typical price; else a power of ten about
# 1-10 bp of it (prices written with float noise, or integers much smaller than the grid).
GRID_TICK_RANGE = (1e-7, 1e-2)
# Checks of any spec against its bars: the tick and one side's costs at most these fractions of the typical
# price / notional; the largest position's notional small enough that P&L and its square stay finite in float32.
MAX_TICK_FRACTION = 1e-2
MAX_COST_FRACTION = 1e-2
MAX_NOTIONAL = 1e18


def _price_array(bars: pd.DataFrame) -> np.ndarray:
    return bars[["open", "high", "low", "close"]].to_numpy(dtype=np.float64).ravel()  # [4T]


def price_grid(prices: np.ndarray) -> float | None:
    """The prices' tick: the largest step ``g * 10**-d`` (fewest decimals d, then the gcd g of the prices in
    those units) that every price is a multiple of; None when no grid down to ``10**-MAX_DECIMALS`` fits."""
    top = float(np.max(np.abs(prices)))
    for decimals in range(MAX_DECIMALS + 1):
        scaled = prices * 10.0**decimals  # [N] prices in units of 10**-decimals
        if top * 10.0**decimals >= 1e12:  # beyond that float64 cannot tell a grid from noise
            return None
        units = np.round(scaled)
        if np.all(np.abs(scaled - units) <= 1e-3):
            step = int(np.gcd.reduce(units.astype(np.int64)))
            return max(step, 1) / 10.0**decimals
    return None


def derive_contract(bars: pd.DataFrame, source: str) -> ContractSpec:
    """A generic spec for bars whose contract fitdqn does not know: multiplier 1 (P&L in the price's own
    currency per unit), the tick of the prices' grid (:func:`price_grid`), and costs per side of
    ``DERIVED_SLIPPAGE_BP`` + ``DERIVED_COMMISSION_BP`` basis points of the median close. ``bars`` should be
    the training split (nothing is taken from later bars)."""
    prices = _price_array(bars)
    typical = float(np.median(bars["close"].to_numpy(dtype=np.float64)))
    grid = price_grid(prices)
    low, high = GRID_TICK_RANGE
    if grid is not None and low * typical <= grid <= high * typical:
        tick, how = grid, "the prices' grid"
    else:
        tick, how = 10.0 ** (math.floor(math.log10(typical)) - 4), "1-10 bp of the price: the prices have no grid"
    slippage_points = DERIVED_SLIPPAGE_BP * 1e-4 * typical
    return ContractSpec(
        name="derived",
        multiplier=1.0,
        tick_size=tick,
        commission=float(f"{DERIVED_COMMISSION_BP * 1e-4 * typical:.6g}"),
        slippage_ticks=float(f"{slippage_points / tick:.6g}"),
        currency="",
        description=(
            f"derived from the prices of {source} (market.contract = auto): tick from {how}, costs "
            f"{DERIVED_SLIPPAGE_BP + DERIVED_COMMISSION_BP:g} bp of the median price {typical:.6g} a side; "
            "for the real contract give a TOML spec with market.contract"
        ),
    )


def check_contract_fits(spec: ContractSpec, bars: pd.DataFrame, max_contracts: int, source: str) -> None:
    """UserError unless ``spec`` can trade ``bars``: a tick and costs small beside the prices (a 0.25-point
    tick is a quarter of a price of 1.1), and a largest position whose P&L stays finite in float32."""
    typical = float(np.median(bars["close"].to_numpy(dtype=np.float64)))
    top = float(bars["high"].max())
    fix = (
        "set market.contract = auto (a spec derived from the prices) or give a TOML spec that fits these prices "
        "(see fitdqn/market/contracts/generic.toml)"
    )
    if spec.tick_size > MAX_TICK_FRACTION * typical:
        raise UserError(
            f"contract '{spec.name}' has a tick of {spec.tick_size:g} price points, "
            f"{spec.tick_size / typical:.1%} of the median price {typical:.6g} of {source}: it does not fit these "
            f"prices; {fix}"
        )
    notional = spec.multiplier * typical
    if spec.cost_per_side > MAX_COST_FRACTION * notional:
        raise UserError(
            f"contract '{spec.name}' costs {spec.cost_per_side:.4g} per contract per fill, "
            f"{spec.cost_per_side / notional:.1%} of one contract's value ({spec.multiplier:g} x the median price "
            f"{typical:.6g} of {source}): it does not fit these prices; {fix}"
        )
    largest = max_contracts * spec.multiplier * top
    if largest > MAX_NOTIONAL:
        raise UserError(
            f"contract '{spec.name}': {max_contracts} contracts x multiplier {spec.multiplier:g} x the highest "
            f"price {top:.6g} of {source} is {largest:.3g}, beyond {MAX_NOTIONAL:g}: P&L and rewards (float32 on "
            "the device) would overflow; quote the prices in a larger unit, lower the multiplier or "
            "market.max_contracts"
        )


def shipped_contract_for(contract: str, data: str) -> ContractSpec | None:
    """``market.contract`` resolved without the bars: a name or path as given, 'auto' the shipped spec whose
    ``data`` list names the data; None when 'auto' must derive the spec from the bars."""
    if contract != "auto":
        return load_contract(contract)
    for name in available_contracts():
        spec = load_contract(name)
        if data in spec.data:
            return spec
    return None


def contract_for(contract: str, data: str, bars: pd.DataFrame) -> ContractSpec:
    """Resolve ``market.contract`` for ``market.data``: a name or path as given; 'auto' picks the shipped spec
    whose ``data`` list names the data, else derives one from ``bars`` (:func:`derive_contract`; pass the
    training split)."""
    spec = shipped_contract_for(contract, data)
    return spec if spec is not None else derive_contract(bars, f"'{data}'")
