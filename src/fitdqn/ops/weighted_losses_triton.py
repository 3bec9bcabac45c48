"""Triton kernels of the update's weighted loss (``fitdqn::weighted_losses`` and its backward on CUDA): one pass each
way.

Launch-bound rather than memory-bound (a few ``[B]`` vectors and two ``[B, br, A]`` fp32 tensors, 5 MB each at
batch 8192): the kernels replace about a dozen ATen launches forward and seven backward. A program owns a tile of
``BLOCK_B`` whole samples x ``BLOCK_BR`` branches x ``BLOCK_A`` atoms (br and A padded to powers of two, masked;
A the last axis, contiguous in the learner's tensors, so loads and stores are coalesced along it), ``BLOCK_B``
from :func:`fitdqn.ops.weighted_losses.sample_block` (a tile of about ``TILE_ELEMENTS`` = 4096 numbers: 16 samples
at br = 3, A = 51). Grid ``[P]``, ``P = ceil(B / BLOCK_B)`` (:func:`fitdqn.ops.weighted_losses.programs`, which
the fake kernels read too). A sample lies in one program, so its cross-entropy is a ``tl.sum`` over the tile's
branch and atom axes, and the program's three sums over its samples are stored into its first sample's row of the
partial sums ``[B, 3]``, zeros into its other samples' rows: no atomics, no second pass. Everything is fp32 in
registers from the loaded tensors (bf16, fp16 or fp32, any strides), rounded once at each store.

The arithmetic is that of the CPU kernel (:func:`fitdqn.ops.weighted_losses.loss_parts` and ``loss_grads``)
operation for operation, with its fp32 scalars (``1 / B``, ``-1 / br``, ``1 - expectile`` and ``expectile``,
passed as fp32 arguments), so every elementwise result is the CPU kernel's bit for bit; only the sums' order
differs.

Forward (``_forward_kernel``): ``priorities = sum c51_target * log_probs * (-1 / br)``; ``diff = v_target - v``,
``slope = where(diff < 0, 1 - expectile, expectile) * diff``; ``scaled = weight * (1 / B)`` (0 past B); the
program's sums of ``scaled * priorities``, ``scaled * iqn`` and ``scaled * (slope * diff)``.

Backward (``_backward_kernel``): ``grad_loss`` and ``loss_weights`` loaded from device memory (nothing read on the
host: the update runs in a CUDA graph); ``per_sample = scaled * grad_loss``; ``grad_log_probs = c51_target *
(per_sample * (-1 / br))`` fp32, ``grad_iqn = per_sample * w_iqn`` in iqn's dtype, ``grad_v = per_sample * (w_iql *
-2) * slope`` in v's dtype, the slope recomputed from v and v_target.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import next_power_of_2, on_device
from fitdqn.ops.weighted_losses import PARTS, programs, sample_block

# Launch shapes, not tuned (no GPU timing yet): 4 warps hold a 4096-number tile as 32 numbers a thread.
FORWARD_WARPS, BACKWARD_WARPS = 4, 4


def fused_weighted_losses(c51_target: torch.Tensor, log_probs: torch.Tensor, iqn: torch.Tensor, v: torch.Tensor,
                          v_target: torch.Tensor, weight: torch.Tensor, expectile: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``c51_target, log_probs [B, br, A]``, ``iqn, v, v_target, weight [B]`` -> priorities ``[B]`` and the partial
    sums ``[B, 3]``, fp32, every element written by the kernel (``fitdqn.ops.weighted_losses``)."""
    batch, branches, atoms = c51_target.shape
    device = c51_target.device
    priorities = torch.empty(batch, device=device, dtype=torch.float32)  # [B]
    partial_sums = torch.empty(batch, PARTS, device=device, dtype=torch.float32)  # [B, 3]
    if batch == 0:
        return priorities, partial_sums
    with on_device(c51_target):
        _forward_kernel[(programs(batch, branches, atoms),)](
            c51_target, *c51_target.stride(), log_probs, *log_probs.stride(), iqn, iqn.stride(0), v, v.stride(0),
            v_target, v_target.stride(0), weight, weight.stride(0), priorities, partial_sums,
            batch, branches, atoms, **_scalars(batch, branches, expectile), **_blocks(branches, atoms),
            num_warps=FORWARD_WARPS,
        )
    return priorities, partial_sums


