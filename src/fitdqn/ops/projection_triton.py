"""Triton kernel of C51's projection (``fitdqn::categorical_projection`` on CUDA): the landing positions and the
dense hat, in registers, in one launch.

The torch form (:func:`fitdqn.ops.projection.atom_positions`, then :func:`fitdqn.ops.projection.project_dense`)
is ten small kernels for the positions and writes an ``A x A`` fp32 hat per sample to memory (85 MB at batch 8192
and 51 atoms), passes over it four times to build it and once more in a batched matrix-vector product that uses a
fraction of the GPU. Here nothing but the result leaves registers: for each distribution the kernel loads the A
probabilities, its sample's (or branch's) reward and discount and the support's two ends, forms the A landing
positions and the ``[A (i), A (j)]`` hat (64 x 64 = 4096 numbers at A = 51) and reduces it at once:

    dz = (v_max - v_min) / (A - 1)
    x_j = clamp((reward - (1 - discount) * v_min) / dz + discount * j, 0, A - 1)
    out_i = sum_j probs_j * max(0, 1 - |x_j - i|)

in fp32, in the order of the torch path's ops, each rounded once: IEEE division (``div_rn``; Triton's ``/`` is an
approximate division on NVIDIA GPUs), ``start + discount * j`` one fused multiply-add (``tl.fma``, as ATen's AVX512
CPU ``addcmul``), and no other contraction (compiled with ``enable_fp_fusion=False``, so ``reward - (1 - discount)
* v_min`` is a multiply and a subtraction, as in torch). The positions and the hat's values are meant to be those
of the CPU torch path (one fp32 ulp of a position where its rounding differs: :mod:`fitdqn.ops.projection`); only
the order of the sum differs. Under Triton's interpreter ``tl.fma`` is rounded twice (numpy): there the hats are
bit for bit those of the torch maths with an unfused multiply-add (``tests/ops/projection_interpreter.py``). Only
the result is written: 2 x 4 bytes of traffic per atom in all (with fp32 probabilities), and a reward and a
discount per row. Atoms are padded to a power of two (at least 16), the padding masked (zero probability).

Rewards and discounts are read through their strides: ``[B]`` (branch stride 0) or any ``[B, br]`` view; row ``r``
is sample ``r // br``, branch ``r % br``.

Launch shape: one program takes ``ROWS`` consecutive distributions, one ``[ROWS, A (i), A (j)]`` tile (rows past
the end masked), with ``WARPS`` warps; grid ``[ceil(R / ROWS)]``. The work is tiny (~15 MB moved and 0.1 GFLOP
at R = 24576, A = 51), so the time is the programs' latency: one distribution a program (24,576 programs of 2
warps) took 0.105 ms of the H200's update at batch 8192; with one warp a program 0.043 ms (more rows a program
were slower: 0.11-0.14 ms). ``benchmarks/tune_kernels.py --kernels projection`` times the shapes; the constants
below are its choice on the H200 (``benchmarks/results/h200_tune_projection_49ce89a.json``, measured when the
kernel read precomputed positions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import on_device
from fitdqn.ops.projection import branches

ROWS = 1
WARPS = 1


def fused_projection(probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
                     ) -> torch.Tensor:
    """``probs [R, A]``, ``rewards`` and ``discounts`` ``[B]`` or ``[B, br]`` (R = B * br, any strides),
    ``support [A]`` -> ``[R, A]`` fp32."""
    width = branches(probs, rewards, discounts, support)
    rows, atoms = probs.shape
    probs = probs.contiguous()
    out = torch.empty(probs.shape, device=probs.device, dtype=torch.float32)
    if rows and atoms:
        with on_device(probs):
            _projection_kernel[(triton.cdiv(rows, ROWS),)](
                probs, rewards, discounts, support, out, rows, atoms, width, *_strides(rewards),
                *_strides(discounts), support.stride(0), ROWS=ROWS, BLOCK=_block(atoms), num_warps=WARPS,
                enable_fp_fusion=False)
    return out


def _strides(values: torch.Tensor) -> tuple[int, int]:
    """(sample stride, branch stride) of ``[B]`` (branch stride 0: one value for all branches) or ``[B, br]``."""
    return (values.stride(0), values.stride(1) if values.dim() == 2 else 0)


def _block(size: int) -> int:
    return max(triton.next_power_of_2(size), 16)


@triton.jit
def _projection_kernel(probs_ptr, rewards_ptr, discounts_ptr, support_ptr, out_ptr, R, A, BR,
                       reward_sample_stride, reward_branch_stride, discount_sample_stride, discount_branch_stride,
                       support_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS] distributions
    live = r < R
    sample, branch = r // BR, r % BR  # [ROWS]
    reward = tl.load(rewards_ptr + sample * reward_sample_stride + branch * reward_branch_stride, mask=live,
                     other=0.0).to(tl.float32)  # [ROWS]
    discount = tl.load(discounts_ptr + sample * discount_sample_stride + branch * discount_branch_stride,
                       mask=live, other=0.0).to(tl.float32)  # [ROWS]
    last = (A - 1).to(tl.float32)
    v_min = tl.load(support_ptr).to(tl.float32)
    dz = tl.math.div_rn(tl.load(support_ptr + (A - 1) * support_stride).to(tl.float32) - v_min, last)
    start = tl.math.div_rn(reward - (1.0 - discount) * v_min, dz)  # [ROWS]: where atom 0 lands
    i = tl.arange(0, BLOCK)  # target atoms
    j = tl.arange(0, BLOCK)  # source atoms
    x = tl.fma(discount[:, None], j[None, :].to(tl.float32), start[:, None])  # [ROWS, BJ]: torch's addcmul
    x = tl.minimum(tl.maximum(x, 0.0), last)  # [ROWS, BJ]: landing positions in [0, A - 1]
    at = r[:, None] * A + j[None, :]  # [ROWS, BJ]
    p = tl.load(probs_ptr + at, mask=live[:, None] & (j[None, :] < A), other=0.0).to(tl.float32)  # padding: no mass
    hat = tl.maximum(1.0 - tl.abs(x[:, None, :] - i[None, :, None].to(tl.float32)), 0.0)  # [ROWS, BI, BJ]
    out = tl.sum(hat * p[:, None, :], axis=2)  # [ROWS, BI]
    tl.store(out_ptr + r[:, None] * A + i[None, :], out, mask=live[:, None] & (i[None, :] < A))
