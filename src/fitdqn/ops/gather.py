"""``source.gather(dim, index)`` whose backward scatters into its zero tensor in place: :func:`gather_in_place_grad`.

ATen's ``gather_backward`` builds the gradient as ``zeros(source.shape).scatter_add_(dim, index, grad)`` for plain
tensors, but with the out-of-place ``scatter_add`` when any input is a tensor subclass, as the planner's fake tensors
are: a trace of the step then holds one more source-sized tensor at the backward's peak than any GPU run does (at
batch 131,072 the C51 head's ``[B, br, n, A]`` bf16 logits' gradient, 191 MiB, 8 % of the step). The same maths as
an autograd function with the in-place scatter is traced and run alike:

    forward:  out[..., j, ...] = source[..., index[..., j, ...], ...]     saved: index (a view, no bytes of its own)
    backward: d_source = zeros_like(source).scatter_add_(dim, index, d_out)

Every op is an ATen op with a meta kernel, so fake tensors trace it without a fake kernel of its own.
"""

from __future__ import annotations

import torch


class GatherInPlaceGrad(torch.autograd.Function):
    """``apply(source, dim, index) -> source.gather(dim, index)``, its gradient scattered in place."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.dim = dim
        ctx.source_shape = source.shape
        return source.gather(dim, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        grad_source = grad.new_zeros(ctx.source_shape).scatter_add_(ctx.dim, index, grad)
        return grad_source, None, None


def gather_in_place_grad(source: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``source.gather(dim, index)``; differentiable in ``source``, with the in-place backward above."""
    if not (torch.is_grad_enabled() and source.requires_grad):
        return source.gather(dim, index)
    return GatherInPlaceGrad.apply(source, dim, index)