def fused_weighted_losses_grads(grad_loss: torch.Tensor, c51_target: torch.Tensor, v: torch.Tensor,
                                v_target: torch.Tensor, weight: torch.Tensor, loss_weights: torch.Tensor,
                                expectile: float, iqn_dtype: torch.dtype
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_loss []`` -> grad_log_probs ``[B, br, A]`` fp32, grad_iqn ``[B]`` in ``iqn_dtype``, grad_v ``[B]`` in
    v's dtype, every element written by the kernel."""
    batch, branches, atoms = c51_target.shape
    device = c51_target.device
    grad_log_probs = torch.empty(batch, branches, atoms, device=device, dtype=torch.float32)  # [B, br, A]
    grad_iqn = torch.empty(batch, device=device, dtype=iqn_dtype)  # [B]
    grad_v = torch.empty(batch, device=device, dtype=v.dtype)  # [B]
    if batch == 0:
        return grad_log_probs, grad_iqn, grad_v
    with on_device(c51_target):
        _backward_kernel[(programs(batch, branches, atoms),)](
            grad_loss, loss_weights, loss_weights.stride(0), c51_target, *c51_target.stride(), v, v.stride(0),
            v_target, v_target.stride(0), weight, weight.stride(0), grad_log_probs, grad_iqn, grad_v,
            batch, branches, atoms, **_scalars(batch, branches, expectile), **_blocks(branches, atoms),
            num_warps=BACKWARD_WARPS,
        )
    return grad_log_probs, grad_iqn, grad_v


def _scalars(batch: int, branches: int, expectile: float) -> dict:
    """The torch path's scalars, which Triton passes as fp32 as ATen rounds a Python scalar to fp32 arithmetic."""
    expectile = float(expectile)
    return dict(inv_batch=1.0 / batch, neg_inv_branches=-1.0 / branches, below=1.0 - expectile, above=expectile)


def _blocks(branches: int, atoms: int) -> dict:
    """The tile's constexprs: BLOCK_B samples x BLOCK_BR branches x BLOCK_A atoms (powers of two)."""
    return dict(BLOCK_B=sample_block(branches, atoms), BLOCK_BR=next_power_of_2(branches),
                BLOCK_A=next_power_of_2(atoms))


@triton.jit
def _tile(batch, branches, atoms, BLOCK_B: tl.constexpr, BLOCK_BR: tl.constexpr, BLOCK_A: tl.constexpr):
    """The program's samples ``[M]`` (int64), branches ``[R]``, atoms ``[A]``, which samples exist ``[M]`` and which
    (sample, branch, atom) triples do ``[M, R, A]``."""
    sample = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    branch = tl.arange(0, BLOCK_BR)
    atom = tl.arange(0, BLOCK_A)
    sample_ok = sample < batch
    valid = sample_ok[:, None, None] & (branch < branches)[None, :, None] & (atom < atoms)[None, None, :]
    return sample, branch, atom, sample_ok, valid


@triton.jit
def _expectile_slope(v_ptr, stride_v, v_target_ptr, stride_vt, sample, sample_ok, below, above):
    """``diff = v_target - v`` and ``slope = where(diff < 0, 1 - expectile, expectile) * diff`` ``[M]``, fp32."""
    v = tl.load(v_ptr + sample * stride_v, mask=sample_ok, other=0.0).to(tl.float32)
    v_target = tl.load(v_target_ptr + sample * stride_vt, mask=sample_ok, other=0.0).to(tl.float32)
    diff = v_target - v
    return diff, tl.where(diff < 0, below, above) * diff


@triton.jit
def _forward_kernel(
    target_ptr, stride_tb, stride_tr, stride_ta, log_probs_ptr, stride_lb, stride_lr, stride_la,
    iqn_ptr, stride_iqn, v_ptr, stride_v, v_target_ptr, stride_vt, weight_ptr, stride_w,
    priorities_ptr, partial_ptr, batch, branches, atoms, inv_batch, neg_inv_branches, below, above,
    BLOCK_B: tl.constexpr, BLOCK_BR: tl.constexpr, BLOCK_A: tl.constexpr,
):
    sample, branch, atom, sample_ok, valid = _tile(batch, branches, atoms, BLOCK_B, BLOCK_BR, BLOCK_A)
    target = tl.load(target_ptr + sample[:, None, None] * stride_tb + branch[None, :, None] * stride_tr
                     + atom[None, None, :] * stride_ta, mask=valid, other=0.0).to(tl.float32)  # [M, R, A]
    log_probs = tl.load(log_probs_ptr + sample[:, None, None] * stride_lb + branch[None, :, None] * stride_lr
                        + atom[None, None, :] * stride_la, mask=valid, other=0.0).to(tl.float32)  # [M, R, A]
    priorities = tl.sum(tl.sum(target * log_probs, axis=2), axis=1) * neg_inv_branches  # [M]
    tl.store(priorities_ptr + sample, priorities, mask=sample_ok)
    iqn = tl.load(iqn_ptr + sample * stride_iqn, mask=sample_ok, other=0.0).to(tl.float32)  # [M]
    diff, slope = _expectile_slope(v_ptr, stride_v, v_target_ptr, stride_vt, sample, sample_ok, below, above)
    scaled = tl.load(weight_ptr + sample * stride_w, mask=sample_ok, other=0.0).to(tl.float32) * inv_batch  # [M]
    first = tl.arange(0, BLOCK_B) == 0  # [M]: the row that holds the program's sums, zeros in the others
    partial = partial_ptr + sample * 3  # [M]: the samples' rows of [B, 3]
    zero = tl.zeros([BLOCK_B], dtype=tl.float32)
    tl.store(partial, tl.where(first, tl.sum(scaled * priorities, axis=0), zero), mask=sample_ok)  # C51 (0 past B)
    tl.store(partial + 1, tl.where(first, tl.sum(scaled * iqn, axis=0), zero), mask=sample_ok)  # IQN
    tl.store(partial + 2, tl.where(first, tl.sum(scaled * (slope * diff), axis=0), zero), mask=sample_ok)  # IQL


@triton.jit
def _backward_kernel(
    grad_loss_ptr, loss_weights_ptr, stride_lw, target_ptr, stride_tb, stride_tr, stride_ta,
    v_ptr, stride_v, v_target_ptr, stride_vt, weight_ptr, stride_w, grad_log_probs_ptr, grad_iqn_ptr, grad_v_ptr,
    batch, branches, atoms, inv_batch, neg_inv_branches, below, above,
    BLOCK_B: tl.constexpr, BLOCK_BR: tl.constexpr, BLOCK_A: tl.constexpr,
):
    sample, branch, atom, sample_ok, valid = _tile(batch, branches, atoms, BLOCK_B, BLOCK_BR, BLOCK_A)
    grad_loss = tl.load(grad_loss_ptr).to(tl.float32)  # []: read on the device, never on the host
    w_iqn = tl.load(loss_weights_ptr + stride_lw).to(tl.float32)
    w_iql = tl.load(loss_weights_ptr + 2 * stride_lw).to(tl.float32)
    scaled = tl.load(weight_ptr + sample * stride_w, mask=sample_ok, other=0.0).to(tl.float32) * inv_batch  # [M]
    per_sample = scaled * grad_loss  # [M]: d loss / d (sample's weighted sum)
    target = tl.load(target_ptr + sample[:, None, None] * stride_tb + branch[None, :, None] * stride_tr
                     + atom[None, None, :] * stride_ta, mask=valid, other=0.0).to(tl.float32)  # [M, R, A]
    grad_log_probs = target * (per_sample * neg_inv_branches)[:, None, None]  # [M, R, A]
    tl.store(grad_log_probs_ptr + (sample[:, None, None] * branches + branch[None, :, None]) * atoms
             + atom[None, None, :], grad_log_probs, mask=valid)
    grad_iqn = per_sample * w_iqn  # [M]
    tl.store(grad_iqn_ptr + sample, grad_iqn.to(grad_iqn_ptr.dtype.element_ty), mask=sample_ok)
    _, slope = _expectile_slope(v_ptr, stride_v, v_target_ptr, stride_vt, sample, sample_ok, below, above)
    grad_v = per_sample * (w_iql * -2.0) * slope  # [M]: d iql / d v = -2 slope
    tl.store(grad_v_ptr + sample, grad_v.to(grad_v_ptr.dtype.element_ty), mask=sample_ok)
