"""``relu(x @ weight.T + bias)`` with the ReLU in the matrix product's epilogue: :func:`linear_relu`.

``torch._addmm_activation`` runs the product, the bias and the ReLU as one cuBLASLt call on CUDA (its RELU_BIAS
epilogue), where ``F.linear`` + ``F.relu_`` writes the product and then reads and writes it again in a separate
elementwise pass (the trunk's two layers over the B x W tokens: 6 such passes an update, about 0.2 ms at batch 8192
on an H200). ATen has no derivative for it, so :class:`ProductBeforeReLU` and :class:`ReLUOfProduct` are its autograd,
two nodes as autograd's for ``F.relu_(F.linear(x, w, b))``, built from the same ATen ops:

    out = relu(x w^T + b)            saved: x and w in the compute dtype, and out (as autograd saves them)
    (the ReLU node first, then the product's, so each saved tensor is released when autograd's is)
    g'  = g * (out > 0)              (threshold_backward)
    dx  = g' w        dw = g'^T x    db = sum_rows g'  (``fitdqn.ops.linear.column_sum``: a matrix-vector
                                                       product for large gradients, no reduction staging)

Under autocast the inputs are cast to the autocast dtype first, as autocast casts a linear layer's, and the
weight and bias gradients come back in the parameters' dtype; the bias gradient is summed in the compute dtype,
as autograd's is. The values equal the unfused layer's (the ReLU commutes with the rounding of the product; the
bias gradient within the summation order's rounding) and so do the saved tensors and their bytes; every op is an
ATen op with a meta kernel, so fake tensors trace it without a fake kernel of its own.
"""

from __future__ import annotations

import torch

from fitdqn.ops.casts import cast
from fitdqn.ops.linear import compute_dtype, product_grads


class ProductBeforeReLU(torch.autograd.Function):
    """``apply(x [M, K], weight [N, K], bias [N]) -> relu(x weight^T + bias) [M, N]`` whose backward is the
    product's alone: it takes the gradient w.r.t. the product (:class:`ReLUOfProduct` masks it first)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc, wc = x.to(dtype), cast(weight, dtype)
            out = torch._addmm_activation(cast(bias, dtype), xc, wc.t())  # [M, N]: product, bias and ReLU in one
        ctx.save_for_backward(xc if ctx.needs_input_grad[1] else None, wc if ctx.needs_input_grad[0] else None)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_pre):  # grad_pre [M, N]: w.r.t. the product
        return product_grads(ctx, grad_pre)


class ReLUOfProduct(torch.autograd.Function):
    """The identity on :class:`ProductBeforeReLU`'s output (already ReLU'd) whose backward is the ReLU's
    (``threshold_backward`` on the saved output). A node of its own, as autograd's ``relu_`` is, so the output is
    released as soon as the mask is applied, before the product's backward runs (the unfused layer's order)."""

    @staticmethod
    def forward(ctx, out):
        ctx.save_for_backward(out)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [M, N]
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad_out.to(out.dtype), out, 0)


def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu(x [M, K] @ weight.T [K, N] + bias [N])`` -> ``[M, N]``; without autograd the one fused call."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return ReLUOfProduct.apply(ProductBeforeReLU.apply(x, weight, bias))
    dtype = compute_dtype(x)
    if x.dtype == weight.dtype == bias.dtype == dtype:  # nothing to cast (no autocast: acting on the CPU)
        return torch._addmm_activation(bias, x, weight.t())
    with torch.autocast(x.device.type, enabled=False):
        return torch._addmm_activation(cast(bias, dtype), x.to(dtype), cast(weight, dtype).t())
