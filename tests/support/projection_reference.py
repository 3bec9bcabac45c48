"""Plain-Python reference of C51's projection (Bellemare et al. 2017, Algorithm 1), for the losses' and the
projection operator's tests."""

from __future__ import annotations

import math

import torch


def project_loop(next_probs, rewards, discounts, support):
    """Per-sample, per-atom reference (Bellemare et al. 2017, Algorithm 1) in plain Python floats."""
    atoms = len(support)
    v_min, v_max = float(support[0]), float(support[-1])
    dz = (v_max - v_min) / (atoms - 1)
    flat = next_probs.reshape(next_probs.shape[0], -1, atoms)
    out = torch.zeros_like(flat, dtype=torch.float64)
    for b in range(flat.shape[0]):
        for row in range(flat.shape[1]):
            for j in range(atoms):
                tz = min(max(float(rewards[b]) + float(discounts[b]) * float(support[j]), v_min), v_max)
                position = (tz - v_min) / dz
                low, high = math.floor(position), math.ceil(position)
                p = float(flat[b, row, j])
                if low == high:
                    out[b, row, low] += p
                else:
                    out[b, row, low] += p * (high - position)
                    out[b, row, high] += p * (position - low)
    return out.reshape(next_probs.shape)


def project_plain(probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, support: torch.Tensor
                  ) -> torch.Tensor:
    """The CPU kernel's dense torch maths on the whole batch, without the operator: the landing positions
    (``fitdqn.ops.projection.atom_positions``), then the dense hat."""
    from fitdqn.ops.projection import atom_positions, project_dense

    return project_dense(probs, atom_positions(probs.dim(), rewards, discounts, support))
