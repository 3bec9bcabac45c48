"""The planner's unit: one memory consumer with a batch-independent and a per-sample part."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Component:
    """One consumer of device memory.

    ``fixed_bytes`` does not depend on the batch; ``per_sample_bytes`` is multiplied by it. Both are
    derived from real objects (shapes, dtypes, capacities, traced steps), never typed in; ``derived_from``
    says how, in a few words a user can check.
    """

    name: str
    fixed_bytes: int
    per_sample_bytes: int
    derived_from: str

    def bytes_at(self, batch_size: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def to_json(self) -> dict:
        return asdict(self)


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
