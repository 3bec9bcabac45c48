"""Triton kernels of the C51 head's fold (``fitdqn::folded_output`` and its backward on CUDA): each kernel writes
every element of what it owns, zeros included, so no output is zero-filled first.

Tiny and launch-bound (the folded weight is ``br n atoms x (1 + br) h`` numbers, 0.8 MB in fp32 at the default
(5, 5, 5) branches, 51 atoms, h = 128), so the kernels are built around few launches, not around bandwidth. Every
grid is 2-D: ``BLOCK_K`` atoms (rows) x ``BLOCK_H`` hidden columns a program, the columns the contiguous axis of
every tensor, so loads and stores are coalesced along rows. A program loops over the sub-actions (``tl.static_range``:
the branch sizes are compile-time constants of the head's static layout) and keeps the centring's sum in registers.

- ``_fold_kernel``, one launch per branch d, grid ``[ceil(atoms / BLOCK_K), ceil(h / BLOCK_H)]``: for its atoms
  and columns, sums ``A[a, k, c]`` over ``a < n_d`` in order, then writes row (d, a, k) of every column block
  (block 0 the value row, block 1 + d the centred advantage row, the rest zeros; padded sub-actions all zeros);
  the programs of column tile 0 write the bias rows; with ``PADDING`` (the last branch's launch) the programs of
  atom tile 0 write the padding rows' zeros too.
- ``_grad_kernel``, one launch per branch d, same grid: the centred gradient of branch d's own column block into
  the advantage layer's ``[w_d, h]`` gradient (and its bias), zeros in rows ``n_d atoms .. w_d``.
- ``_value_grad_kernel``, one launch, grid ``[ceil(v / BLOCK_K), ceil(h / BLOCK_H)]``: the value layer's gradient,
  block 0's rows summed over the valid (d, a) pairs in order (``VALID``, a bit mask known at compile time), zeros in
  rows ``atoms .. v``.

Everything is fp32 in registers; the centring divides with ``tl.math.div_rn`` (correctly rounded, as torch's
``addcdiv``; Triton's ``/`` is approximate on NVIDIA GPUs), ``x + sum / (-n_d)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fitdqn.ops.fold import used_rows, valid_mask
from fitdqn.ops.kernels import on_device

# Launch shapes, not tuned (no GPU timing yet): a 4 x 64 tile, 2 warps (4 fp32 numbers, 16 bytes, a thread a row);
# at 51 atoms and h = 128 a launch is 13 x 2 programs.
BLOCK_K, MAX_BLOCK_H, WARPS = 4, 64, 2


def _block_h(hidden: int) -> int:
    return min(MAX_BLOCK_H, triton.next_power_of_2(hidden))


def _pad_block(rows: int) -> int:
    return triton.next_power_of_2(max(rows, 1))


def fused_fold(value_weight: torch.Tensor, value_bias: torch.Tensor, adv_weights: Sequence[torch.Tensor],
               adv_biases: Sequence[torch.Tensor], branches: Sequence[int], atoms: int, padding_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight ``[rows, (1 + br) h]``, bias ``[rows]`` in value_weight's dtype (``fitdqn.ops.fold``): ``br``
    launches, every element written by one of them."""
    br, n, hidden, used = len(branches), max(branches), value_weight.shape[1], used_rows(branches, atoms)
    weight = torch.empty(used + padding_rows, (1 + br) * hidden, device=value_weight.device,
                         dtype=value_weight.dtype)  # [rows, (1 + br) h]
    bias = torch.empty(used + padding_rows, device=value_weight.device, dtype=value_weight.dtype)  # [rows]
    block_h = _block_h(hidden)
    grid = (triton.cdiv(atoms, BLOCK_K), triton.cdiv(hidden, block_h))
    with on_device(value_weight):
        for d, size in enumerate(branches):
            padding = padding_rows if d == br - 1 else 0  # the last launch writes the padding rows
            _fold_kernel[grid](
                value_weight.contiguous(), value_bias.contiguous(), adv_weights[d].contiguous(),
                adv_biases[d].contiguous(), weight, bias, atoms, hidden, d * n * atoms, used,
                BRANCH=d, BRANCHES=br, N_D=size, MAX_N=n, PADDING=padding, PAD_BLOCK=_pad_block(padding),
                BLOCK_K=BLOCK_K, BLOCK_H=block_h, num_warps=WARPS,
            )
    return weight, bias


