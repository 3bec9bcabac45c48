"""The update's weighted loss as a plain autograd function: the oracle of ``fitdqn::weighted_losses`` and its
backward (the same operations in the same order)."""

from __future__ import annotations

import torch

from fitdqn.learn.losses import WeightedLosses


def weighted_losses(c51_target, log_probs, iqn, v, v_target, weight, loss_weights, expectile) -> WeightedLosses:
    """:func:`fitdqn.learn.losses.weighted_losses`' maths: ``(loss [], means [3], priorities [B])``."""
    with torch.autocast(log_probs.device.type, enabled=False):
        return WeightedLosses(*ReferenceWeightedLosses.apply(c51_target, log_probs, iqn, v, v_target, weight,
                                                             loss_weights, float(expectile)))


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """Elementwise asymmetric squared loss ``|expectile - 1{diff < 0}| * diff^2``, ``diff = target - pred``.

    ``expectile`` > 0.5 weights under-estimates (target above prediction) more: IQL's upper expectile.
    """
    weight = torch.where(diff < 0, 1.0 - expectile, expectile)
    return weight * diff.square()


class ReferenceWeightedLosses(torch.autograd.Function):
    """Saved for backward: the targets, the scaled importance weights ``[B]`` and the
    expectile's slope ``[B]`` (its loss is ``slope * diff``); all but the first exist in the forward anyway."""

    @staticmethod
    def forward(ctx, c51_target, log_probs, iqn, v, v_target, weight, loss_weights, expectile):
        batch, branches = log_probs.shape[:2]
        priorities = (c51_target * log_probs).sum((1, 2)) * (-1.0 / branches)  # [B]
        diff = v_target - v.float()  # [B]
        slope = torch.where(diff < 0, 1.0 - expectile, expectile) * diff  # [B]
        parts = torch.stack([priorities, iqn.float(), slope * diff])  # [3, B]: c51, iqn, iql per sample
        scaled = weight.float() * (1.0 / batch)  # [B]
        means = torch.mv(parts, scaled)  # [3]
        loss = torch.dot(means, loss_weights)  # []
        ctx.save_for_backward(c51_target, scaled, slope, loss_weights)
        ctx.branches, ctx.iqn_dtype, ctx.v_dtype = branches, iqn.dtype, v.dtype
        ctx.mark_non_differentiable(means, priorities)
        ctx.set_materialize_grads(False)  # no zero gradients made for the parts, which backward never reads
        return loss, means, priorities

    @staticmethod
    def backward(ctx, grad_loss, _grad_means, _grad_priorities):
        if grad_loss is None:  # nothing downstream used the loss
            return (None,) * 8
        c51_target, scaled, slope, loss_weights = ctx.saved_tensors
        per_sample = scaled * grad_loss  # [B]: d loss / d (sample's weighted sum)
        grad_log_probs = grad_iqn = grad_v = None
        if ctx.needs_input_grad[1]:
            grad_log_probs = c51_target * (per_sample * (-1.0 / ctx.branches)).view(-1, 1, 1)  # [B, br, A]
        if ctx.needs_input_grad[2]:
            grad_iqn = (per_sample * loss_weights[1]).to(ctx.iqn_dtype)  # [B]
        if ctx.needs_input_grad[3]:  # d iql / d v = -2 * slope
            grad_v = (per_sample * (loss_weights[2] * -2.0) * slope).to(ctx.v_dtype)  # [B]
        return None, grad_log_probs, grad_iqn, grad_v, None, None, None, None
