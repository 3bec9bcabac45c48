"""Residual add + LayerNorm as one PyTorch operator, ``fitdqn::residual_layer_norm``, with its backward as a second
one: the end of :class:`fitdqn.nets.attention.LastTokenAttention`, ``LayerNorm(x + residual)``.

``residual_layer_norm(x [B, d], residual [B, d], weight [d], bias [d], eps)
-> (out [B, d], total [B, d], mean [B], rstd [B])``, with ``acc`` = fp32 (fp64 for fp64 inputs):

    total = x + residual, rounded to x's dtype        (the add autocast's bf16 tensors made before: bit for bit)
    mean = mean_j total,  rstd = 1 / sqrt(mean_j (total - mean)^2 + eps)          (in acc, from total)
    out = (total - mean) * rstd * weight + bias, rounded once to x's dtype

Only ``out`` is differentiable; ``total``, ``mean`` and ``rstd`` (acc) are what autograd saves for backward.
``residual`` may be strided (the attention's ``tokens[:, -1]``, a row view of ``[B, W, d]``).

``residual_layer_norm_backward(grad_out [B, d], total, mean, rstd, weight) -> (grad_total [B, d] in total's dtype,
partial_sums [P, 2, d] acc)``, everything in acc from grad_out cast to acc, with ``xhat = (total - mean) * rstd``
and ``dxhat = grad_out * weight``:

    grad_total = rstd * (dxhat - mean_j dxhat - xhat * mean_j (dxhat * xhat))   (LayerNorm's input gradient)
    partial_sums[p, 0] = sum over program p's rows of grad_out * xhat            (weight)
    partial_sums[p, 1] = sum over program p's rows of grad_out                   (bias)

The autograd backward (:func:`_backward`) gives grad_total to both x and residual (the add's gradient is the
identity) and sums the partials over P, in torch, for the weight and bias gradients: no atomics, so the sums are
deterministic. ``P`` (:func:`programs`) is the Triton kernels' grid: a program owns :func:`row_block` rows.

Why: under bf16 autocast the block ended with a bf16 add, a cast of the sum to fp32 (LayerNorm is one of CUDA
autocast's fp32 ops), ATen's LayerNorm writing fp32 features, and each consumer casting those back to bf16; in
backward ``layer_norm_grad_input`` and ``GammaBetaBackward`` (on an H200 at batch 8192: 18 us a LayerNorm call, 3
calls an update, plus the add and casts around each; 23 + 8 us in backward). Here one kernel each way, and the
features stay in x's dtype (bf16 under autocast), which the heads read directly (:mod:`fitdqn.nets.c51`'s
``linear_relu``, ``fitdqn::iqn_quantile_head``).

Kernels: on CUDA the Triton kernels of :mod:`fitdqn.ops.residual_norm_triton` when every tensor is bf16, fp16 or
fp32 (:data:`fitdqn.ops.kernels.FUSED_DTYPES`); everywhere else (and for fp64 on CUDA) the same maths in torch
(:func:`residual_norm_maths`, :func:`residual_norm_grads`), which cuts its partial sums by the same P.

As every operator here, the fake kernels (``register_fake``) allocate exactly what the Triton launchers allocate,
so the memory planner's trace on fake tensors (``fitdqn.memory.trace``) counts the GPU's bytes:

- forward: out and total ``[B, d]`` in x's dtype, mean and rstd ``[B]`` acc; autograd saves total, mean, rstd and
  the weight (not the fp32 LayerNorm input that ATen's LayerNorm kept);
- backward op: grad_total ``[B, d]`` in total's dtype and the partial sums ``[P, 2, d]`` acc, an output of the op
  (not a hidden transient) so the trace sees it; then the ``[2, d]`` sum over P.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fitdqn.ops.kernels import next_power_of_2, runs_triton, triton_module

TILE_ELEMENTS = 4096  # rows x padded columns of one program's tile: 64 rows at d = 64, 16 at d = 256


def row_block(d_model: int) -> int:
    """Rows a program owns: a power of two, the tile about ``TILE_ELEMENTS`` numbers (at least one row)."""
    return max(1, TILE_ELEMENTS // next_power_of_2(d_model))


def programs(batch: int, d_model: int) -> int:
    """P: the programs of either kernel along the batch, so the rows of the partial sums (fake kernels too)."""
    return -(-batch // row_block(d_model))


def accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    """The statistics, the normalisation and the gradients' arithmetic: fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _triton():
    return triton_module("fitdqn.ops.residual_norm_triton")


