"""Triton kernels of prioritized replay's draw and update (``fitdqn::prioritized_draw`` / ``prioritized_update`` on
CUDA; the maths and the reference are in :mod:`fitdqn.ops.prioritized`).

Draw, 2 kernels:

1. ``_descend_kernel``: a lane per sample walks the tree top to bottom. At each level it reads its row of
   ``fanout`` children twice, left to right: once for the row's mass (``u`` is clamped below it, as in the
   reference), once for the first child whose running sum passes ``u``, subtracting the running sum before that
   child (``cum[c] - x[c]``, the reference's very expression). Row sums in the CPU's order, so the leaves are the
   CPU reference's. It writes the leaf's index and folds the leaf's value into ``lowest`` (the batch's smallest
   leaf, an atomic minimum on the float64's bits: non-negative floats order as their int64 bits do).
2. ``_weights_kernel``: ``(N P(i)) ** -beta / (N P_min) ** -beta`` (the batch's largest weight is the smallest
   probability's), N from the ring's counter.

The total mass is the top level's sum, taken by every program in the same order. Update, 2 kernels + the tree's
ancestor rebuild (:mod:`fitdqn.ops.sum_tree_triton`, one per level):

1. ``_leaves_kernel`` (FOLD 0): ``(|p| + eps) ** alpha``, 0 where the old leaf is 0, stored at its index
   (duplicates: one of them lands); the program's largest value is folded into ``max_priority`` (atomic maximum on
   the bits).
2. ``_leaves_kernel`` (FOLD 1): the same values, the mask read again (a stored value is positive exactly when the old
   leaf was, so it reads the same), folded into the leaf by an atomic maximum: a duplicated index ends at the
   largest of its values, as ``scatter_reduce(amax, include_self=False)`` does.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import on_device
from fitdqn.ops.prioritized import BELOW, MAX_FUSED_DEPTH
from fitdqn.ops.sum_tree_triton import propagate

BLOCK = 128  # samples per program
WARPS = 4
INT64_MAX = 2**63 - 1


def bits(value: float) -> int:
    """The int64 bits of a float64 (how the kernels take float64 scalars: :func:`_as_f64`)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


@triton.jit
def _top_mass(top_ptr, TOP: tl.constexpr):
    """The tree's total: the top level's nodes summed left to right (the same in every program)."""
    total = tl.load(top_ptr).to(tl.float64)
    for j in range(1, TOP):
        total += tl.load(top_ptr + j)
    return total


