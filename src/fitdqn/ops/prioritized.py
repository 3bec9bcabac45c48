"""Prioritized replay's two batch operations on a sum tree (:class:`fitdqn.replay.sum_tree.SumTree`'s levels, top
first, leaves last, each a multiple of ``fanout`` long): the torch maths, and the same maths as two PyTorch
operators with Triton kernels on CUDA (:mod:`fitdqn.ops.prioritized_triton`).

- **draw** (``fitdqn::prioritized_draw``): one leaf from each of B equal slices of the total mass (the stratified
  descent, :func:`stratified_find`), and its importance weight ``(N P(i)) ** -beta`` over the batch's largest
  (:func:`importance_weights`). ``uniform [B]`` f64 places each leaf in its slice; N, the sampleable transitions,
  comes from the ring's device counter ``written`` (:func:`sampleable_count`). -> ``(index [B] int64, weight [B] f32)``.
- **update** (``fitdqn::prioritized_update``): leaves ``index [B]`` become ``(|priority| + eps) ** alpha``, 0 where
  the leaf was 0 (the slot left the window since it was sampled), the largest value winning a duplicated index;
  every ancestor is recomputed as the sum of its children; the running maximum ``max_priority`` follows the
  largest leaf written. In place; returns nothing.

Why operators: in torch maths the draw is about 60 small kernels and the update about 15; on CUDA each is 2 kernels
(draw) and 2 + one per tree level (update); a CUDA device without Triton runs the torch maths. And the memory planner
traces the update step on fake tensors, often fake *CPU* tensors standing in for CUDA ones: the fake kernels allocate
exactly what the Triton path allocates (the draw's two results; the update nothing), where the torch maths makes a
``[B, fanout]`` float64 row of children per level. The CPU kernels are the torch maths.

The Triton descent sums each row of children left to right, as the CPU's ``cumsum`` does, so it picks the leaves
the CPU reference picks (tests: ``tests/ops/test_prioritized_fused.py``).
"""

from __future__ import annotations

import torch

from fitdqn.ops.kernels import triton_available, triton_module
from fitdqn.ops.sum_tree import propagate_reference

DTYPE = torch.float64
# u is kept strictly below a node's mass by this relative margin, so rounding never walks off the end.
BELOW = 1.0 - 2.0**-50
MAX_FUSED_DEPTH = 6  # levels the Triton descent takes (64 ** 6 leaves at the default fanout); deeper: torch


def descend(levels: list[torch.Tensor], mass: torch.Tensor, fanout: int, num_leaves: int) -> torch.Tensor:
    """Leaf ``i`` with ``prefix(i) <= mass < prefix(i) + p_i`` for each ``mass [B]`` (f64, in [0, total)).

    Level-by-level descent, O(B * fanout * depth); every step is a batched gather + row cumsum + row searchsorted.
    Never returns a zero-priority leaf while the total is positive.
    """
    u = mass.to(DTYPE)  # [B]
    node = torch.zeros_like(u, dtype=torch.int64)  # [B] index of the current row (group of children)
    for level in levels:
        children = level.view(-1, fanout)[node]  # [B, k]
        cum = children.cumsum(-1)  # [B, k] inclusive prefix masses
        u = torch.minimum(u, cum[:, -1] * BELOW).clamp_(min=0.0)
        c = torch.searchsorted(cum, u.unsqueeze(-1), right=True).clamp_(max=fanout - 1)  # [B, 1]
        u = u - (cum.gather(-1, c) - children.gather(-1, c)).squeeze(-1)
        node = torch.add(c.squeeze(-1), node, alpha=fanout)  # [B] child id = next row
    return node.clamp_(max=num_leaves - 1)


