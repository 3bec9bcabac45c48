"""The planner's unit: one memory consumer with a batch-independent and a per-sample part."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

import torch
from torch import nn


class ComponentName(StrEnum):
    """Every consumer the plan knows, in allocation order (the network groups are ``fitdqn.nets.groups``')."""

    REPLAY = "replay"
    HER = "her"
    COLLECTOR = "collector"
    CUDA_OVERHEAD = "cuda_overhead"
    CUDA_DRIVER = "cuda_driver"
    DQN = "dqn"
    ATTENTION = "attention"
    IQN = "iqn"
    IQL = "iql"
    BATCH = "batch"
    CUDA_GRAPHS = "cuda_graphs"
    ALL_REDUCE = "all_reduce"  # data-parallel runs: the gradient all-reduce's buffers
    NCCL = "nccl"  # data-parallel runs: NCCL's own device memory


NETWORK_COMPONENTS = (ComponentName.DQN, ComponentName.ATTENTION, ComponentName.IQN, ComponentName.IQL)


@dataclass(frozen=True)
class Component:
    """One consumer of device memory.

    ``fixed_bytes`` does not depend on the batch; ``per_sample_bytes`` is multiplied by it. Both are
    derived from real objects (shapes, dtypes, capacities, traced steps), never typed in; ``derived_from``
    says how, in a few words a user can check.
    """

    name: ComponentName
    fixed_bytes: int
    per_sample_bytes: int
    derived_from: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", ComponentName(self.name))  # a stored plan's names come back as strings

    def bytes_at(self, batch_size: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def to_json(self) -> dict:
        return {**asdict(self), "name": str(self.name)}


def tensor_bytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of this shape and dtype."""
    count = 1
    for size in shape:
        count *= int(size)
    return count * dtype.itemsize


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters (each parameter counted once, shared ones too)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())
