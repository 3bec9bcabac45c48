"""Triton kernels of the fused residual add + LayerNorm (``fitdqn::residual_layer_norm`` on CUDA): one pass each way.

Memory-bound and tiny per row (d = 64 or 256 numbers), so the kernels are built around reading each input once and
writing each result once, and around few launches: the forward replaces an add, a cast and ATen's LayerNorm, the
backward ``layer_norm_grad_input`` and ``GammaBetaBackward``. A program owns a tile of ``BLOCK_M`` whole rows x
``BLOCK_D`` columns (d padded to a power of two, masked; the last, contiguous, axis is d, so loads and stores are
coalesced along the row), ``BLOCK_M`` from :func:`fitdqn.ops.residual_norm.row_block` (a tile of about
``TILE_ELEMENTS`` = 4096 numbers: 16 rows at d = 256, 64 at d = 64). Grid ``[P]``, ``P = ceil(B / BLOCK_M)``
(:func:`fitdqn.ops.residual_norm.programs`, which the fake kernel reads too). A row lies in one program, so its
statistics are ``tl.sum`` over the tile's column axis, no second pass and no atomics. Everything is fp32 in
registers from the loaded tensors (bf16, fp16 or fp32; x, residual and grad_out may be strided), rounded once at
each store.

Forward (``_forward_kernel``): ``total = x + residual`` (fp32 add), rounded to x's dtype and stored; from the
rounded total, ``mean = sum total / d``, ``var = sum (total - mean)^2 / d`` (padded columns masked out of the
centred values), ``rstd = rsqrt(var + eps)``; ``out = (total - mean) rstd w + b`` stored in x's dtype, mean and
rstd ``[B]`` in fp32.

Backward (``_backward_kernel``): from grad_out ``g``, the saved total, mean and rstd:
``xhat = (total - mean) rstd`` (0 in padded columns), ``dxhat = g w``,
``grad_total = rstd (dxhat - sum dxhat / d - xhat sum (dxhat xhat) / d)`` stored in total's dtype; and the program's
column sums over its rows, ``sum g xhat`` (weight) and ``sum g`` (bias), stored into its row of the partial sums
``[P, 2, d]`` fp32 (rows past B load zeros and add nothing), which the operator's autograd sums over P.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import next_power_of_2, on_device
from fitdqn.ops.residual_norm import programs, row_block

# Launch shapes, not tuned (no GPU timing yet): 4 warps hold a 4096-number tile as 32 numbers a thread, each tile
# row as 16-byte vectors at d = 256 in bf16.
FORWARD_WARPS, BACKWARD_WARPS = 4, 4


def fused_residual_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [B, d]``, ``residual [B, d]`` -> out, total ``[B, d]`` in x's dtype, mean, rstd ``[B]`` fp32
    (``fitdqn.ops.residual_norm``)."""
    batch, d_model = x.shape
    out = torch.empty(batch, d_model, device=x.device, dtype=x.dtype)  # [B, d]
    total = torch.empty(batch, d_model, device=x.device, dtype=x.dtype)  # [B, d]
    mean = torch.empty(batch, device=x.device, dtype=torch.float32)  # [B]
    rstd = torch.empty(batch, device=x.device, dtype=torch.float32)  # [B]
    if batch == 0:
        return out, total, mean, rstd
    with on_device(x):
        _forward_kernel[(programs(batch, d_model),)](
            x, x.stride(0), x.stride(1), residual, residual.stride(0), residual.stride(1),
            weight.contiguous(), bias.contiguous(), out, total, mean, rstd, batch, d_model, eps,
            **_blocks(d_model), num_warps=FORWARD_WARPS,
        )
    return out, total, mean, rstd


