"""``x @ weight.T + bias`` whose bias gradient is a matrix-vector product: :func:`linear` and :func:`column_sum`.

Autograd's linear layer (``AddmmBackward``) takes the bias gradient as ``grad.sum(0)``: on CUDA, ATen's generic
reduction splits the batch rows over thread blocks that stage fp32 partial sums in global memory, up to 4x the
gradient's bytes (``fitdqn.memory.kernel_scratch``). Those staging buffers were the update's largest transients: at
batch 8192 the C51 hidden layer's ``[8192, 768]`` gradient stages 48 MiB, the attention key/value and the trunk's
``[65536, 128]`` 64 MiB each. ``column_sum`` takes the same sum as ``grad^T @ ones`` through cuBLAS's matrix-vector
product, which reads the gradient once and allocates nothing (cuBLAS keeps its workspace from the first call).

Which way (``benchmarks/bias_grad.py`` on an H200, bf16, torch 2.11; BENCHMARKS.md "Bias gradients"): the product
is faster from ``[65536, 128]`` up (0.045 against 0.064 ms; 0.040 against 0.069 ms at ``[65536, 256]``) and 0.012 to
0.018 ms slower on ``[8192, 512..768]``, where it saves 32-48 MiB of the step's peak, and 0.011 ms slower on
``[65536, 64]``, where it saves 8 MiB. So gradients of at least ``MATRIX_VECTOR_MIN_COLUMNS`` columns take the product
and narrower ones the reduction. The rule reads the columns only, never the batch: the update then runs the same
ops at every batch, which the planner's derivation of the step from two traced batches relies on
(``fitdqn.memory.trace.TraceFit``).

``Linear`` is the autograd of ``F.linear`` for a 2-D input, the same ATen ops as ``AddmmBackward`` except the bias
gradient: under autocast the input and weight are cast to the autocast dtype (as autocast casts a linear layer's)
and saved so; the weight and bias gradients come back in the parameters' dtypes:

    out = x w^T + b      dx = g w      dw = g^T x      db = g^T 1 (column_sum)

The weight and bias gradients are written in the parameters' dtype (fp32) by the product and the reduction
themselves where they can (:func:`weight_product` on CUDA, :func:`column_sum` for a narrow bias), not cast
afterwards: a cast kernel fewer for each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fitdqn.ops.casts import cast

# bias gradients of at least this many columns take the matrix-vector product (module docstring)
MATRIX_VECTOR_MIN_COLUMNS = 128


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer on ``x`` computes in: autocast's where it is on (floating inputs), else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.dtype.is_floating_point:
        return torch.get_autocast_dtype(device)
    return x.dtype


def column_sum(grad: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``grad [M, N] -> [N]`` in ``dtype`` (default ``grad``'s): the sum over rows, as a matrix-vector product when
    the gradient is wide; a narrow one's reduction accumulates in fp32 and writes ``dtype`` directly (no cast)."""
    dtype = grad.dtype if dtype is None else dtype
    if grad.shape[1] < MATRIX_VECTOR_MIN_COLUMNS:
        return grad.sum(0, dtype=dtype)
    return torch.mv(grad.t(), grad.new_ones(grad.shape[0])).to(dtype)  # [N]: cuBLAS, no staging buffer


def weight_product(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad^T [N, M] @ x [M, K] -> [N, K]`` in ``dtype``: on CUDA a bf16/fp16 product writes fp32 directly
    (``aten::mm``'s ``out_dtype``: the fp32 accumulator stored as it is, no rounding to bf16 and no cast kernel)."""
    if grad.device.type == "cuda" and dtype == torch.float32 and grad.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(grad.t(), x, out_dtype=dtype)
    return (grad.t() @ x).to(dtype)


class Linear(torch.autograd.Function):
    """``apply(x [M, K], weight [N, K], bias [N]) -> x weight^T + bias [M, N]`` (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc, wc = x.to(dtype), cast(weight, dtype)
            out = torch.addmm(cast(bias, dtype), xc, wc.t())  # [M, N]
        ctx.save_for_backward(xc if ctx.needs_input_grad[1] else None, wc if ctx.needs_input_grad[0] else None)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [M, N]
        return product_grads(ctx, grad_out)


def product_grads(ctx, grad: torch.Tensor):
    """The gradients of ``x w^T + b`` from ``grad [M, N]`` w.r.t. the product, for a ``Function`` that saved the
    compute-dtype ``x`` and ``w`` (each only where the other's gradient needs it) and the inputs' dtypes."""
    xc, wc = ctx.saved_tensors
    x_dtype, w_dtype, b_dtype = ctx.dtypes
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = (grad @ wc).to(x_dtype)  # [M, K]
    if ctx.needs_input_grad[1]:
        grad_w = weight_product(grad, xc, w_dtype)  # [N, K]
    if ctx.needs_input_grad[2]:
        grad_b = column_sum(grad, b_dtype)  # [N]
    return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight.T [K, N] + bias [N]`` -> ``[..., N]``; without autograd plain ``F.linear`` (the
    parameters cast by :func:`fitdqn.ops.casts.cast`)."""
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad)):
        dtype = compute_dtype(x)
        if x.dtype == weight.dtype == bias.dtype == dtype:  # nothing to cast (no autocast: acting on the CPU)
            return F.linear(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):  # the casts autocast makes, each parameter's once a step
            return F.linear(x.to(dtype), cast(weight, dtype), cast(bias, dtype))
    if x.dim() == 2:
        return Linear.apply(x, weight, bias)  # [M, N]: its own tensor (an in-place ReLU on it is no CopySlices)
    out = Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)  # [M, N]
    return out.view(*x.shape[:-1], out.shape[-1])  # [..., N]
