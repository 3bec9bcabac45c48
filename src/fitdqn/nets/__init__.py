"""Networks: per-token trunk + last-token attention, branching dueling C51, fused IQN, IQL value net.

The names below are loaded on first use (PEP 562): the planner reads ``fitdqn.nets.groups`` without building
the networks' modules.
"""

from importlib import import_module

_HOMES = {
    "LastTokenAttention": "attention", "BranchingDuelingC51": "c51", "dueling": "c51", "GROUP_ATTR": "groups",
    "MEMORY_GROUPS": "groups", "TARGET_COPIED": "groups", "ParameterGroup": "groups", "group_of": "groups",
    "parameter_groups": "groups", "tag": "groups", "ValueNet": "iql", "IQNHead": "iqn",
    "QuantileHeadFunction": "iqn", "cosine_embedding": "iqn", "QNetwork": "qnet", "TokenMLP": "trunk",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
