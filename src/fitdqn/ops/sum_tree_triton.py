"""Triton kernel for the sum tree's ancestor rebuild on CUDA (:func:`fitdqn.ops.sum_tree.propagate`): one launch
per level, gather + sum fused.

The torch path (:func:`fitdqn.ops.sum_tree.propagate_reference`) is the reference; this one computes the
same parents (each = the sum of its ``fanout`` children, in Triton's reduction order) in 1 kernel per level
instead of 4. Duplicated parents in a launch store the same value, so the races are benign.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _parent_sums(leaf_ptr, child_ptr, parent_ptr, count, divisor, FANOUT: tl.constexpr, COLUMNS: tl.constexpr,
                 BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] which updated leaf
    mask = rows < count
    leaf = tl.load(leaf_ptr + rows, mask=mask, other=0)
    parent = leaf // divisor  # [BLOCK] ancestor id at the parent level
    cols = tl.arange(0, COLUMNS)  # [COLUMNS] the fanout rounded up to a power of two, the rest masked
    children = tl.load(child_ptr + parent[:, None] * FANOUT + cols[None, :],
                       mask=mask[:, None] & (cols[None, :] < FANOUT), other=0.0)  # [BLOCK, COLUMNS]
    tl.store(parent_ptr + parent, tl.sum(children, axis=1), mask=mask)


def propagate(levels: list[torch.Tensor], index: torch.Tensor, fanout: int) -> None:
    """Rebuild every ancestor of leaves ``index [M]`` (int64, on the levels' CUDA device), level by level."""
    index = index.contiguous()
    count = index.numel()
    columns = triton.next_power_of_2(fanout)
    block = max(1, min(128, 4096 // columns))
    grid = (triton.cdiv(count, block),)
    divisor = 1
    for depth in range(len(levels) - 1, 0, -1):
        divisor *= fanout
        _parent_sums[grid](index, levels[depth], levels[depth - 1], count, divisor, FANOUT=fanout, COLUMNS=columns,
                           BLOCK=block)
