"""The three losses as plain tensor functions: C51 projection, IQN quantile Huber, IQL expectile.

No host syncs and no Python branches on tensor values: each runs eagerly and inside a CUDA graph.
"""

from __future__ import annotations

import torch

from fitdqn.learn.projection_op import project_positions
from fitdqn.learn.quantile_huber_op import quantile_huber


@torch.no_grad()
def categorical_projection(
    next_probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor,
    fused: bool = False,
) -> torch.Tensor:
    """Project ``r + discount * z`` onto the support (C51's Phi operator); a target, so no gradient.

    ``next_probs [B, ..., A]`` (target distributions), ``rewards``/``discounts`` ``[B]`` or broadcastable to
    the leading dims of ``next_probs`` (``discount = gamma^n * (1 - done)``), ``support [A]`` evenly spaced.
    Returns ``[B, ..., A]`` fp32. Shifted atoms are clamped to [v_min, v_max]; the mass of an atom landing at
    fractional index ``x_j = (Tz_j - v_min) / dz`` goes to its two neighbours in proportion to closeness,
    written as the hat function ``max(0, 1 - |x_j - i|)`` (an atom landing exactly on i gives all its mass to i).
    The dense hat is deterministic on CUDA (no scatter-add atomics) and runs in fp32 even under autocast (which
    would round the target distribution to bf16, about 3 significant digits).

    ``fused``: run the operator ``fitdqn::categorical_projection`` (:mod:`fitdqn.learn.projection_op`): on CUDA
    a Triton kernel that forms the hat in registers and writes only the result; elsewhere the dense form. Else
    the dense form here, one ``[A, A]`` hat per sample shared by its branches when the rewards are.
    """
    atoms = next_probs.shape[-1]
    positions = _atom_positions(next_probs.dim(), rewards, discounts, support)  # [B, ..., A], 1 where shared
    if not fused:
        return _project_dense(next_probs, positions)
    flat_probs = next_probs.to(torch.float32).reshape(-1, atoms).contiguous()  # [R, A]
    flat_positions = positions.expand(next_probs.shape).reshape(-1, atoms).contiguous()  # [R, A]
    return project_positions(flat_probs, flat_positions).view(next_probs.shape)