def fused_residual_norm_grads(grad_out: torch.Tensor, total: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_out [B, d]`` -> grad_total ``[B, d]`` in total's dtype and the partial sums ``[P, 2, d]`` fp32 of the
    weight and bias gradients, every element written by the kernel."""
    batch, d_model = total.shape
    grad_total = torch.empty(batch, d_model, device=total.device, dtype=total.dtype)  # [B, d]
    partial_sums = torch.empty(programs(batch, d_model), 2, d_model, device=total.device,
                               dtype=torch.float32)  # [P, 2, d]
    if batch == 0:
        return grad_total, partial_sums
    with on_device(total):
        _backward_kernel[(partial_sums.shape[0],)](
            grad_out, grad_out.stride(0), grad_out.stride(1), total, total.stride(0), total.stride(1), mean, rstd,
            weight.contiguous(), grad_total, partial_sums, batch, d_model,
            **_blocks(d_model), num_warps=BACKWARD_WARPS,
        )
    return grad_total, partial_sums


def _blocks(d_model: int) -> dict:
    """The tile's constexprs: BLOCK_M rows x BLOCK_D columns (both powers of two)."""
    block_d = next_power_of_2(d_model)
    return dict(BLOCK_M=row_block(d_model), BLOCK_D=block_d, PADDED=block_d != d_model)


@triton.jit
def _tile(batch, d_model, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PADDED: tl.constexpr):
    """The program's rows ``[M]`` (int64), columns ``[D]`` and which (row, column) pairs exist ``[M, D]``."""
    row = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    column = tl.arange(0, BLOCK_D)
    valid = (row < batch)[:, None]
    if PADDED:
        valid = valid & (column < d_model)[None, :]
    return row, column, valid


@triton.jit
def _forward_kernel(
    x_ptr, stride_xb, stride_xd, residual_ptr, stride_rb, stride_rd, weight_ptr, bias_ptr,
    out_ptr, total_ptr, mean_ptr, rstd_ptr, batch, d_model, eps,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PADDED: tl.constexpr,
):
    row, column, valid = _tile(batch, d_model, BLOCK_M, BLOCK_D, PADDED)
    x = tl.load(x_ptr + row[:, None] * stride_xb + column[None, :] * stride_xd, mask=valid, other=0.0)
    residual = tl.load(residual_ptr + row[:, None] * stride_rb + column[None, :] * stride_rd, mask=valid, other=0.0)
    total = (x.to(tl.float32) + residual.to(tl.float32)).to(total_ptr.dtype.element_ty)  # [M, D]: x's dtype
    dense = row[:, None] * d_model + column[None, :]  # [M, D]: offsets in the contiguous outputs
    tl.store(total_ptr + dense, total, mask=valid)
    values = total.to(tl.float32)  # [M, D]: the statistics of the rounded sum
    mean = tl.sum(values, axis=1) / d_model  # [M]
    centred = tl.where(valid, values - mean[:, None], 0.0)  # [M, D]: padded columns out of the variance
    rstd = tl.math.rsqrt(tl.sum(centred * centred, axis=1) / d_model + eps)  # [M]
    column_ok = column < d_model
    weight = tl.load(weight_ptr + column, mask=column_ok, other=0.0).to(tl.float32)  # [D]
    bias = tl.load(bias_ptr + column, mask=column_ok, other=0.0).to(tl.float32)  # [D]
    out = centred * rstd[:, None] * weight[None, :] + bias[None, :]  # [M, D]
    tl.store(out_ptr + dense, out.to(out_ptr.dtype.element_ty), mask=valid)
    row_ok = row < batch
    tl.store(mean_ptr + row, mean, mask=row_ok)
    tl.store(rstd_ptr + row, rstd, mask=row_ok)


@triton.jit
def _backward_kernel(
    grad_ptr, stride_gb, stride_gd, total_ptr, stride_tb, stride_td, mean_ptr, rstd_ptr, weight_ptr,
    grad_total_ptr, partial_ptr, batch, d_model,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PADDED: tl.constexpr,
):
    row, column, valid = _tile(batch, d_model, BLOCK_M, BLOCK_D, PADDED)
    row_ok = row < batch
    column_ok = column < d_model
    g = tl.load(grad_ptr + row[:, None] * stride_gb + column[None, :] * stride_gd, mask=valid,
                other=0.0).to(tl.float32)  # [M, D]
    total = tl.load(total_ptr + row[:, None] * stride_tb + column[None, :] * stride_td, mask=valid,
                    other=0.0).to(tl.float32)  # [M, D]
    mean = tl.load(mean_ptr + row, mask=row_ok, other=0.0)  # [M]
    rstd = tl.load(rstd_ptr + row, mask=row_ok, other=0.0)  # [M]
    weight = tl.load(weight_ptr + column, mask=column_ok, other=0.0).to(tl.float32)  # [D]
    xhat = tl.where(valid, (total - mean[:, None]) * rstd[:, None], 0.0)  # [M, D]
    dxhat = g * weight[None, :]  # [M, D]: 0 where g was not loaded
    mean_dxhat = tl.sum(dxhat, axis=1) / d_model  # [M]
    mean_dxhat_xhat = tl.sum(dxhat * xhat, axis=1) / d_model  # [M]
    grad_total = rstd[:, None] * (dxhat - mean_dxhat[:, None] - xhat * mean_dxhat_xhat[:, None])  # [M, D]
    tl.store(grad_total_ptr + row[:, None] * d_model + column[None, :],
             grad_total.to(grad_total_ptr.dtype.element_ty), mask=valid)
    partial = partial_ptr + tl.program_id(0) * 2 * d_model + column  # [D]: this program's row of [P, 2, d]
    tl.store(partial, tl.sum(g * xhat, axis=0), mask=column_ok)  # weight
    tl.store(partial + d_model, tl.sum(g, axis=0), mask=column_ok)  # bias