def fused_fold_grads(grad_weight: torch.Tensor, grad_bias: torch.Tensor, branches: Sequence[int], atoms: int,
                     value_rows: int, widths: Sequence[int]) -> list[torch.Tensor]:
    """[value weight ``[v, h]``, value bias ``[v]``, advantage weights ``[w_d, h]``.., biases ``[w_d]``..]
    gradients in grad_weight's dtype: ``br + 1`` launches, every element written by one of them."""
    br, n = len(branches), max(branches)
    hidden = grad_weight.shape[1] // (1 + br)
    grad_weight, grad_bias = grad_weight.contiguous(), grad_bias.contiguous()
    new = dict(device=grad_weight.device, dtype=grad_weight.dtype)
    value_weight, value_bias = torch.empty(value_rows, hidden, **new), torch.empty(value_rows, **new)  # [v, h], [v]
    adv_weights = [torch.empty(w, hidden, **new) for w in widths]  # [w_d, h] each
    adv_biases = [torch.empty(w, **new) for w in widths]  # [w_d] each
    block_h = _block_h(hidden)
    with on_device(grad_weight):
        for d, size in enumerate(branches):
            padding = widths[d] - size * atoms
            _grad_kernel[(triton.cdiv(atoms, BLOCK_K), triton.cdiv(hidden, block_h))](
                grad_weight, grad_bias, adv_weights[d], adv_biases[d], atoms, hidden, d * n * atoms,
                (1 + d) * hidden, BRANCHES=br, N_D=size, PADDING=padding, PAD_BLOCK=_pad_block(padding),
                BLOCK_K=BLOCK_K, BLOCK_H=block_h, num_warps=WARPS,
            )
        _value_grad_kernel[(triton.cdiv(value_rows, BLOCK_K), triton.cdiv(hidden, block_h))](
            grad_weight, grad_bias, value_weight, value_bias, atoms, hidden, value_rows,
            BRANCHES=br, MAX_N=n, VALID=valid_mask(branches), BLOCK_K=BLOCK_K, BLOCK_H=block_h, num_warps=WARPS,
        )
    return [value_weight, value_bias, *adv_weights, *adv_biases]


