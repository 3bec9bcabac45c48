"""The search space: a TOML ``[search]`` table of config keys -> ranges or choices, checked against the config.

    [search]
    "learn.lr" = {low = 1e-5, high = 1e-3, log = true}     # float range (log-uniform)
    "learn.n_step" = {choices = [1, 3, 5]}                  # categorical
    "collect.steps_per_epoch" = {low = 16, high = 64, step = 16}   # int range (the field's type decides)

Nested tables work too (``[search.learn]`` with ``lr = {...}``). Every key must be a config key; every bound
and choice is checked against the key's type and the config's cross-field rules before any trial runs.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
)

from fitdqn.config import Config, ConfigError, coerce, field_types, section_types, with_overrides

SPEC_KEYS = frozenset({"low", "high", "log", "step", "choices"})
NOT_SEARCHABLE = {
    "train.out": "each trial writes its own run directory under tune.dir",
    "train.device": "every trial runs on the tune command's device",
    "market.data": "every trial must be scored on the same validation bars",
    "market.train_fraction": "every trial must be scored on the same validation bars",
    "market.validation_fraction": "every trial must be scored on the same validation bars",
    "market.synthetic_bars": "every trial must be scored on the same validation bars",
    "market.seed": "every trial must be scored on the same validation bars",
}


class SearchSpaceError(ConfigError):
    """A [search] entry the user must fix; the message names the key and says how."""


@dataclass(frozen=True)
class SearchSpace:
    """Dotted config key -> Optuna distribution, in the order of the TOML table."""

    distributions: dict[str, BaseDistribution]

    def to_json(self) -> dict[str, str]:
        return {key: distribution_to_json(d) for key, d in self.distributions.items()}

    def describe(self) -> list[str]:
        lines = []
        for key, d in self.distributions.items():
            if isinstance(d, CategoricalDistribution):
                lines.append(f"{key}: one of {list(d.choices)}")
            else:
                scale = " (log)" if d.log else (f" step {d.step:g}" if d.step is not None else "")
                lines.append(f"{key}: {d.low:g} .. {d.high:g}{scale}")
        return lines


def parse_search_space(table: Any, base: Config) -> SearchSpace:
    """Check every entry of a ``[search]`` table against the config and build its distribution."""
    if not isinstance(table, dict):
        raise SearchSpaceError(f"[search] must be a table of config keys, got {table!r}")
    entries = flatten(table)
    if not entries:
        raise SearchSpaceError('[search] is empty: add a config key, e.g. "learn.lr" = {low = 1e-5, high = 1e-3}')
    return SearchSpace({key: parse_entry(key, spec, base) for key, spec in entries.items()})


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"learn": {"lr": {...}}}`` and ``{"learn.lr": {...}}`` both -> ``{"learn.lr": {...}}``."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and not (set(value) & SPEC_KEYS):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def field_annotation(key: str) -> Any:
    """The type of config key ``section.field``, or a SearchSpaceError naming the known keys."""
    section, _, name = key.partition(".")
    sections = section_types()
    if section not in sections or not name:
        raise SearchSpaceError(f"search key '{key}' is not a config key: use 'section.key' with a section of "
                               f"{', '.join(sections)}")
    types_ = field_types(sections[section])
    if name not in types_:
        raise SearchSpaceError(f"search key '{key}' is not a config key; keys of [{section}]: {', '.join(types_)}")
    if section == "tune":
        raise SearchSpaceError(f"search key '{key}': the tuner's own settings are not searched")
    if key in NOT_SEARCHABLE:
        raise SearchSpaceError(f"search key '{key}' cannot be searched: {NOT_SEARCHABLE[key]}")
    return types_[name]


def parse_entry(key: str, spec: Any, base: Config) -> BaseDistribution:
    annotation = field_annotation(key)
    if not isinstance(spec, dict):
        raise SearchSpaceError(f"search key '{key}': expected {{low = ..., high = ...}} or {{choices = [...]}}, "
                               f"got {spec!r}")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise SearchSpaceError(f"search key '{key}': unknown field(s) {', '.join(sorted(unknown))}; "
                               "use low, high, log, step or choices")
    if "choices" in spec:
        distribution = categorical(key, spec, annotation)
    else:
        distribution = numeric_range(key, spec, annotation)
    check_values(key, distribution, base)
    return distribution


def categorical(key: str, spec: dict[str, Any], annotation: Any) -> CategoricalDistribution:
    if set(spec) != {"choices"}:
        raise SearchSpaceError(f"search key '{key}': choices cannot be combined with low/high/log/step")
    choices = spec["choices"]
    if not isinstance(choices, list) or not choices:
        raise SearchSpaceError(f"search key '{key}': choices must be a non-empty list, got {choices!r}")
    values = []
    for choice in choices:
        value = typed(key, choice, annotation)
        if typing.get_origin(annotation) is tuple:  # Optuna's choices are scalars: a tuple is sampled as 'a,b,c'
            value = ",".join(map(str, value))
        values.append(value)
    if len(set(values)) != len(values):
        raise SearchSpaceError(f"search key '{key}': choices {choices} repeat a value")
    return CategoricalDistribution(values)


def numeric_range(key: str, spec: dict[str, Any], annotation: Any) -> BaseDistribution:
    if annotation not in (int, float):
        raise SearchSpaceError(f"search key '{key}' is not a number: give {{choices = [...]}} instead of a range")
    if "low" not in spec or "high" not in spec:
        raise SearchSpaceError(f"search key '{key}': a range needs both low and high (or give choices)")
    low, high = (typed(f"{key} ({bound})", spec[bound], annotation) for bound in ("low", "high"))
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise SearchSpaceError(f"search key '{key}': log must be true or false, got {log!r}")
    step = typed(f"{key} (step)", spec["step"], annotation) if "step" in spec else None
    if not low < high:
        raise SearchSpaceError(f"search key '{key}': low ({low}) must be below high ({high}); for one value set it "
                               "in the config instead")
    if log and low <= 0:
        raise SearchSpaceError(f"search key '{key}': a log range needs low > 0, got {low}")
    if log and step is not None:
        raise SearchSpaceError(f"search key '{key}': give log or step, not both")
    if step is not None and step <= 0:
        raise SearchSpaceError(f"search key '{key}': step must be positive, got {step}")
    if annotation is int:
        return IntDistribution(low, high, log=log, step=step or 1)
    return FloatDistribution(low, high, log=log, step=step)


def typed(key: str, value: Any, annotation: Any) -> Any:
    try:
        return coerce(key, value, annotation)
    except ConfigError as error:
        raise SearchSpaceError(f"search {error}") from None


def check_values(key: str, distribution: BaseDistribution, base: Config) -> None:
    """Each choice, or both ends of a range, must make a valid config with the base (cross-field rules)."""
    if isinstance(distribution, CategoricalDistribution):
        values = list(distribution.choices)
    else:
        values = [distribution.low, distribution.high]
    for value in values:
        try:
            with_overrides(base, {key: value})
        except ConfigError as error:
            raise SearchSpaceError(f"search key '{key}' = {value!r} makes an invalid config: {error}") from None


def space_json(space: SearchSpace) -> str:
    """Canonical JSON of the space (what a study remembers to refuse a different one on a re-run)."""
    return json.dumps(space.to_json(), sort_keys=True)
