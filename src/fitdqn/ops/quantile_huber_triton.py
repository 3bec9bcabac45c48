"""Triton kernel of the quantile Huber loss (``fitdqn::quantile_huber`` on CUDA): the pairwise form, in registers.

The closed form of :func:`fitdqn.ops.quantile_huber.quantile_huber_sorted` avoids the pairwise ``[B, N, N', C]``
tensors in memory at the price of a sort, prefix sums, three binary searches and about forty float64 passes over
``[B, C, N]`` (0.73 ms of the update at batch 8192 on an H200). The kernels here form the pairs in registers and
write nothing but the results:

    u_ij = t_j - p_i,   rho_ij = |tau_i - 1{u_ij < 0}| * Huber_kappa(u_ij) / kappa
    loss_b = mean_c sum_i mean_j rho_ij             (the reduction of ``quantile_huber_loss``)
    d loss_b / d p_i = -mean_j |tau_i - 1{u_ij < 0}| * clamp(u_ij, -kappa, kappa) / (kappa * C)

in fp32 (sums of 64 terms: far inside fp32's precision). ``_rows_kernel``: one (sample, quantile i) row a lane,
32 rows a warp, ``ROWS_WARPS`` warps a program; for each column the lane walks the N' targets in a loop (unrolled
when ``ROWS_UNROLL``), each target loaded once per sample (one address across the sample's lanes), and keeps its
two sums in registers: the only reduction across lanes is the per-sample loss at the end. Compiled for sm_90 by
Triton 3.6: 32 registers, no stack, so full occupancy (two rows a lane: 255 registers and spills, hence one). A
program a sample with the ``[N, N']`` tile of each column reduced across its lanes took 0.278 ms at its best
(2 warps; H200, B = 8192, N = N' = 64, 3 columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import on_device

ROWS_WARPS, ROWS_UNROLL = 8, True  # warps a program and whether the loop over targets unrolls


def fused_quantile_huber(pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pred [B, N, ...]``, ``target [B, N', ...]``, ``taus [B, N]`` -> loss ``[B]`` and d loss / d pred
    ``[B, N, ...]``, both in pred's dtype."""
    batch, quantiles = pred.shape[:2]
    targets = target.shape[1]
    p = pred.reshape(batch, quantiles, -1).contiguous()  # [B, N, C]
    t = target.reshape(batch, targets, -1).contiguous()  # [B, N', C]
    levels = taus.contiguous()  # [B, N]
    columns = p.shape[-1]
    loss = torch.empty(batch, device=pred.device, dtype=torch.float32)
    grad = torch.empty(p.shape, device=pred.device, dtype=torch.float32)
    if batch and quantiles and targets and columns:
        scale = 1.0 / (kappa * targets * columns)
        with on_device(pred):
            block_n = triton.next_power_of_2(quantiles)
            samples = max(1, 32 * ROWS_WARPS // block_n)
            _rows_kernel[(triton.cdiv(batch, samples),)](
                p, t, levels, loss, grad, batch, quantiles, float(kappa), scale, COLUMNS=columns,
                TARGETS=targets, SAMPLES=samples, BLOCK_N=block_n, UNROLL=ROWS_UNROLL, num_warps=ROWS_WARPS,
            )
    else:
        loss.zero_()
        grad.zero_()
    return loss.to(pred.dtype), grad.view(pred.shape).to(pred.dtype)


@triton.jit
def _rows_pair(target_ptr, sample, i_ok, p, tau, j, column, kappa, total, slope, TARGETS: tl.constexpr,
               COLUMNS: tl.constexpr):
    """Target j against each lane's prediction: ``total += rho``, ``slope += w clamp(u)`` (``[R]`` each)."""
    t = tl.load(target_ptr + (sample * TARGETS + j) * COLUMNS + column, mask=i_ok, other=0.0).to(tl.float32)
    u = t - p  # [R]
    magnitude = tl.abs(u)
    weight = tl.where(u < 0.0, 1.0 - tau, tau)  # |tau - 1{u < 0}|
    huber = tl.where(magnitude <= kappa, 0.5 * u * u, kappa * (magnitude - 0.5 * kappa))
    return total + weight * huber, slope + weight * tl.minimum(tl.maximum(u, -kappa), kappa)


@triton.jit
def _rows_kernel(pred_ptr, target_ptr, taus_ptr, loss_ptr, grad_ptr, batch, N, kappa, scale,
                 COLUMNS: tl.constexpr, TARGETS: tl.constexpr, SAMPLES: tl.constexpr, BLOCK_N: tl.constexpr,
                 UNROLL: tl.constexpr):
    """One (sample, quantile i) row a lane: the N' targets are walked in a loop, each loaded once per sample (one
    address across the sample's lanes), so no reduction crosses threads but the per-sample loss at the end."""
    row = tl.arange(0, SAMPLES * BLOCK_N)
    sample = (tl.program_id(0) * SAMPLES + row // BLOCK_N).to(tl.int64)  # [R]
    i = row % BLOCK_N
    valid = (sample < batch) & (i < N)
    tau = tl.load(taus_ptr + sample * N + i, mask=valid, other=0.0).to(tl.float32)  # [R]
    total = tl.zeros((SAMPLES * BLOCK_N,), dtype=tl.float32)  # [R]: sum_c sum_j rho_ij
    for column in tl.static_range(COLUMNS):
        p = tl.load(pred_ptr + (sample * N + i) * COLUMNS + column, mask=valid, other=0.0).to(tl.float32)
        slope = tl.zeros((SAMPLES * BLOCK_N,), dtype=tl.float32)  # [R]: sum_j w_ij clamp(u_ij)
        if UNROLL:
            for j in tl.static_range(TARGETS):
                total, slope = _rows_pair(target_ptr, sample, valid, p, tau, j, column, kappa, total, slope,
                                          TARGETS, COLUMNS)
        else:
            for j in range(TARGETS):
                total, slope = _rows_pair(target_ptr, sample, valid, p, tau, j, column, kappa, total, slope,
                                          TARGETS, COLUMNS)
        tl.store(grad_ptr + (sample * N + i) * COLUMNS + column, -slope * scale, mask=valid)
    total = tl.where(valid, total, 0.0)
    per_sample = tl.sum(tl.reshape(total, (SAMPLES, BLOCK_N)), axis=1) * scale  # [S]
    samples = tl.program_id(0) * SAMPLES + tl.arange(0, SAMPLES)
    tl.store(loss_ptr + samples, per_sample, mask=samples < batch)