@triton.jit
def _as_f64(bits):
    """A float64 passed as its int64 bits (Triton types a Python float argument or constant as float32)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def _pow(base, exponent):
    """``base ** exponent`` for float64 ``base >= 0`` as ``exp(exponent log base)``: within a few ulps of the
    torch maths' ``pow`` (Triton's interpreter has no ``libdevice.pow``)."""
    return tl.exp(exponent * tl.log(base))


@triton.jit
def _descend_level(level_ptr, node, u, valid, below, FANOUT: tl.constexpr):
    """One level of the descent for a block of lanes: ``node [BLOCK]`` the row, ``u`` the mass left in it."""
    row = level_ptr + node * FANOUT  # [BLOCK] pointers to each lane's row of children
    mass = tl.zeros_like(u)
    for j in range(0, FANOUT):
        mass += tl.load(row + j, mask=valid, other=0.0)
    u = tl.maximum(tl.minimum(u, mass * below), 0.0)
    cum = tl.zeros_like(u)
    before = tl.zeros_like(u)  # cum[c] - x[c] of the child c found
    child = tl.full(u.shape, FANOUT - 1, tl.int64)
    found = tl.zeros(u.shape, tl.int32)
    for j in range(0, FANOUT):
        x = tl.load(row + j, mask=valid, other=0.0)
        cum += x
        hit = ((cum > u) | (j == FANOUT - 1)) & (found == 0)
        child = tl.where(hit, j, child)
        before = tl.where(hit, cum - x, before)
        found = found | hit.to(tl.int32)
    return node * FANOUT + child, u - before


@triton.jit
def _descend_kernel(
    level0, level1, level2, level3, level4, level5, leaves_ptr, uniform_ptr, uniform_stride, index_ptr, lowest_ptr,
    batch, num_leaves, below_bits,
    DEPTH: tl.constexpr, FANOUT: tl.constexpr, TOP: tl.constexpr, BLOCK: tl.constexpr,
):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] samples
    valid = lanes < batch
    total = _top_mass(level0, TOP)
    uniform = tl.load(uniform_ptr + lanes.to(tl.int64) * uniform_stride, mask=valid, other=0.0).to(tl.float64)
    u = (lanes.to(tl.float64) + uniform) * (total / batch)  # [BLOCK] the stratum's mass
    node = tl.zeros((BLOCK,), tl.int64)
    below = _as_f64(below_bits)
    node, u = _descend_level(level0, node, u, valid, below, FANOUT)
    if DEPTH > 1:
        node, u = _descend_level(level1, node, u, valid, below, FANOUT)
    if DEPTH > 2:
        node, u = _descend_level(level2, node, u, valid, below, FANOUT)
    if DEPTH > 3:
        node, u = _descend_level(level3, node, u, valid, below, FANOUT)
    if DEPTH > 4:
        node, u = _descend_level(level4, node, u, valid, below, FANOUT)
    if DEPTH > 5:
        node, u = _descend_level(level5, node, u, valid, below, FANOUT)
    index = tl.minimum(node, num_leaves - 1)
    tl.store(index_ptr + lanes, index, mask=valid)
    leaf = tl.load(leaves_ptr + index, mask=valid, other=0.0)
    bits = tl.where(valid, leaf.to(tl.int64, bitcast=True), 9223372036854775807)
    tl.atomic_min(lowest_ptr, tl.min(bits, axis=0))


@triton.jit
def _weights_kernel(top_ptr, leaves_ptr, index_ptr, lowest_ptr, written_ptr, beta_ptr, weight_ptr, batch,
                    ring_steps, n_step, num_envs, TOP: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = lanes < batch
    total = _top_mass(top_ptr, TOP)
    held = tl.minimum(tl.load(written_ptr), ring_steps)
    count = (tl.maximum(held - (n_step - 1), 0) * num_envs).to(tl.float64)  # N: sampleable transitions
    exponent = -tl.load(beta_ptr).to(tl.float64)
    index = tl.load(index_ptr + lanes, mask=valid, other=0)
    probability = tl.load(leaves_ptr + index, mask=valid, other=1.0) / total
    lowest = tl.load(lowest_ptr).to(tl.float64, bitcast=True) / total
    weight = _pow(count * probability, exponent) / _pow(count * lowest, exponent)
    tl.store(weight_ptr + lanes, weight.to(tl.float32), mask=valid)


@triton.jit
def _leaf_values(leaves_ptr, index, priorities_ptr, lanes, valid, alpha_bits, eps_bits):
    priority = tl.load(priorities_ptr + lanes, mask=valid, other=0.0).to(tl.float64)
    value = _pow(tl.abs(priority) + _as_f64(eps_bits), _as_f64(alpha_bits))
    old = tl.load(leaves_ptr + index, mask=valid, other=0.0)
    return tl.where(old > 0.0, value, 0.0)


@triton.jit
def _leaves_kernel(leaves_ptr, leaf_bits_ptr, index_ptr, priorities_ptr, max_ptr, batch, alpha_bits, eps_bits,
                   FOLD: tl.constexpr, BLOCK: tl.constexpr):
    """The update's two passes (module docstring): FOLD = 0 stores the values and folds the largest into the
    running maximum; FOLD = 1 folds each value into its leaf (atomic maximum)."""
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = lanes < batch
    index = tl.load(index_ptr + lanes, mask=valid, other=0)
    value = _leaf_values(leaves_ptr, index, priorities_ptr, lanes, valid, alpha_bits, eps_bits)
    if FOLD:
        tl.atomic_max(leaf_bits_ptr + index, value.to(tl.int64, bitcast=True), mask=valid)
    else:
        tl.store(leaves_ptr + index, value, mask=valid)
        largest = tl.max(tl.where(valid, value, 0.0), axis=0)
        tl.atomic_max(max_ptr, largest.to(tl.int64, bitcast=True))


def fused_draw(levels: list[torch.Tensor], uniform: torch.Tensor, written: torch.Tensor, beta: torch.Tensor,
               lowest: torch.Tensor, fanout: int, num_leaves: int, ring_steps: int, n_step: int, num_envs: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B] int64, weight [B] f32)`` for ``uniform [B]`` (any stride); ``lowest`` a 0-dim int64 scratch."""
    if len(levels) > MAX_FUSED_DEPTH:
        raise ValueError(f"the fused descent takes at most {MAX_FUSED_DEPTH} levels, not {len(levels)}")
    batch = uniform.shape[0]
    index = torch.empty((batch,), device=uniform.device, dtype=torch.int64)
    weight = torch.empty((batch,), device=uniform.device, dtype=torch.float32)
    if batch == 0:
        return index, weight
    padded = [*levels, *[levels[-1]] * (MAX_FUSED_DEPTH - len(levels))]
    grid = (triton.cdiv(batch, BLOCK),)
    with on_device(uniform):
        lowest.fill_(INT64_MAX)
        _descend_kernel[grid](*padded, levels[-1], uniform, uniform.stride(0), index, lowest, batch, num_leaves,
                              bits(BELOW), DEPTH=len(levels), FANOUT=fanout, TOP=levels[0].numel(), BLOCK=BLOCK,
                              num_warps=WARPS)
        _weights_kernel[grid](levels[0], levels[-1], index, lowest, written, beta, weight, batch, ring_steps,
                              n_step, num_envs, TOP=levels[0].numel(), BLOCK=BLOCK, num_warps=WARPS)
    return index, weight


def fused_update(levels: list[torch.Tensor], max_priority: torch.Tensor, index: torch.Tensor,
                 priorities: torch.Tensor, alpha: float, eps: float, fanout: int) -> None:
    """Leaves ``index [B]`` from ``priorities [B]``, their ancestors and ``max_priority`` (0-dim f64), in place."""
    batch = index.shape[0]
    if batch == 0:
        return
    index, priorities = index.contiguous(), priorities.detach().contiguous()
    leaves = levels[-1]
    grid = (triton.cdiv(batch, BLOCK),)
    with on_device(index):
        arguments = (leaves, leaves.view(torch.int64), index, priorities, max_priority.view(torch.int64), batch,
                     bits(alpha), bits(eps))
        for fold in (0, 1):  # two launches: every store lands before any leaf's maximum is folded in
            _leaves_kernel[grid](*arguments, FOLD=fold, BLOCK=BLOCK, num_warps=WARPS)
    propagate(levels, index, fanout)
