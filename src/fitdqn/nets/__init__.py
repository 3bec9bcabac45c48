"""Networks: per-token trunk + last-token attention, branching dueling C51, fused IQN, IQL value net."""

from fitdqn.nets.attention import LastTokenAttention
from fitdqn.nets.c51 import BranchingDuelingC51, dueling
from fitdqn.nets.groups import (
    GROUP_ATTR,
    MEMORY_GROUPS,
    TARGET_COPIED,
    ParameterGroup,
    group_of,
    parameter_groups,
    tag,
)
from fitdqn.nets.iql import ValueNet
from fitdqn.nets.iqn import IQNHead, QuantileHeadFunction, cosine_embedding
from fitdqn.nets.qnet import QNetwork
from fitdqn.nets.trunk import TokenMLP

__all__ = [
    "GROUP_ATTR", "MEMORY_GROUPS", "TARGET_COPIED", "BranchingDuelingC51", "IQNHead", "LastTokenAttention",
    "ParameterGroup", "QNetwork", "QuantileHeadFunction", "TokenMLP", "ValueNet", "cosine_embedding",
    "dueling", "group_of", "parameter_groups", "tag",
]
