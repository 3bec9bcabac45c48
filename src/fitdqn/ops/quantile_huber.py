"""IQN's quantile Huber loss as one PyTorch operator, ``fitdqn::quantile_huber``: on the CPU the sorted closed form
(:func:`quantile_huber_sorted`), on CUDA the pairwise form in a Triton kernel
(:mod:`fitdqn.ops.quantile_huber_triton`); :class:`QuantileHuber` is its autograd, saving only d loss / d pred.

``quantile_huber(pred [B, N, ...], target [B, N', ...], taus [B, N], kappa) -> (loss [B], grad [B, N, ...])``,
the maths of :func:`fitdqn.learn.losses.quantile_huber_loss`. Kernels: on CUDA the pairwise Triton kernel
(nothing but the two results is written); everywhere else (and for other dtypes than
:data:`fitdqn.ops.kernels.FUSED_DTYPES`) the sorted closed form.

Why an operator: the memory planner traces the update on fake tensors, often fake *CPU* tensors standing in for
CUDA ones. The closed form's float64 temporaries (about 10 of ``[B, C, N]``) would be traced where the GPU
allocates only the two results; the fake kernel allocates exactly those, so a CUDA target's trace sees the GPU's
bytes. :func:`fitdqn.learn.losses.quantile_huber_loss` calls it.
"""

from __future__ import annotations

import torch

from fitdqn.ops.kernels import runs_triton, triton_module


class QuantileHuber(torch.autograd.Function):
    """``apply(pred, target, taus, kappa) -> loss [B]``: the operator; saves only d loss / d pred ``[B, N, ...]``."""

    @staticmethod
    def forward(ctx, pred, target, taus, kappa: float):
        loss, grad = quantile_huber(pred, target, taus, kappa)
        ctx.save_for_backward(grad)  # [B, N, ...]: the only saved tensor
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss [B]
        (grad,) = ctx.saved_tensors
        scale = grad_loss.reshape(grad_loss.shape + (1,) * (grad.dim() - 1)).to(grad.dtype)
        return grad * scale, None, None, None


def quantile_huber_sorted(
    pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss ``[B]`` (pred's dtype) and its gradient w.r.t. pred ``[B, N, ...]``.

    For one prediction p at level tau, with u = t - p over the sorted targets t:
    below = sum_{u < -k} k (-u - k/2) + sum_{-k <= u < 0} u^2 / 2, weighted (1 - tau);
    above = sum_{0 <= u <= k} u^2 / 2 + sum_{u > k} k (u - k/2), weighted tau.
    (Huber and its derivative are continuous at |u| = k and 0, so ties may fall either side.)
    Everything is float64 ``[B, C, N]`` (C = trailing columns), updated in place to keep few alive.
    """
    batch, n = pred.shape[:2]
    m = target.shape[1]
    p = pred.detach().reshape(batch, n, -1).transpose(1, 2).double().contiguous()  # [B, C, N]
    t = target.reshape(batch, m, -1).transpose(1, 2)  # [B, C, M]
    t = torch.sort(t, dim=-1).values.double().contiguous()  # [B, C, M]: sorted in the input dtype (same order)
    zero = t.new_zeros(*t.shape[:-1], 1)
    s1 = torch.cat([zero, t.cumsum(-1)], dim=-1)  # [B, C, M + 1]: sum of the k smallest targets
    s2 = torch.cat([zero, t.square().cumsum(-1)], dim=-1)  # [B, C, M + 1]: sum of their squares
    del zero

    def prefix(values: torch.Tensor, right: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = torch.searchsorted(t, values, right=right)  # [B, C, N]: how many targets lie below
        return k.double(), s1.gather(-1, k), s2.gather(-1, k)

    def quadratic(count, sum1, sum2):  # sum (t - p)^2 / 2 over a range (consumes sum2), d/dp
        value = sum2.addcmul_(p, sum1, value=-2.0).addcmul_(count, p.square()).mul_(0.5)
        return value, torch.addcmul(-sum1, count, p)

    n_a, s1_a, s2_a = prefix(p - kappa, right=False)  # [0, a): u < -kappa
    n_b, s1_b, s2_b = prefix(p, right=False)  # [0, b): u < 0
    loss = (p - 0.5 * kappa).mul_(n_a).sub_(s1_a).mul_(kappa)  # linear part of below
    grad = n_a * kappa
    value, slope = quadratic(n_b - n_a, s1_b - s1_a, s2_b - s2_a)  # [a, b): -kappa <= u < 0
    del n_a, s1_a, s2_a
    weight = 1.0 - taus.double().unsqueeze(1)  # [B, 1, N]: 1 - tau
    loss.add_(value).mul_(weight)
    grad.add_(slope).mul_(weight)
    del value, slope
    weight.neg_().add_(1.0)  # tau
    n_c, s1_c, s2_c = prefix(p + kappa, right=True)  # [0, c): u <= kappa
    value, slope = quadratic(n_c - n_b, s1_c - s1_b, s2_c.sub_(s2_b))  # [b, c): 0 <= u <= kappa
    del n_b, s1_b, s2_b, s2_c
    n_c.neg_().add_(m)  # u > kappa: count ...
    s1_c.neg_().add_(s1[..., -1:])  # ... and sum
    value.add_((p + 0.5 * kappa).mul_(n_c).neg_().add_(s1_c).mul_(kappa))
    slope.sub_(n_c, alpha=kappa)
    loss.addcmul_(weight, value)
    grad.addcmul_(weight, slope)
    scale = 1.0 / (kappa * m)  # Huber / kappa, mean over the targets
    columns = p.shape[1]
    loss = loss.sum(dim=-1).mean(dim=-1).mul_(scale)  # [B]: sum over N, mean over columns
    grad = grad.mul_(scale / columns).transpose(1, 2).reshape(pred.shape).to(pred.dtype)  # [B, N, ...]
    return loss.to(pred.dtype), grad


@torch.library.custom_op("fitdqn::quantile_huber", mutates_args=())
def quantile_huber(pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss ``[B]`` and its gradient w.r.t. pred; the default (CPU) kernel is the closed form."""
    return quantile_huber_sorted(pred, target, taus, kappa)


@quantile_huber.register_kernel("cuda")
def _quantile_huber_cuda(pred, target, taus, kappa):
    if not runs_triton(pred, target):
        return quantile_huber_sorted(pred, target, taus, kappa)
    return triton_module("fitdqn.ops.quantile_huber_triton").fused_quantile_huber(pred, target, taus, kappa)


@quantile_huber.register_fake
def _quantile_huber_fake(pred, target, taus, kappa):
    return pred.new_empty(pred.shape[:1]), pred.new_empty(pred.shape)