@triton.jit
def _tile(rows, hidden, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """The program's atoms ``[K]`` (int64), columns ``[H]``, and which exist ``[K]``, ``[H]``."""
    k = (tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    return k, c, k < rows, c < hidden


@triton.jit
def _fold_kernel(
    value_weight_ptr, value_bias_ptr, adv_weight_ptr, adv_bias_ptr, weight_ptr, bias_ptr,
    atoms, hidden, first_row, used,
    BRANCH: tl.constexpr, BRANCHES: tl.constexpr, N_D: tl.constexpr, MAX_N: tl.constexpr,
    PADDING: tl.constexpr, PAD_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    k, c, k_ok, c_ok = _tile(atoms, hidden, BLOCK_K, BLOCK_H)
    mask = k_ok[:, None] & c_ok[None, :]  # [K, H]
    slab = k[:, None] * hidden + c[None, :]  # [K, H]: (k, c) of an [atoms, h] slab
    width = (1 + BRANCHES) * hidden
    out_ty = weight_ptr.dtype.element_ty
    value = tl.load(value_weight_ptr + slab, mask=mask, other=0.0).to(out_ty)  # [K, H]
    zeros = tl.zeros([BLOCK_K, BLOCK_H], tl.float32).to(out_ty)
    total = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
    for a in tl.static_range(N_D):  # in order, as the sum over sub-actions
        total += tl.load(adv_weight_ptr + a * atoms * hidden + slab, mask=mask, other=0.0).to(tl.float32)
    shift = tl.math.div_rn(total, tl.full([BLOCK_K, BLOCK_H], -N_D, tl.float32))  # [K, H]: -mean
    for a in tl.static_range(MAX_N):
        out = weight_ptr + (first_row + a * atoms + k)[:, None] * width + c[None, :]  # [K, H]: row (d, a, k)
        for block in tl.static_range(1 + BRANCHES):
            if a < N_D and block == 0:
                tl.store(out, value, mask=mask)
            elif a < N_D and block == 1 + BRANCH:
                own = tl.load(adv_weight_ptr + a * atoms * hidden + slab, mask=mask, other=0.0).to(tl.float32)
                tl.store(out + block * hidden, (own + shift).to(out_ty), mask=mask)
            else:
                tl.store(out + block * hidden, zeros, mask=mask)
    if tl.program_id(1) == 0:  # the bias rows: one column tile's programs
        value_bias = tl.load(value_bias_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # [K]
        bias_total = tl.zeros([BLOCK_K], tl.float32)
        for a in tl.static_range(N_D):
            bias_total += tl.load(adv_bias_ptr + a * atoms + k, mask=k_ok, other=0.0).to(tl.float32)
        bias_shift = tl.math.div_rn(bias_total, tl.full([BLOCK_K], -N_D, tl.float32))  # [K]
        for a in tl.static_range(MAX_N):
            if a < N_D:
                own_bias = tl.load(adv_bias_ptr + a * atoms + k, mask=k_ok, other=0.0).to(tl.float32)
                row_bias = (own_bias + bias_shift) + value_bias  # addcdiv, then addcmul_: two roundings
            else:
                row_bias = tl.zeros([BLOCK_K], tl.float32)
            tl.store(bias_ptr + first_row + a * atoms + k, row_bias.to(out_ty), mask=k_ok)
    if PADDING > 0:
        if tl.program_id(0) == 0:  # the padding rows: one atom tile's programs
            pad = tl.arange(0, PAD_BLOCK)
            pad_ok = pad < PADDING
            pad_rows = (used + pad).to(tl.int64)  # [P]
            pad_zeros = tl.zeros([PAD_BLOCK, BLOCK_H], tl.float32).to(out_ty)
            for block in tl.static_range(1 + BRANCHES):
                tl.store(weight_ptr + pad_rows[:, None] * width + block * hidden + c[None, :], pad_zeros,
                         mask=pad_ok[:, None] & c_ok[None, :])
            if tl.program_id(1) == 0:
                tl.store(bias_ptr + pad_rows, tl.zeros([PAD_BLOCK], tl.float32).to(out_ty), mask=pad_ok)


@triton.jit
def _grad_kernel(
    grad_weight_ptr, grad_bias_ptr, adv_weight_ptr, adv_bias_ptr, atoms, hidden, first_row, own_column,
    BRANCHES: tl.constexpr, N_D: tl.constexpr, PADDING: tl.constexpr, PAD_BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    k, c, k_ok, c_ok = _tile(atoms, hidden, BLOCK_K, BLOCK_H)
    mask = k_ok[:, None] & c_ok[None, :]  # [K, H]
    width = (1 + BRANCHES) * hidden
    out_ty = adv_weight_ptr.dtype.element_ty
    source = grad_weight_ptr + (first_row + k)[:, None] * width + own_column + c[None, :]  # [K, H]: sub-action 0
    target = adv_weight_ptr + k[:, None] * hidden + c[None, :]  # [K, H]: row k of [w_d, h]
    total = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
    for a in tl.static_range(N_D):
        total += tl.load(source + a * atoms * width, mask=mask, other=0.0).to(tl.float32)
    shift = tl.math.div_rn(total, tl.full([BLOCK_K, BLOCK_H], -N_D, tl.float32))  # [K, H]
    for a in tl.static_range(N_D):
        grad = tl.load(source + a * atoms * width, mask=mask, other=0.0).to(tl.float32) + shift
        tl.store(target + a * atoms * hidden, grad.to(out_ty), mask=mask)
    if tl.program_id(1) == 0:
        bias_total = tl.zeros([BLOCK_K], tl.float32)
        for a in tl.static_range(N_D):
            bias_total += tl.load(grad_bias_ptr + first_row + a * atoms + k, mask=k_ok, other=0.0).to(tl.float32)
        bias_shift = tl.math.div_rn(bias_total, tl.full([BLOCK_K], -N_D, tl.float32))  # [K]
        for a in tl.static_range(N_D):
            grad_bias = tl.load(grad_bias_ptr + first_row + a * atoms + k, mask=k_ok, other=0.0).to(tl.float32)
            tl.store(adv_bias_ptr + a * atoms + k, (grad_bias + bias_shift).to(out_ty), mask=k_ok)
    if PADDING > 0:
        if tl.program_id(0) == 0:  # rows n_d atoms .. w_d of the layer: zeros
            pad = tl.arange(0, PAD_BLOCK)
            pad_ok = pad < PADDING
            pad_rows = (N_D * atoms + pad).to(tl.int64)  # [P]
            tl.store(adv_weight_ptr + pad_rows[:, None] * hidden + c[None, :],
                     tl.zeros([PAD_BLOCK, BLOCK_H], tl.float32).to(out_ty), mask=pad_ok[:, None] & c_ok[None, :])
            if tl.program_id(1) == 0:
                tl.store(adv_bias_ptr + pad_rows, tl.zeros([PAD_BLOCK], tl.float32).to(out_ty), mask=pad_ok)


@triton.jit
def _value_grad_kernel(
    grad_weight_ptr, grad_bias_ptr, value_weight_ptr, value_bias_ptr, atoms, hidden, value_rows,
    BRANCHES: tl.constexpr, MAX_N: tl.constexpr, VALID: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    k, c, k_ok, c_ok = _tile(value_rows, hidden, BLOCK_K, BLOCK_H)  # rows atoms .. v: the padding, zeros
    used = k < atoms  # [K]
    load_mask = used[:, None] & c_ok[None, :]  # [K, H]
    width = (1 + BRANCHES) * hidden
    out_ty = value_weight_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
    bias_total = tl.zeros([BLOCK_K], tl.float32)
    for pair in tl.static_range(BRANCHES * MAX_N):  # (d, a) in order; padded sub-actions skipped
        if (VALID >> pair) & 1:
            total += tl.load(grad_weight_ptr + (pair * atoms + k)[:, None] * width + c[None, :], mask=load_mask,
                             other=0.0).to(tl.float32)
            bias_total += tl.load(grad_bias_ptr + pair * atoms + k, mask=used, other=0.0).to(tl.float32)
    tl.store(value_weight_ptr + k[:, None] * hidden + c[None, :], total.to(out_ty), mask=k_ok[:, None] & c_ok[None, :])
    if tl.program_id(1) == 0:
        tl.store(value_bias_ptr + k, bias_total.to(out_ty), mask=k_ok)
