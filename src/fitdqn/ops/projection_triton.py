"""Triton kernel of C51's projection (``fitdqn::categorical_projection`` on CUDA): the dense hat, in registers.

The torch form of :func:`fitdqn.ops.projection.project_dense` writes an ``A x A`` fp32 hat per sample to memory
(85 MB at batch 8192 and 51 atoms), passes over it four times to build it and once more in a batched
matrix-vector product that uses a fraction of the GPU. Here one program owns one distribution: it loads the A
probabilities and the A landing positions, forms the ``[A (i), A (j)]`` hat in registers (64 x 64 = 4096
numbers at A = 51) and reduces it at once:

    out_i = sum_j probs_j * max(0, 1 - |positions_j - i|)

in fp32, the hat's values bit for bit those of the torch form (only the order of the sum differs). Only the
result is written: 3 x 4 bytes of traffic per atom in all. Atoms are padded to a power of two (at least 16), the
padding masked (zero probability). Grid ``[R]``, ``WARPS`` warps per program (not tuned: the kernel moves
~15 MB at R = 24576, A = 51).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import on_device

WARPS = 2


def fused_projection(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``probs [R, A]``, ``positions [R, A]`` (fractional atom indices in [0, A - 1]) -> ``[R, A]`` fp32."""
    rows, atoms = probs.shape
    probs, positions = probs.contiguous(), positions.contiguous()
    out = torch.empty(probs.shape, device=probs.device, dtype=torch.float32)
    if rows and atoms:
        with on_device(probs):
            _projection_kernel[(rows,)](probs, positions, out, atoms, BLOCK=_block(atoms), num_warps=WARPS)
    return out


def _block(size: int) -> int:
    return max(triton.next_power_of_2(size), 16)


@triton.jit
def _projection_kernel(probs_ptr, positions_ptr, out_ptr, A, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)  # target atoms
    j = tl.arange(0, BLOCK)  # source atoms
    valid_j = j < A
    p = tl.load(probs_ptr + row * A + j, mask=valid_j, other=0.0).to(tl.float32)  # [BJ]: padding has no mass
    x = tl.load(positions_ptr + row * A + j, mask=valid_j, other=0.0).to(tl.float32)  # [BJ]
    hat = tl.maximum(1.0 - tl.abs(x[None, :] - i[:, None].to(tl.float32)), 0.0)  # [BI, BJ]
    tl.store(out_ptr + row * A + i, tl.sum(hat * p[None, :], axis=1), mask=i < A)
