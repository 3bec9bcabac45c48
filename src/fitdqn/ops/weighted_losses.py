"""The update's weighted loss as two PyTorch operators, ``fitdqn::weighted_losses`` and its backward
``fitdqn::weighted_losses_backward``, and :class:`FusedWeightedLosses`, the autograd function over them that
:func:`fitdqn.learn.losses.weighted_losses` runs.

``weighted_losses(c51_target [B, br, A], log_probs [B, br, A], iqn [B], v [B], v_target [B], weight [B], expectile)
-> (priorities [B], partial_sums [B, 3])``, both in ``acc`` (fp32; fp64 for fp64 targets), every input cast to
acc first:

    priorities = -(1 / br) sum_{br, A} c51_target * log_probs       (each sample's C51 cross-entropy)
    diff = v_target - v,  slope = where(diff < 0, 1 - expectile, expectile) * diff,  iql = slope * diff
    scaled = weight * (1 / B)
    partial_sums[p * rows] = sum over program p's samples of scaled * (priorities, iqn, iql),  0 in the other rows

``P`` (:func:`programs`) is the Triton kernels' grid: a program owns ``rows`` = :func:`sample_block` samples, and
its row of the partial sums is that of its first sample. The sums are per program and no atomics add them up, so
they are deterministic; :class:`FusedWeightedLosses` sums the ``[B, 3]`` over the batch and dots the ``[3]`` means
with ``loss_weights`` in torch. One row a sample rather than ``[P, 3]``: the memory planner fits the update through
traces at two batches (``fitdqn.memory.trace.fit_traces``) and so wants whole bytes a sample in every size and in the
shapes a reduction reads; ``[P, 3]`` is 0.75 fp32 bytes a sample (``P = ceil(B / 16)``). The zeros cost 12 bytes
a sample, under a thousandth of the update's memory.

``weighted_losses_backward(grad_loss [], c51_target, v, v_target, weight, loss_weights [3], expectile, iqn_dtype)
-> (grad_log_probs [B, br, A] acc, grad_iqn [B] in iqn_dtype, grad_v [B] in v's dtype)``, with
``per_sample = scaled * grad_loss`` and the slope recomputed from v and v_target:

    grad_log_probs = c51_target * (per_sample * (-1 / br))
    grad_iqn = per_sample * loss_weights[1]
    grad_v = per_sample * (loss_weights[2] * -2) * slope            (d iql / d v = -2 slope)

``grad_loss`` and ``loss_weights`` are device tensors that the kernel reads by pointer: nothing is read on the host,
so the update can run in a CUDA graph. All three gradients are always written (the learner wants all three; a
gradient no input asks for is dropped by the autograd function, not skipped by the kernel).

These are the lines of the plain autograd function the tests hold it against (``tests/support/reference``), in the
same order of operations, so the elementwise results (the gradients) are the same bit for bit and the sums
(priorities, means) differ by fp32 summation order only.

Why: the plain function is about 12 kernel launches forward and 7 backward, nearly all on ``[B]`` vectors, each a few
microseconds of the launch-bound update's CUDA graph; here the forward is the operator, the sum over P and the dot
(3), and the backward one kernel. Autograd saves only tensors that exist anyway (the targets, v, v_target, the
importance weights and the loss weights): the slope is recomputed in the backward kernel rather than written as a
``[B]`` output and kept.

Kernels: on CUDA the Triton kernels of :mod:`fitdqn.ops.weighted_losses_triton` when every tensor is bf16, fp16 or
fp32 (:data:`fitdqn.ops.kernels.FUSED_DTYPES`); everywhere else (and for fp64 on CUDA) the same maths in torch
(:func:`loss_parts`, :func:`loss_grads`), which cuts its partial sums by the same programs. As for every operator
here, the fake kernels (``register_fake``) allocate exactly what the Triton launchers allocate, so the memory
planner's trace on fake tensors (``fitdqn.memory.trace``) counts the GPU's bytes: forward priorities ``[B]`` and the
partial sums ``[B, 3]``; backward the three gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fitdqn.ops.kernels import next_power_of_2, runs_triton, triton_module

TILE_ELEMENTS = 4096  # samples x padded branches x padded atoms of one program's tile: 16 samples at br 3, A 51
PARTS = 3  # the partial sums' columns: C51, IQN, IQL


def sample_block(branches: int, atoms: int) -> int:
    """Samples a program owns: a power of two, the tile about ``TILE_ELEMENTS`` numbers (at least one sample)."""
    return max(1, TILE_ELEMENTS // (next_power_of_2(branches) * next_power_of_2(atoms)))


def programs(batch: int, branches: int, atoms: int) -> int:
    """P: the programs of either kernel along the batch, so the partial sums' rows that are not zero."""
    return -(-batch // sample_block(branches, atoms))


def accumulate_dtype(c51_target: torch.Tensor) -> torch.dtype:
    """The arithmetic and the fp outputs: fp32 at least (fp64 targets keep fp64, for gradcheck)."""
    return torch.promote_types(c51_target.dtype, torch.float32)


def _triton():
    return triton_module("fitdqn.ops.weighted_losses_triton")


def check_shapes(c51_target: torch.Tensor, log_probs: torch.Tensor, *vectors: torch.Tensor) -> None:
    """``c51_target`` and ``log_probs`` the same ``[B, br, A]``, every vector ``[B]``: else ValueError."""
    if c51_target.dim() != 3 or log_probs.shape != c51_target.shape \
            or any(vector.shape != c51_target.shape[:1] for vector in vectors):
        raise ValueError(f"weighted_losses wants c51_target and log_probs [B, br, A] and vectors [B], got "
                         f"{tuple(c51_target.shape)}, {tuple(log_probs.shape)}, "
                         f"{[tuple(vector.shape) for vector in vectors]}")


def expectile_slope(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """``where(diff < 0, 1 - expectile, expectile) * diff`` ``[B]``: IQL's expectile loss is ``slope * diff``."""
    return torch.where(diff < 0, 1.0 - expectile, expectile) * diff


def loss_parts(c51_target: torch.Tensor, log_probs: torch.Tensor, iqn: torch.Tensor, v: torch.Tensor,
               v_target: torch.Tensor, weight: torch.Tensor, expectile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward in torch (module docstring): priorities ``[B]`` and the partial sums ``[B, 3]`` in acc, each
    program's samples (:func:`sample_block`) summed as the Triton kernel sums them, in its first sample's row."""
    batch, branches, atoms = c51_target.shape
    acc = accumulate_dtype(c51_target)
    with torch.autocast(c51_target.device.type, enabled=False):
        priorities = (c51_target.to(acc) * log_probs.to(acc)).sum((1, 2)) * (-1.0 / branches)  # [B]
        diff = v_target.to(acc) - v.to(acc)  # [B]
        slope = expectile_slope(diff, expectile)  # [B]
        scaled = weight.to(acc) * (1.0 / max(batch, 1))  # [B]
        per_sample = torch.stack([priorities, iqn.to(acc), slope * diff], dim=1) * scaled.unsqueeze(1)  # [B, 3]
        rows, parts = sample_block(branches, atoms), programs(batch, branches, atoms)
        per_sample = F.pad(per_sample, (0, 0, 0, parts * rows - batch))  # [P * rows, 3]: zero rows at the end
        partial_sums = torch.zeros_like(per_sample[:batch])  # [B, 3]
        partial_sums[::rows] = per_sample.view(parts, rows, PARTS).sum(1)  # [P, 3] into rows 0, rows, 2 rows ...
    return priorities, partial_sums


def loss_grads(grad_loss: torch.Tensor, c51_target: torch.Tensor, v: torch.Tensor, v_target: torch.Tensor,
               weight: torch.Tensor, loss_weights: torch.Tensor, expectile: float, iqn_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward in torch (module docstring): grad_log_probs ``[B, br, A]`` acc, grad_iqn ``[B]`` in
    ``iqn_dtype``, grad_v ``[B]`` in v's dtype."""
    batch, branches = c51_target.shape[:2]
    acc = accumulate_dtype(c51_target)
    with torch.autocast(c51_target.device.type, enabled=False):
        scaled = weight.to(acc) * (1.0 / max(batch, 1))  # [B]
        per_sample = scaled * grad_loss.to(acc)  # [B]: d loss / d (sample's weighted sum)
        grad_log_probs = c51_target.to(acc) * (per_sample * (-1.0 / branches)).view(-1, 1, 1)  # [B, br, A]
        grad_iqn = (per_sample * loss_weights[1].to(acc)).to(iqn_dtype)  # [B]
        slope = expectile_slope(v_target.to(acc) - v.to(acc), expectile)  # [B]
        grad_v = (per_sample * (loss_weights[2].to(acc) * -2.0) * slope).to(v.dtype)  # [B]
    return grad_log_probs, grad_iqn, grad_v


# ---------------------------------------------------------------------------------------------- forward

@torch.library.custom_op("fitdqn::weighted_losses", mutates_args=())
def weighted_losses_op(c51_target: torch.Tensor, log_probs: torch.Tensor, iqn: torch.Tensor, v: torch.Tensor,
                       v_target: torch.Tensor, weight: torch.Tensor, expectile: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """priorities ``[B]``, partial sums ``[B, 3]`` (acc); the default (CPU) kernel is the torch maths."""
    check_shapes(c51_target, log_probs, iqn, v, v_target, weight)
    return loss_parts(c51_target, log_probs, iqn, v, v_target, weight, expectile)


@weighted_losses_op.register_kernel("cuda")
def _losses_cuda(c51_target, log_probs, iqn, v, v_target, weight, expectile):
    check_shapes(c51_target, log_probs, iqn, v, v_target, weight)
    if not runs_triton(c51_target, log_probs, iqn, v, v_target, weight):
        return loss_parts(c51_target, log_probs, iqn, v, v_target, weight, expectile)
    return _triton().fused_weighted_losses(c51_target, log_probs, iqn, v, v_target, weight, expectile)


@weighted_losses_op.register_fake
def _losses_fake(c51_target, log_probs, iqn, v, v_target, weight, expectile):
    check_shapes(c51_target, log_probs, iqn, v, v_target, weight)
    batch = c51_target.shape[0]
    acc = accumulate_dtype(c51_target)
    # [B] acc (priorities), [B, 3] acc (partial sums)
    return c51_target.new_empty(batch, dtype=acc), c51_target.new_empty((batch, PARTS), dtype=acc)


# ---------------------------------------------------------------------------------------------- backward

@torch.library.custom_op("fitdqn::weighted_losses_backward", mutates_args=())
def weighted_losses_backward(grad_loss: torch.Tensor, c51_target: torch.Tensor, v: torch.Tensor,
                             v_target: torch.Tensor, weight: torch.Tensor, loss_weights: torch.Tensor,
                             expectile: float, iqn_dtype: torch.dtype
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_loss []`` -> grad_log_probs ``[B, br, A]`` (acc), grad_iqn ``[B]`` (iqn_dtype), grad_v ``[B]`` (v's
    dtype). Default (CPU) kernel: the torch maths."""
    return loss_grads(grad_loss, c51_target, v, v_target, weight, loss_weights, expectile, iqn_dtype)


@weighted_losses_backward.register_kernel("cuda")
def _grads_cuda(grad_loss, c51_target, v, v_target, weight, loss_weights, expectile, iqn_dtype):
    if not runs_triton(grad_loss, c51_target, v, v_target, weight, loss_weights, dtypes=(iqn_dtype,)):
        return loss_grads(grad_loss, c51_target, v, v_target, weight, loss_weights, expectile, iqn_dtype)
    return _triton().fused_weighted_losses_grads(grad_loss, c51_target, v, v_target, weight, loss_weights, expectile,
                                                 iqn_dtype)


@weighted_losses_backward.register_fake
def _grads_fake(grad_loss, c51_target, v, v_target, weight, loss_weights, expectile, iqn_dtype):
    batch = c51_target.shape[0]
    # [B, br, A] acc, [B] iqn_dtype, [B] v's dtype
    return (c51_target.new_empty(c51_target.shape, dtype=accumulate_dtype(c51_target)),
            c51_target.new_empty(batch, dtype=iqn_dtype), v.new_empty(batch))


# ---------------------------------------------------------------------------------------------- autograd

class FusedWeightedLosses(torch.autograd.Function):
    """``apply(c51_target, log_probs, iqn, v, v_target, weight, loss_weights, expectile) -> (loss [], means [3],
    priorities [B])``: the operator, ``means = partial_sums.sum(0)``, ``loss = means . loss_weights``; backward the
    backward operator from ``grad_loss``. Only ``loss`` is differentiable (w.r.t. log_probs, iqn and v).

    An autograd function rather than ``register_autograd`` on the forward operator: that operator's differentiable
    output would be the partial sums, so autograd would run the dot's and the sum's backward (a ``[3]`` product and
    an expanded ``[B, 3]`` gradient) before the kernel, one more launch and a different rounding from the torch
    path's ``scaled * grad_loss``; here the backward kernel reads ``grad_loss`` and ``loss_weights`` itself.
    Saved: c51_target, v, v_target, weight and loss_weights, all of which exist anyway."""

    @staticmethod
    def forward(ctx, c51_target, log_probs, iqn, v, v_target, weight, loss_weights, expectile):
        priorities, partial_sums = weighted_losses_op(c51_target, log_probs, iqn, v, v_target, weight, expectile)
        means = partial_sums.sum(0)  # [3]
        loss = torch.dot(means, loss_weights.to(means.dtype))  # []
        ctx.save_for_backward(c51_target, v, v_target, weight, loss_weights)
        ctx.expectile, ctx.iqn_dtype = expectile, iqn.dtype
        ctx.mark_non_differentiable(means, priorities)
        ctx.set_materialize_grads(False)  # no zero gradients made for the parts, which backward never reads
        return loss, means, priorities

    @staticmethod
    def backward(ctx, grad_loss, _grad_means, _grad_priorities):
        if grad_loss is None:  # nothing downstream used the loss
            return (None,) * 8
        c51_target, v, v_target, weight, loss_weights = ctx.saved_tensors
        grad_log_probs, grad_iqn, grad_v = weighted_losses_backward(
            grad_loss, c51_target, v, v_target, weight, loss_weights, ctx.expectile, ctx.iqn_dtype)
        need = ctx.needs_input_grad
        return (None, grad_log_probs if need[1] else None, grad_iqn if need[2] else None,
                grad_v if need[3] else None, None, None, None, None)
