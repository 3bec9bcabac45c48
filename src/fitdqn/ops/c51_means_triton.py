"""Triton kernel of C51's expected values (``fitdqn::c51_means`` on CUDA): softmax, product with the support and
sum over the atoms in one pass, in registers.

For each distribution the kernel loads its A logits (any floating dtype, read as fp32; the atoms padded to a power
of two of at least 16, the padding -inf, so it weighs nothing) and the support, and writes one fp32 number:

    m = max_j x_j      e_j = exp(x_j - m)      mean = sum_j e_j z_j / sum_j e_j

Traffic: the logits once and 4 bytes a distribution (12.5 MB at batch 8192 x 15 sub-actions x 51 atoms in bf16),
where the torch form's softmax, product and sum move about 110 MB through three launches
(:mod:`fitdqn.ops.c51_means`).

Launch shape: one program takes ``ROWS`` consecutive distributions, a ``[ROWS, BLOCK]`` tile (rows past the end
masked), with ``WARPS`` warps; grid ``[ceil(R / ROWS)]``. Not tuned on a GPU yet (``benchmarks/tune_kernels.py``
does not time it): 16 rows of 64 atoms a program, 4 warps, is 1,024 numbers a program, as the projection's tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.c51_means import check_shapes
from fitdqn.ops.kernels import on_device

ROWS = 16
WARPS = 4


def fused_means(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """``logits [..., A]``, ``support [A]`` -> ``[...]`` fp32."""
    check_shapes(logits, support)
    atoms = logits.shape[-1]
    rows = logits.numel() // atoms if atoms else 0
    flat = logits.contiguous()
    out = torch.empty(logits.shape[:-1], device=logits.device, dtype=torch.float32)
    if rows and atoms:
        with on_device(flat):
            _means_kernel[(triton.cdiv(rows, ROWS),)](flat, support, out, rows, atoms, support.stride(0), ROWS=ROWS,
                                                      BLOCK=max(triton.next_power_of_2(atoms), 16),
                                                      num_warps=WARPS)
    return out


@triton.jit
def _means_kernel(logits_ptr, support_ptr, out_ptr, R, A, support_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] distributions
    j = tl.arange(0, BLOCK)  # [BLOCK] atoms
    live, atom = r < R, j < A
    x = tl.load(logits_ptr + r[:, None] * A + j[None, :], mask=live[:, None] & atom[None, :],
                other=float("-inf")).to(tl.float32)  # [ROWS, BLOCK]: padding and dead rows -inf
    x = tl.where(live[:, None], x, 0.0)  # a dead row all 0 (not all -inf: no NaN), stored nowhere
    z = tl.load(support_ptr + j * support_stride, mask=atom, other=0.0).to(tl.float32)  # [BLOCK]
    e = tl.exp(x - tl.max(x, axis=1)[:, None])  # [ROWS, BLOCK]: padding exp(-inf) = 0
    mean = tl.sum(e * z[None, :], axis=1) / tl.sum(e, axis=1)  # [ROWS]
    tl.store(out_ptr + r, mean, mask=live)
