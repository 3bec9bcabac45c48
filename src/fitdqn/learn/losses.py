"""The three losses as plain tensor functions: C51 projection, IQN quantile Huber, IQL expectile; and their
weighted sum (:func:`weighted_losses`).

No host syncs and no Python branches on tensor values: each runs eagerly and inside a CUDA graph. C51's
projection, the quantile Huber loss and the weighted sum are operators (:mod:`fitdqn.ops.projection`,
:mod:`fitdqn.ops.quantile_huber`, :mod:`fitdqn.ops.weighted_losses`; Triton kernels on CUDA, the plain maths on the
CPU): the projection's landing positions are computed inside its kernel, from the rewards, discounts and support as
they are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fitdqn.ops.projection import project_returns
from fitdqn.ops.quantile_huber import QuantileHuber
from fitdqn.ops.weighted_losses import FusedWeightedLosses


@torch.no_grad()
def categorical_projection(
    next_probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
) -> torch.Tensor:
    """Project ``r + discount * z`` onto the support (C51's Phi operator); a target, so no gradient.

    ``next_probs [B, ..., A]`` (target distributions), ``rewards``/``discounts`` ``[B]`` or broadcastable to
    the leading dims of ``next_probs`` (``discount = gamma^n * (1 - done)``), ``support [A]`` evenly spaced.
    Returns ``[B, ..., A]`` fp32. Shifted atoms are clamped to [v_min, v_max]; the mass of an atom landing at
    fractional index ``x_j = (Tz_j - v_min) / dz`` goes to its two neighbours in proportion to closeness,
    written as the hat function ``max(0, 1 - |x_j - i|)`` (an atom landing exactly on i gives all its mass to i).
    The dense hat is deterministic on CUDA (no scatter-add atomics) and runs in fp32 even under autocast (which
    would round the target distribution to bf16, about 3 significant digits).

    The whole projection is the operator ``fitdqn::categorical_projection`` (:mod:`fitdqn.ops.projection`): on
    CUDA one Triton kernel that computes the landing positions and the hat in registers and writes only the result;
    on the CPU the positions (:func:`fitdqn.ops.projection.atom_positions`), then the dense form. Here only views
    are made (rewards and discounts ``[B]`` as they are, else ``[B, br]`` views), so on CUDA the projection is one
    launch.
    """
    lead = next_probs.shape[:-1]  # [B, ...]
    flat = project_returns(next_probs.reshape(-1, next_probs.shape[-1]), _per_row(rewards, lead),
                           _per_row(discounts, lead), support)  # [R, A]
    return flat.view(next_probs.shape)


def _per_row(values: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """Rewards or discounts for :func:`fitdqn.ops.projection.project_returns`: ``[B]`` as they are, else broadcast
    to the leading dims ``[B, ...]`` and flattened to ``[B, br]`` (a view, stride 0 where they are shared)."""
    if values.dim() == 1:
        return values.expand(lead[0])  # [B]
    values = values.reshape(values.shape + (1,) * (len(lead) - values.dim())).expand(lead)  # [B, ...]
    return values.reshape(lead[0], lead[1:].numel())  # [B, br]


def quantile_huber_loss(
    pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float
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

    The operator ``fitdqn::quantile_huber`` (:mod:`fitdqn.ops.quantile_huber`): on CUDA a Triton kernel that forms
    the pairs in registers (same maths, fp32, no temporaries); on the CPU this closed form. Same result and saved
    tensor either way.
    """
    if not kappa > 0:
        raise ValueError(f"kappa must be positive, got {kappa}")
    if pred.shape[0] != target.shape[0] or pred.shape[2:] != target.shape[2:]:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} do not match")
    if taus.shape != pred.shape[:2]:
        raise ValueError(f"taus {tuple(taus.shape)} must be [B, N] = {tuple(pred.shape[:2])}")
    return QuantileHuber.apply(pred, target.detach(), taus.detach(), float(kappa))


class WeightedLosses(NamedTuple):
    """What :func:`weighted_losses` gives: the total and its parts, without a graph except ``loss``'s."""

    loss: torch.Tensor  # []: the one backward starts from
    means: torch.Tensor  # [3]: the weighted means of the C51, IQN and IQL losses (unscaled by their weights)
    priorities: torch.Tensor  # [B]: each sample's C51 cross-entropy, averaged over branches


def weighted_losses(
    c51_target: torch.Tensor, log_probs: torch.Tensor, iqn: torch.Tensor, v: torch.Tensor, v_target: torch.Tensor,
    weight: torch.Tensor, loss_weights: torch.Tensor, expectile: float,
) -> WeightedLosses:
    """The update's loss: ``mean_B(weight * (c51 + w_iqn * iqn + w_iql * iql))``, with its three parts' weighted
    means and the C51 priorities, as one autograd function.

    ``c51_target [B, br, A]`` (projected targets, no gradient), ``log_probs [B, br, A]`` (the taken sub-actions'
    log-distributions), ``iqn [B]`` (the quantile Huber loss per sample), ``v [B]`` and ``v_target [B]`` (IQL's
    V(s) and its target, no gradient), ``weight [B]`` (importance weights), ``loss_weights [3]`` = ``(1, w_iqn,
    w_iql)`` (a tensor made once, so that a captured update copies nothing from the host). The per-sample losses:
    ``c51 = -mean_br sum_A c51_target * log_probs`` and ``iql = |expectile - 1{diff < 0}| * diff^2`` with
    ``diff = v_target - v`` (IQL's upper expectile for ``expectile`` > 0.5).

    Written by hand because autograd's version of these few lines is 37 ops, most on ``[B]`` vectors (the three
    means, the sum, the expectile's pieces and each one's backward; a CPU census of the update's aten ops), each a
    kernel launch of a few microseconds in the update's graph: here the operators ``fitdqn::weighted_losses`` and
    its backward (:mod:`fitdqn.ops.weighted_losses`), on CUDA one Triton kernel each way, so the forward is 3
    launches (the kernel, the sum of its partial sums, the dot with ``loss_weights``) and the backward 1; on the CPU
    the same maths in torch. Everything runs in fp32, outside autocast.
    """
    with torch.autocast(log_probs.device.type, enabled=False):
        return WeightedLosses(*FusedWeightedLosses.apply(c51_target, log_probs, iqn, v, v_target, weight,
                                                         loss_weights, float(expectile)))
