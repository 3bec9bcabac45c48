"""Contract specs: what one point of price is worth and what a fill costs.

Specs are TOML files shipped in ``fitdqn/market/contracts/`` (``es``, ``nq``, ``generic``) or any TOML file
of the same shape given by path. ``market.contract = 'auto'`` picks the spec whose ``data`` list names the
data source (``sp500`` -> ``es``, ``nasdaq`` -> ``nq``), else ``generic``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fitdqn.errors import UserError

CONTRACTS_PACKAGE = "fitdqn.market"
CONTRACTS_DIR = "contracts"
GENERIC = "generic"


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
    spec = ContractSpec(**values)
    if spec.multiplier <= 0 or spec.tick_size <= 0:
        raise UserError(f"contract spec {source}: multiplier and tick_size must be positive")
    if spec.commission < 0 or spec.slippage_ticks < 0:
        raise UserError(f"contract spec {source}: commission and slippage_ticks must be >= 0")
    return spec


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


def contract_for(contract: str, data: str) -> ContractSpec:
    """Resolve ``market.contract`` for ``market.data``: 'auto' picks by the data's name."""
    if contract != "auto":
        return load_contract(contract)
    for name in available_contracts():
        spec = load_contract(name)
        if data in spec.data:
            return spec
    return load_contract(GENERIC)
