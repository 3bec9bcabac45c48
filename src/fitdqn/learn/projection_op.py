"""C51's projection as one PyTorch operator, ``fitdqn::categorical_projection``: spread each atom's mass onto its
two neighbouring atoms.

``project_positions(probs [R, A], positions [R, A]) -> [R, A]`` fp32, with
``out[r, i] = sum_j probs[r, j] * max(0, 1 - |positions[r, j] - i|)`` and ``positions`` the fractional index in
[0, A - 1] where atom j lands (see :func:`fitdqn.learn.losses.categorical_projection`, which computes them and
calls this with ``fused=True``). Kernels: on CUDA the Triton kernel of :mod:`fitdqn.learn.projection_triton`
(the hat in registers; nothing is written but the result); everywhere else the dense hat
(:func:`fitdqn.learn.losses._project_dense`).

Why an operator: the dense form materialises an fp32 hat of ``A x A`` per sample (85 MB at batch 8192 and 51
atoms; three times that when the rewards differ by branch) and passes over it five times (four to build it, one
to multiply); the kernel writes none of it. And the memory planner traces the update on fake tensors: the fake
kernel allocates exactly the result, so a CUDA target's trace sees the GPU's bytes, not the dense hat's. No
autograd: the projection is a target, computed under ``torch.no_grad``.
"""

from __future__ import annotations

import torch

from fitdqn.nets.kernels import triton_module


@torch.library.custom_op("fitdqn::categorical_projection", mutates_args=())
def project_positions(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[R, A]`` fp32: each row's mass moved to its atoms' landing positions; the default (CPU) kernel is the
    dense hat."""
    from fitdqn.learn.losses import _project_dense

    return _project_dense(probs, positions)


@project_positions.register_kernel("cuda")
def _project_positions_cuda(probs, positions):
    return triton_module("fitdqn.learn.projection_triton").fused_projection(probs, positions)


@project_positions.register_fake
def _project_positions_fake(probs, positions):
    return probs.new_empty(probs.shape, dtype=torch.float32)