def stratified_find(levels: list[torch.Tensor], uniform: torch.Tensor, fanout: int, num_leaves: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One leaf from each of B equal slices of the total mass; ``uniform [B]`` in [0, 1) places it.

    Returns ``(index [B] int64, probability [B] f64)`` with probability = p_i / total.
    """
    batch_size = uniform.shape[0]
    total = levels[0].sum()
    strata = torch.arange(batch_size, device=uniform.device, dtype=DTYPE)  # [B]
    mass = (strata + uniform.to(DTYPE)) * (total / batch_size)  # [B]
    index = descend(levels, mass, fanout, num_leaves)
    return index, levels[-1][index] / total


def sampleable_count(written: torch.Tensor, ring_steps: int, n_step: int, num_envs: int) -> torch.Tensor:
    """Transitions whose n-step window is written and not overwritten (0-dim int64): steps
    ``max(0, T - S) .. T - n`` of the ring, ``num_envs`` each (T = ``written``, S = ``ring_steps``)."""
    held = torch.clamp(written, max=ring_steps)
    return torch.clamp(held - (n_step - 1), min=0) * num_envs


def importance_weights(probability: torch.Tensor, count: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``(N * P(i)) ** -beta`` normalised by the batch maximum, [B] f32."""
    weight = torch.pow(count.to(DTYPE) * probability, -beta)  # [B] f64
    return (weight / weight.max()).to(torch.float32)


def leaf_values(leaves: torch.Tensor, index: torch.Tensor, priorities: torch.Tensor, alpha: float, eps: float
                ) -> torch.Tensor:
    """``(|priority| + eps) ** alpha [B]`` f64, 0 where the slot's leaf is 0 (it left the window)."""
    leaf = (priorities.detach().to(DTYPE).abs() + eps) ** alpha  # [B]
    return leaf * (leaves[index] > 0)


def draw_reference(levels: list[torch.Tensor], uniform: torch.Tensor, written: torch.Tensor, beta: torch.Tensor,
                   fanout: int, num_leaves: int, ring_steps: int, n_step: int, num_envs: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw in torch maths (module docstring): ``(index [B] int64, weight [B] f32)``."""
    index, probability = stratified_find(levels, uniform, fanout, num_leaves)
    count = sampleable_count(written, ring_steps, n_step, num_envs)
    return index, importance_weights(probability, count, beta)


def update_reference(levels: list[torch.Tensor], max_priority: torch.Tensor, index: torch.Tensor,
                     priorities: torch.Tensor, alpha: float, eps: float, fanout: int) -> None:
    """The update in torch maths (module docstring), in place."""
    leaf = leaf_values(levels[-1], index, priorities, alpha, eps)
    levels[-1].scatter_reduce_(0, index, leaf, reduce="amax", include_self=False)
    propagate_reference(levels, index, fanout)
    torch.maximum(max_priority, leaf.max(), out=max_priority)


@torch.library.custom_op("fitdqn::prioritized_draw", mutates_args=("lowest",))
def prioritized_draw(levels: list[torch.Tensor], uniform: torch.Tensor, written: torch.Tensor, beta: torch.Tensor,
                     lowest: torch.Tensor, fanout: int, num_leaves: int, ring_steps: int, n_step: int,
                     num_envs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B] int64, weight [B] f32)``; ``lowest`` (0-dim int64) is the Triton path's scratch for the batch's
    smallest leaf; the default (CPU) kernel is the torch maths."""
    return draw_reference(levels, uniform, written, beta, fanout, num_leaves, ring_steps, n_step, num_envs)


@prioritized_draw.register_kernel("cuda")
def _prioritized_draw_cuda(levels, uniform, written, beta, lowest, fanout, num_leaves, ring_steps, n_step,
                           num_envs):
    if len(levels) > MAX_FUSED_DEPTH or not triton_available():
        return draw_reference(levels, uniform, written, beta, fanout, num_leaves, ring_steps, n_step, num_envs)
    return triton_module("fitdqn.ops.prioritized_triton").fused_draw(
        levels, uniform, written, beta, lowest, fanout, num_leaves, ring_steps, n_step, num_envs)


@prioritized_draw.register_fake
def _prioritized_draw_fake(levels, uniform, written, beta, lowest, fanout, num_leaves, ring_steps, n_step,
                           num_envs):
    batch_size = uniform.shape[0]
    return (uniform.new_empty((batch_size,), dtype=torch.int64),
            uniform.new_empty((batch_size,), dtype=torch.float32))


@torch.library.custom_op("fitdqn::prioritized_update", mutates_args=("levels", "max_priority"))
def prioritized_update(levels: list[torch.Tensor], max_priority: torch.Tensor, index: torch.Tensor,
                       priorities: torch.Tensor, alpha: float, eps: float, fanout: int) -> None:
    """New priorities for leaves ``index [B]`` (module docstring), in place; the default (CPU) kernel is the torch
    maths."""
    update_reference(levels, max_priority, index, priorities, alpha, eps, fanout)


@prioritized_update.register_kernel("cuda")
def _prioritized_update_cuda(levels, max_priority, index, priorities, alpha, eps, fanout):
    if not triton_available():
        update_reference(levels, max_priority, index, priorities, alpha, eps, fanout)
        return
    triton_module("fitdqn.ops.prioritized_triton").fused_update(levels, max_priority, index, priorities, alpha,
                                                                 eps, fanout)


@prioritized_update.register_fake
def _prioritized_update_fake(levels, max_priority, index, priorities, alpha, eps, fanout):
    return None
