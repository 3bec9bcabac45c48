"""config.py is the one home of every default: no public constructor or function of the domain packages declares a
default for a parameter named like a config knob (or an alias of one), and no module restates a knob's choices."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Iterator

import pytest

from fitdqn.config import Config, LearnConfig, MarketConfig, knob_choices

PACKAGES = ("replay", "market", "collect", "learn", "nets", "evaluate", "deploy", "gym_env")

# parameters that carry a knob's value under another name
ALIASES = {
    "fanout": "replay.tree_fanout",
    "eps": "replay.priority_eps",
    "num_bars": "market.synthetic_bars",
    "synthetic_bars_count": "market.synthetic_bars",
    "signal": "market.synthetic_signal",
}

# (function, parameter) -> why its default is not a second home of the knob's default. Each must be None (or,
# for a record, say what it is): None means "not given", never a value.
ALLOWED = {
    ("fitdqn.market.env.FuturesEnv.__init__", "device"): "None: the features' device",
    ("fitdqn.market.env.FuturesEnv.from_config", "device"): "None: the CPU, or the given market's device",
    ("fitdqn.market.env.FuturesEnv.from_config", "num_envs"): "None: collect.num_envs (a backtest's own count)",
    ("fitdqn.market.env.FuturesEnv.from_config", "seed"): "None: train.seed",
    ("fitdqn.market.env.FuturesEnv.reset", "seed"): "None: keep the generator's stream (no reseed)",
    ("fitdqn.market.features.bar_tensors", "device"): "None: the CPU",
    ("fitdqn.market.features.feature_columns", "device"): "None: the CPU",
    ("fitdqn.market.features.compute_features", "device"): "None: the CPU",
    ("fitdqn.market.loader.market_from_bars", "device"): "None: the CPU",
    ("fitdqn.market.loader.load_market", "device"): "None: the CPU",
    ("fitdqn.gym_env.FuturesGymEnv.__init__", "window"): "gymnasium kwargs; None: net.window",
    ("fitdqn.gym_env.FuturesGymEnv.__init__", "device"): "gymnasium kwargs; None: the market's (CPU)",
    ("fitdqn.gym_env.FuturesGymEnv.__init__", "seed"): "gymnasium kwargs; None: train.seed",
    ("fitdqn.gym_env.FuturesGymEnv.reset", "seed"): "gymnasium API: None = no reseed",
    ("fitdqn.gym_env.FuturesVectorEnv.__init__", "window"): "gymnasium kwargs; None: net.window",
    ("fitdqn.gym_env.FuturesVectorEnv.__init__", "device"): "gymnasium kwargs; None: the market's (CPU)",
    ("fitdqn.gym_env.FuturesVectorEnv.__init__", "seed"): "gymnasium kwargs; None: train.seed",
    ("fitdqn.gym_env.FuturesVectorEnv.reset", "seed"): "gymnasium API: None = no reseed",
    ("fitdqn.replay.buffer.ReplayBuffer.from_config", "num_envs"): "None: collect.num_envs",
    ("fitdqn.evaluate.backtest.evaluate_config", "device"): "None: the CPU, or the given market's device",
}
# the same name, another quantity: (function, parameter) -> what it is
HOMONYMS = {
    ("fitdqn.market.contract.ContractSpec.__init__", "data"): "a contract record's list of data names it serves",
    ("fitdqn.market.features.macd", "signal"): "MACD's signal EMA period (TA-Lib's 12/26/9)",
}


def knob_names() -> set[str]:
    config = Config()
    return {f.name for s in dataclasses.fields(config) for f in dataclasses.fields(getattr(config, s.name))}


def modules() -> Iterator[object]:
    for package in PACKAGES:
        root = importlib.import_module(f"fitdqn.{package}")
        yield root
        for info in pkgutil.walk_packages(getattr(root, "__path__", []), f"{root.__name__}."):  # a module: itself
            try:
                yield importlib.import_module(info.name)
            except ImportError:  # an optional dependency (Triton) missing
                continue


def public_callables() -> Iterator[tuple[str, object]]:
    """(qualified name, callable) of every public function, class constructor and method defined in the packages."""
    seen = set()
    for module in modules():
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                items = [(f"{module.__name__}.{name}", obj)]
            elif inspect.isclass(obj):
                items = [(f"{module.__name__}.{name}.{attr}", getattr(obj, attr)) for attr, raw in vars(obj).items()
                         if (not attr.startswith("_") or attr == "__init__")
                         and (isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw))]
            else:
                continue
            for qualified, fn in items:
                if qualified not in seen:
                    seen.add(qualified)
                    yield qualified, fn


def knob_defaults() -> dict[tuple[str, str], object]:
    """(function, parameter) -> default, for every parameter named like a knob (or an alias) that has one."""
    names = knob_names() | set(ALIASES)
    found = {}
    for qualified, fn in public_callables():
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        for parameter in parameters.values():
            if parameter.name in names and parameter.default is not inspect.Parameter.empty:
                found[(qualified, parameter.name)] = parameter.default
    return found


def test_aliases_name_real_knobs():
    config = Config()
    for key in ALIASES.values():
        section, _, name = key.partition(".")
        assert hasattr(getattr(config, section), name), key


def test_no_library_signature_declares_a_knob_default():
    found = knob_defaults()
    offending = {key: value for key, value in found.items() if key not in ALLOWED and key not in HOMONYMS}
    assert not offending, (
        "defaults of config knobs declared outside src/fitdqn/config.py (take the value explicitly, or the "
        f"config section): {offending}"
    )


def test_every_allowed_default_exists_and_is_not_a_value():
    found = knob_defaults()
    stale = [key for key in {**ALLOWED, **HOMONYMS} if key not in found]
    assert not stale, f"allowed defaults that no longer exist: remove them from ALLOWED or HOMONYMS: {stale}"
    for key in ALLOWED:
        assert found[key] is None, f"{key}: an allowed default must be None (not given), got {found[key]!r}"


def test_the_walk_sees_the_constructors():
    """The walk reaches the constructors the rule is about."""
    names = {qualified for qualified, _ in public_callables()}
    for expected in ("fitdqn.replay.buffer.ReplayBuffer.__init__", "fitdqn.replay.buffer.ReplayBuffer.from_config",
                     "fitdqn.replay.sampler.PrioritizedSampler.__init__", "fitdqn.market.env.FuturesEnv.__init__",
                     "fitdqn.market.env.FuturesEnv.from_config", "fitdqn.learn.learner.Learner.__init__",
                     "fitdqn.market.data.synthetic_bars", "fitdqn.collect.collector.Collector.__init__"):
        assert expected in names, expected


def test_a_planted_knob_default_is_caught(monkeypatch):
    import fitdqn.replay.sampler as sampler

    def planted(storage, n_step, alpha=0.6, priority_eps=1e-6, tree_fanout=64):  # noqa: ARG001
        pass

    monkeypatch.setattr(sampler, "planted_sampler", planted, raising=False)
    planted.__module__ = sampler.__name__
    found = knob_defaults()
    assert found[("fitdqn.replay.sampler.planted_sampler", "alpha")] == 0.6
    assert found[("fitdqn.replay.sampler.planted_sampler", "tree_fanout")] == 64


@pytest.mark.parametrize(("restated", "section", "name"), [
    ("fitdqn.market.env.REWARDS", MarketConfig, "reward"),
    ("fitdqn.learn.schedule.LR_SCALINGS", LearnConfig, "lr_scaling"),
])
def test_modules_read_knob_choices_from_the_config(restated, section, name):
    module, _, attr = restated.rpartition(".")
    assert getattr(importlib.import_module(module), attr) is knob_choices(section, name)
