"""C51's projection: spread the mass of each shifted atom ``r + discount z_j`` onto its two neighbouring atoms, as
one PyTorch operator, ``fitdqn::categorical_projection``: on the CPU the dense PyTorch maths (:func:`atom_positions`
and :func:`project_dense`), on CUDA a Triton kernel (:mod:`fitdqn.ops.projection_triton`).

``project_returns(probs [R, A], rewards, discounts, support [A]) -> [R, A]`` fp32, with ``rewards`` and
``discounts`` each ``[B]`` (one per sample) or ``[B, br]`` (one per distribution), ``R = B * br``, row ``r`` the
distribution of sample ``r // br`` and branch ``r % br``:

    x_j = clamp((reward - (1 - discount) v_min) / dz + discount j, 0, A - 1)    (:func:`atom_positions`)
    out[r, i] = sum_j probs[r, j] * max(0, 1 - |x_j - i|)

where ``v_min = support[0]``, ``dz = (support[A - 1] - v_min) / (A - 1)``, all in fp32 (``probs``, rewards,
discounts and support of any floating dtype are read as fp32). A ``[B, br]`` argument may be any strided view (an
expanded ``[B, 1]`` has stride 0 along br): nothing is copied. :func:`fitdqn.learn.losses.categorical_projection`
calls it. Kernels: on CUDA the Triton kernel, which reads the support's two ends and each
row's reward and discount itself, forms the positions and the hat in registers and writes only the result, so the
whole projection is one launch; everywhere else the torch maths (:func:`atom_positions`, :func:`project_dense`).

Why an operator: the dense form materialises an fp32 hat of ``A x A`` per sample (85 MB at batch 8192 and 51
atoms; three times that when the rewards differ by branch) and passes over it five times (four to build it, one
to multiply); the positions alone are ten small kernels (on ``[B, ...]`` and ``[B, br, A]``) and an ``[R, A]``
tensor. The kernel writes none of it. And the memory planner traces the update on fake tensors: the fake kernel
allocates exactly the result, so a CUDA target's trace sees the GPU's bytes, not the dense hat's. No autograd: the
projection is a target, computed under ``torch.no_grad``.

Exactness: the Triton kernel computes the positions in the order of :func:`atom_positions`' torch ops, each
rounded to fp32 once (IEEE division; the multiply-add ``start + discount j`` one fused multiply-add, as ATen's
AVX512 CPU ``addcmul`` computes it), so it rounds as the CPU torch path does there. Elsewhere the two may differ
by fp32 rounding: a CPU kernel of ``addcmul`` without FMA, or ATen's CUDA ops (they divide by the CPU scalar
``A - 1`` through its reciprocal, and round ``discount j`` before the add), are about one ulp of a position apart,
near atom A - 1 3.8e-6 of an atom, that much mass moved between two neighbours. The sums over j differ in order
only.
"""

from __future__ import annotations

import torch

from fitdqn.ops.kernels import triton_available, triton_module


def atom_positions(dims: int, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
                   ) -> torch.Tensor:
    """Where each shifted atom lands, in atoms: ``x_j = (clamp(r + discount z_j, v_min, v_max) - v_min) / dz``.

    ``[B, ..., A]`` fp32 with ``dims`` dims, 1 along the dims where rewards and discounts do not vary (small:
    ``[B, 1, A]`` for rewards ``[B]``). Written ``(r - (1 - discount) v_min) / dz + discount j``, the same
    maths with j an exact integer, and clamped to [0, A - 1] so that the ends are exact: an atom clamped to
    v_max sits exactly on atom A - 1 (no mass leaks past the last atom, none onto A - 2).
    """
    atoms = support.shape[0]
    rewards = rewards.to(torch.float32).reshape(rewards.shape + (1,) * (dims - rewards.dim()))
    discounts = discounts.to(torch.float32).reshape(discounts.shape + (1,) * (dims - discounts.dim()))
    v_min, v_max = support[0].to(torch.float32), support[-1].to(torch.float32)
    dz = (v_max - v_min) / (atoms - 1)
    start = (rewards - (1.0 - discounts) * v_min) / dz  # [B, ..., 1]: where atom 0 lands
    steps = torch.arange(atoms, device=support.device, dtype=torch.float32)  # [A] (j)
    return torch.addcmul(start, discounts, steps).clamp_(0.0, atoms - 1.0)  # [B, ..., A]


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


def branches(probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor) -> int:
    """br, the distributions per sample, from :func:`project_returns`' arguments (their shapes, checked)."""
    widths = {values.shape[1] for values in (rewards, discounts) if values.dim() == 2}
    if (probs.dim() == 2 and rewards.dim() in (1, 2) and discounts.dim() in (1, 2) and len(widths) <= 1
            and discounts.shape[0] == rewards.shape[0] and support.shape == probs.shape[1:]):
        batch = rewards.shape[0]
        width = widths.pop() if widths else (probs.shape[0] // batch if batch else 1)
        if probs.shape[0] == batch * width:
            return width
    raise ValueError(f"categorical_projection takes probs [B * br, A], rewards and discounts [B] or [B, br] and "
                     f"support [A]; got probs {tuple(probs.shape)}, rewards {tuple(rewards.shape)}, discounts "
                     f"{tuple(discounts.shape)}, support {tuple(support.shape)}")


@torch.library.custom_op("fitdqn::categorical_projection", mutates_args=())
def project_returns(probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
                    ) -> torch.Tensor:
    """``[R, A]`` fp32: each row's mass moved to where its atoms land after ``r + discount z``; the default (CPU)
    kernel is the torch maths, :func:`projection_maths`."""
    return projection_maths(probs, rewards, discounts, support)


def projection_maths(probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
                     ) -> torch.Tensor:
    """The CPU kernel: :func:`atom_positions` and the dense hat, ``[R, A]`` fp32."""
    width = branches(probs, rewards, discounts, support)
    distributions = probs.reshape(rewards.shape[0], width, probs.shape[1])  # [B, br, A]
    positions = atom_positions(3, rewards, discounts, support)  # [B, br or 1, A]
    return project_dense(distributions, positions).view(probs.shape)


@project_returns.register_kernel("cuda")
def _project_returns_cuda(probs, rewards, discounts, support):
    if not triton_available():
        return projection_maths(probs, rewards, discounts, support)
    return triton_module("fitdqn.ops.projection_triton").fused_projection(probs, rewards, discounts, support)


@project_returns.register_fake
def _project_returns_fake(probs, rewards, discounts, support):
    branches(probs, rewards, discounts, support)
    return probs.new_empty(probs.shape, dtype=torch.float32)