def check_shapes(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """x and residual ``[B, d]``, weight and bias ``[d]``, d at least 1: else ValueError."""
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != x.shape[1:] or bias.shape != x.shape[1:] \
            or x.shape[1] < 1:
        raise ValueError(f"residual_layer_norm wants x and residual [B, d], weight and bias [d] (d >= 1), got "
                         f"{tuple(x.shape)}, {tuple(residual.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")


def residual_norm_maths(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward in torch (module docstring): out, total ``[B, d]`` in x's dtype, mean, rstd ``[B]`` in acc."""
    acc = accumulate_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        total = (x.to(acc) + residual.to(acc)).to(x.dtype)  # [B, d]: an add of two bf16 tensors rounds so too
        # ATen's LayerNorm of the sum in acc: its own statistics ([B, 1] each), one kernel (not ten elementwise)
        out, mean, rstd = torch.native_layer_norm(total.to(acc), total.shape[-1:], weight.to(acc), bias.to(acc), eps)
    return out.to(x.dtype), total, mean.view(-1), rstd.view(-1)


def residual_norm_grads(grad_out: torch.Tensor, total: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward in torch (module docstring): grad_total ``[B, d]`` in total's dtype and the partial sums
    ``[P, 2, d]`` in acc, each program's rows (:func:`row_block`) summed as the Triton kernel sums them."""
    batch, d_model = total.shape
    acc = accumulate_dtype(total)
    with torch.autocast(total.device.type, enabled=False):
        g = grad_out.to(acc)  # [B, d]
        xhat = (total.to(acc) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)  # [B, d]
        dxhat = g * weight.to(acc)  # [B, d]
        grad_total = rstd.unsqueeze(-1) * (dxhat - dxhat.mean(-1, keepdim=True)
                                           - xhat * (dxhat * xhat).mean(-1, keepdim=True))  # [B, d]
        rows = row_block(d_model)
        parts = programs(batch, d_model)
        per_row = torch.stack((g * xhat, g), dim=1)  # [B, 2, d]
        per_row = F.pad(per_row, (0, 0, 0, 0, 0, parts * rows - batch))  # [P * rows, 2, d]: zero rows at the end
        partial_sums = per_row.view(parts, rows, 2, d_model).sum(1)  # [P, 2, d]
    return grad_total.to(total.dtype), partial_sums


# ---------------------------------------------------------------------------------------------- forward

@torch.library.custom_op("fitdqn::residual_layer_norm", mutates_args=())
def residual_layer_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out, total ``[B, d]`` (x's dtype), mean, rstd ``[B]`` (acc); the default (CPU) kernel is the torch maths."""
    check_shapes(x, residual, weight, bias)
    return residual_norm_maths(x, residual, weight, bias, eps)


@residual_layer_norm_op.register_kernel("cuda")
def _norm_cuda(x, residual, weight, bias, eps):
    check_shapes(x, residual, weight, bias)
    if not runs_triton(x, residual, weight, bias):
        return residual_norm_maths(x, residual, weight, bias, eps)
    return _triton().fused_residual_norm(x, residual, weight, bias, eps)


@residual_layer_norm_op.register_fake
def _norm_fake(x, residual, weight, bias, eps):
    check_shapes(x, residual, weight, bias)
    batch, acc = x.shape[0], accumulate_dtype(x)
    # [B, d] x's dtype twice (out, total), [B] acc twice (mean, rstd)
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(batch, dtype=acc), x.new_empty(batch, dtype=acc)


# ---------------------------------------------------------------------------------------------- backward

@torch.library.custom_op("fitdqn::residual_layer_norm_backward", mutates_args=())
def residual_layer_norm_backward(grad_out: torch.Tensor, total: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_out [B, d]`` -> grad_total ``[B, d]`` (total's dtype), partial sums ``[P, 2, d]`` (acc) of the
    weight and bias gradients. Default (CPU) kernel: the torch maths."""
    return residual_norm_grads(grad_out, total, mean, rstd, weight)


@residual_layer_norm_backward.register_kernel("cuda")
def _grads_cuda(grad_out, total, mean, rstd, weight):
    if not runs_triton(grad_out, total, weight):
        return residual_norm_grads(grad_out, total, mean, rstd, weight)
    return _triton().fused_residual_norm_grads(grad_out, total, mean, rstd, weight)


@residual_layer_norm_backward.register_fake
def _grads_fake(grad_out, total, mean, rstd, weight):
    batch, d_model = total.shape
    # [B, d] total's dtype, [P, 2, d] acc
    return total.new_empty(total.shape), total.new_empty((programs(batch, d_model), 2, d_model),
                                                         dtype=accumulate_dtype(total))


# ---------------------------------------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, bias, eps = inputs
    _, total, mean, rstd = output
    ctx.mark_non_differentiable(total, mean, rstd)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the three outputs that get none
    ctx.save_for_backward(total, mean, rstd, weight)
    ctx.dtypes = (x.dtype, residual.dtype, weight.dtype, bias.dtype)


def _backward(ctx, grad_out, *_):  # grad_out [B, d]; total, mean and rstd get no gradient
    if grad_out is None:
        return None, None, None, None, None
    total, mean, rstd, weight = ctx.saved_tensors
    x_dtype, residual_dtype, weight_dtype, bias_dtype = ctx.dtypes
    grad_total, partial_sums = torch.ops.fitdqn.residual_layer_norm_backward(grad_out, total, mean, rstd, weight)
    sums = partial_sums.sum(0)  # [2, d]: weight, bias
    need = ctx.needs_input_grad
    return (grad_total.to(x_dtype) if need[0] else None, grad_total.to(residual_dtype) if need[1] else None,
            sums[0].to(weight_dtype) if need[2] else None, sums[1].to(bias_dtype) if need[3] else None, None)


residual_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def residual_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """``LayerNorm(x [B, d] + residual [B, d])`` -> ``[B, d]`` in x's dtype: the operator's ``out`` (module
    docstring); ``residual`` may be a strided row view."""
    return residual_layer_norm_op(x, residual, weight, bias, eps)[0]
