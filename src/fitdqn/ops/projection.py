"""C51's projection: spread each atom's mass onto its two neighbouring atoms. The dense PyTorch maths
(:func:`project_dense`, the reference and the ``net.kernels = 'torch'`` path) and the same maths as one PyTorch
operator, ``fitdqn::categorical_projection`` (a Triton kernel on CUDA: :mod:`fitdqn.ops.projection_triton`).

``project_positions(probs [R, A], positions [R, A]) -> [R, A]`` fp32, with
``out[r, i] = sum_j probs[r, j] * max(0, 1 - |positions[r, j] - i|)`` and ``positions`` the fractional index in
[0, A - 1] where atom j lands (see :func:`fitdqn.learn.losses.categorical_projection`, which computes them and
calls this with ``fused=True``). Kernels: on CUDA the Triton kernel (the hat in registers; nothing is written but
the result); everywhere else the dense hat (:func:`project_dense`).

Why an operator: the dense form materialises an fp32 hat of ``A x A`` per sample (85 MB at batch 8192 and 51
atoms; three times that when the rewards differ by branch) and passes over it five times (four to build it, one
to multiply); the kernel writes none of it. And the memory planner traces the update on fake tensors: the fake
kernel allocates exactly the result, so a CUDA target's trace sees the GPU's bytes, not the dense hat's. No
autograd: the projection is a target, computed under ``torch.no_grad``.
"""

from __future__ import annotations

import torch

from fitdqn.ops.kernels import triton_module


def project_dense(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``sum_j probs_j max(0, 1 - |positions_j - i|)`` as products with dense hats: ``probs [B, ..., A]``,
    ``positions`` broadcastable to it -> ``[B, ..., A]`` fp32.

    Where the positions are the same for all branches of a sample, one hat ``[B, A, A]`` serves them all in a
    batched matmul ``[B, br, A] @ [B, A, A]`` (broadcasting a shared hat through ``matmul`` would copy it once
    per branch); else one hat per distribution, ``[B, ..., 1, A] @ [B, ..., A, A]``.
    """
    with torch.autocast(probs.device.type, enabled=False):  # a matmul: autocast would run it in bf16
        probs = probs.to(torch.float32)
        batch, branches, atoms = probs.shape[0], probs.shape[1:-1].numel(), probs.shape[-1]
        if positions.shape[1:-1].numel() == 1:  # shared by the branches
            hat = _hat(positions.reshape(-1, atoms).expand(batch, atoms))  # [B, A (j), A (i)]
            return torch.bmm(probs.reshape(batch, branches, atoms), hat).view(probs.shape)
        hat = _hat(positions.expand(probs.shape))  # [B, ..., A (j), A (i)]
        return (probs.unsqueeze(-2) @ hat).squeeze(-2)


def _hat(positions: torch.Tensor) -> torch.Tensor:
    """``positions [..., A]`` -> ``[..., A (j), A (i)]``: ``max(0, 1 - |positions_j - i|)``, four passes."""
    targets = torch.arange(positions.shape[-1], device=positions.device, dtype=positions.dtype)  # [A] (i)
    return (1.0 - (positions.unsqueeze(-1) - targets).abs_()).clamp_(min=0.0)


@torch.library.custom_op("fitdqn::categorical_projection", mutates_args=())
def project_positions(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[R, A]`` fp32: each row's mass moved to its atoms' landing positions; the default (CPU) kernel is the
    dense hat."""
    return project_dense(probs, positions)


@project_positions.register_kernel("cuda")
def _project_positions_cuda(probs, positions):
    return triton_module("fitdqn.ops.projection_triton").fused_projection(probs, positions)


@project_positions.register_fake
def _project_positions_fake(probs, positions):
    return probs.new_empty(probs.shape, dtype=torch.float32)
