"""Networks: per-token trunk + last-token attention, branching dueling C51, IQN, IQL value net.

The names below are loaded on first use (PEP 562): the planner reads ``fitdqn.nets.groups`` without building
the networks' modules.
"""

from fitdqn.lazy import lazy_names

_HOMES = {
    "LastTokenAttention": "attention", "BranchingDuelingC51": "c51", "GROUP_ATTR": "groups",
    "MEMORY_GROUPS": "groups", "TARGET_COPIED": "groups", "ParameterGroup": "groups", "group_of": "groups",
    "parameter_groups": "groups", "tag": "groups", "ValueNet": "iql", "IQNHead": "iqn",
    "QNetwork": "qnet", "TokenMLP": "trunk",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