def _atom_positions(dims: int, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
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


def _project_dense(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
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


def quantile_huber_loss(
    pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float, fused: bool = False
) -> torch.Tensor:
    """IQN's quantile Huber loss per sample: ``[B]``.

    ``pred [B, N, ...]`` (quantile values at levels ``taus [B, N]``), ``target [B, N', ...]`` (no gradient
    flows into it), same trailing dims (e.g. branches). With ``u_ij = target_j - pred_i``:
    ``rho_ij = |tau_i - 1{u_ij < 0}| * Huber_kappa(u_ij) / kappa``; the per-sample loss is
    ``sum_i mean_j rho_ij``, averaged over the trailing dims (Dopamine's reduction, per branch).

    Computed without the pairwise ``[B, N, N', ...]`` tensors: with the targets sorted and their prefix sums
    (count, sum, sum of squares, in float64), each ``sum_j rho_ij`` splits into four closed-form pieces by
    where ``u`` falls (below -kappa, in [-kappa, 0), in [0, kappa], above kappa), located by binary search.
    Memory and time go from O(N N') to O((N + N') log N') per sample. The gradient w.r.t. ``pred`` is
    computed in the same pass and is all that is saved for backward (``[B, N, ...]``).

    ``fused``: run the operator ``fitdqn::quantile_huber`` instead (:mod:`fitdqn.learn.quantile_huber_op`): on
    CUDA a Triton kernel that forms the pairs in registers (same maths, fp32, no temporaries); elsewhere this
    closed form. Same result and saved tensor either way.
    """
    if not kappa > 0:
        raise ValueError(f"kappa must be positive, got {kappa}")
    if pred.shape[0] != target.shape[0] or pred.shape[2:] != target.shape[2:]:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} do not match")
    if taus.shape != pred.shape[:2]:
        raise ValueError(f"taus {tuple(taus.shape)} must be [B, N] = {tuple(pred.shape[:2])}")
    return _QuantileHuber.apply(pred, target.detach(), taus.detach(), float(kappa), fused)


class _QuantileHuber(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pred, target, taus, kappa: float, fused: bool):
        if fused:
            loss, grad = quantile_huber(pred, target, taus, kappa)
        else:
            loss, grad = _quantile_huber_sorted(pred, target, taus, kappa)
        ctx.save_for_backward(grad)  # [B, N, ...]: the only saved tensor
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss [B]
        (grad,) = ctx.saved_tensors
        scale = grad_loss.reshape(grad_loss.shape + (1,) * (grad.dim() - 1)).to(grad.dtype)
        return grad * scale, None, None, None, None


def _quantile_huber_sorted(
    pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss ``[B]`` (pred's dtype) and its gradient w.r.t. pred ``[B, N, ...]``.

    For one prediction p at level tau, with u = t - p over the sorted targets t:
    below = sum_{u < -k} k (-u - k/2) + sum_{-k <= u < 0} u^2 / 2, weighted (1 - tau);
    above = sum_{0 <= u <= k} u^2 / 2 + sum_{u > k} k (u - k/2), weighted tau.
    (Huber and its derivative are continuous at |u| = k and 0, so ties may fall either side.)
    Everything is float64 ``[B, C, N]`` (C = trailing columns), updated in place to keep few alive.
    """
    batch, n = pred.shape[:2]
    m = target.shape[1]
    p = pred.detach().reshape(batch, n, -1).transpose(1, 2).double().contiguous()  # [B, C, N]
    t = target.reshape(batch, m, -1).transpose(1, 2)  # [B, C, M]
    t = torch.sort(t, dim=-1).values.double().contiguous()  # [B, C, M]: sorted in the input dtype (same order)
    zero = t.new_zeros(*t.shape[:-1], 1)
    s1 = torch.cat([zero, t.cumsum(-1)], dim=-1)  # [B, C, M + 1]: sum of the k smallest targets
    s2 = torch.cat([zero, t.square().cumsum(-1)], dim=-1)  # [B, C, M + 1]: sum of their squares
    del zero

    def prefix(values: torch.Tensor, right: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = torch.searchsorted(t, values, right=right)  # [B, C, N]: how many targets lie below
        return k.double(), s1.gather(-1, k), s2.gather(-1, k)

    def quadratic(count, sum1, sum2):  # sum (t - p)^2 / 2 over a range (consumes sum2), d/dp
        value = sum2.addcmul_(p, sum1, value=-2.0).addcmul_(count, p.square()).mul_(0.5)
        return value, torch.addcmul(-sum1, count, p)

    n_a, s1_a, s2_a = prefix(p - kappa, right=False)  # [0, a): u < -kappa
    n_b, s1_b, s2_b = prefix(p, right=False)  # [0, b): u < 0
    loss = (p - 0.5 * kappa).mul_(n_a).sub_(s1_a).mul_(kappa)  # linear part of below
    grad = n_a * kappa
    value, slope = quadratic(n_b - n_a, s1_b - s1_a, s2_b - s2_a)  # [a, b): -kappa <= u < 0
    del n_a, s1_a, s2_a
    weight = 1.0 - taus.double().unsqueeze(1)  # [B, 1, N]: 1 - tau
    loss.add_(value).mul_(weight)
    grad.add_(slope).mul_(weight)
    del value, slope
    weight.neg_().add_(1.0)  # tau
    n_c, s1_c, s2_c = prefix(p + kappa, right=True)  # [0, c): u <= kappa
    value, slope = quadratic(n_c - n_b, s1_c - s1_b, s2_c.sub_(s2_b))  # [b, c): 0 <= u <= kappa
    del n_b, s1_b, s2_b, s2_c
    n_c.neg_().add_(m)  # u > kappa: count ...
    s1_c.neg_().add_(s1[..., -1:])  # ... and sum
    value.add_((p + 0.5 * kappa).mul_(n_c).neg_().add_(s1_c).mul_(kappa))
    slope.sub_(n_c, alpha=kappa)
    loss.addcmul_(weight, value)
    grad.addcmul_(weight, slope)
    scale = 1.0 / (kappa * m)  # Huber / kappa, mean over the targets
    columns = p.shape[1]
    loss = loss.sum(dim=-1).mean(dim=-1).mul_(scale)  # [B]: sum over N, mean over columns
    grad = grad.mul_(scale / columns).transpose(1, 2).reshape(pred.shape).to(pred.dtype)  # [B, N, ...]
    return loss.to(pred.dtype), grad


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """Elementwise asymmetric squared loss ``|expectile - 1{diff < 0}| * diff^2``, ``diff = target - pred``.

    ``expectile`` > 0.5 weights under-estimates (target above prediction) more: IQL's upper expectile.
    """
    weight = torch.where(diff < 0, 1.0 - expectile, expectile)
    return weight * diff.square()
