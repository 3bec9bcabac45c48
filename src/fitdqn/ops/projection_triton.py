"""Triton kernel of C51's projection (``fitdqn::categorical_projection`` on CUDA): the dense hat, in registers.

The torch form of :func:`fitdqn.ops.projection.project_dense` writes an ``A x A`` fp32 hat per sample to memory
(85 MB at batch 8192 and 51 atoms), passes over it four times to build it and once more in a batched
matrix-vector product that uses a fraction of the GPU. Here the hat never leaves registers: for each
distribution the kernel loads the A probabilities and the A landing positions, forms the ``[A (i), A (j)]`` hat
(64 x 64 = 4096 numbers at A = 51) and reduces it at once:

    out_i = sum_j probs_j * max(0, 1 - |positions_j - i|)

in fp32, the hat's values bit for bit those of the torch form (only the order of the sum differs). Only the
result is written: 3 x 4 bytes of traffic per atom in all. Atoms are padded to a power of two (at least 16), the
padding masked (zero probability).

Launch shape: one program takes ``ROWS`` consecutive distributions, one ``[ROWS, A (i), A (j)]`` tile (rows past
the end masked), with ``WARPS`` warps; grid ``[ceil(R / ROWS)]``. The work is tiny (~15 MB moved and 0.1 GFLOP
at R = 24576, A = 51), so the time is the programs' latency: one distribution a program (24,576 programs of 2
warps) took 0.105 ms of the H200's update at batch 8192; with one warp a program 0.043 ms (more rows a program
were slower: 0.11-0.14 ms). ``benchmarks/tune_kernels.py --kernels projection`` times the shapes; the constants
below are its choice on the H200 (``benchmarks/results/h200_tune_projection_49ce89a.json``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import on_device

ROWS = 1
WARPS = 1


def fused_projection(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``probs [R, A]``, ``positions [R, A]`` (fractional atom indices in [0, A - 1]) -> ``[R, A]`` fp32."""
    rows, atoms = probs.shape
    probs, positions = probs.contiguous(), positions.contiguous()
    out = torch.empty(probs.shape, device=probs.device, dtype=torch.float32)
    if rows and atoms:
        with on_device(probs):
            _projection_kernel[(triton.cdiv(rows, ROWS),)](probs, positions, out, rows, atoms, ROWS=ROWS,
                                                           BLOCK=_block(atoms), num_warps=WARPS)
    return out


def _block(size: int) -> int:
    return max(triton.next_power_of_2(size), 16)


@triton.jit
def _projection_kernel(probs_ptr, positions_ptr, out_ptr, R, A, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] distributions
    i = tl.arange(0, BLOCK)  # target atoms
    j = tl.arange(0, BLOCK)  # source atoms
    at = r[:, None] * A + j[None, :]  # [ROWS, BJ]
    valid = (r[:, None] < R) & (j[None, :] < A)
    p = tl.load(probs_ptr + at, mask=valid, other=0.0).to(tl.float32)  # [ROWS, BJ]: padding has no mass
    x = tl.load(positions_ptr + at, mask=valid, other=0.0).to(tl.float32)  # [ROWS, BJ]
    hat = tl.maximum(1.0 - tl.abs(x[:, None, :] - i[None, :, None].to(tl.float32)), 0.0)  # [ROWS, BI, BJ]
    out = tl.sum(hat * p[:, None, :], axis=2)  # [ROWS, BI]
    tl.store(out_ptr + r[:, None] * A + i[None, :], out, mask=(r[:, None] < R) & (i[None, :] < A))
