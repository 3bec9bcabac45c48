"""The sum tree's ancestor rebuild: every ancestor of the updated leaves recomputed as the sum of its children,
level by level (:class:`fitdqn.replay.sum_tree.SumTree` stores the levels, top first, leaves last, each a multiple
of ``fanout`` long).

:func:`propagate_reference` is the torch maths (a gather, a row sum and a scatter per level: 4 kernels), the
reference the Triton kernel of :mod:`fitdqn.ops.sum_tree_triton` (one kernel per level) is checked against;
:func:`propagate` picks one by the levels' device (the Triton kernel for CUDA levels where Triton runs). Not a custom
operator: it writes the levels in place and allocates nothing on the Triton path, and the planner traces a CUDA
target on fake *CPU* tensors (``fitdqn.memory.trace.fake_device_for``), where the torch maths runs; a Triton kernel
must never be launched on fake tensors (their storage has no memory).
"""

from __future__ import annotations

import torch

from fitdqn.ops.kernels import triton_available, triton_module


def available(device: torch.device) -> bool:
    """Whether :func:`propagate` runs the Triton kernel for levels on ``device`` (CUDA with Triton installed)."""
    return torch.device(device).type == "cuda" and triton_available()


def propagate_reference(levels: list[torch.Tensor], index: torch.Tensor, fanout: int) -> None:
    """Recompute every ancestor of leaves ``index [M]`` in place; duplicated parents get the same recomputed sum,
    so the scatter is deterministic."""
    node = index
    for depth in range(len(levels) - 1, 0, -1):
        node = torch.div(node, fanout, rounding_mode="floor")  # [M] parent ids
        sums = levels[depth].view(-1, fanout)[node].sum(-1)  # [M]
        levels[depth - 1].index_copy_(0, node, sums)


def propagate(levels: list[torch.Tensor], index: torch.Tensor, fanout: int) -> None:
    """Every ancestor of leaves ``index [M]`` rebuilt in place: the Triton kernel for CUDA levels where Triton runs,
    else :func:`propagate_reference`."""
    if available(levels[-1].device):
        triton_module("fitdqn.ops.sum_tree_triton").propagate(levels, index, fanout)
    else:
        propagate_reference(levels, index, fanout)
