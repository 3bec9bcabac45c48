"""Branching dueling C51 head (Tavakoli et al. 2018 action branching + Bellemare et al. 2017 C51).

A value stream V(s) ``[B, atoms]`` and one advantage stream per branch ``A_d(s, .) [B, n_d, atoms]``,
combined per branch on the logits: ``logits_d = V + A_d - mean_a A_d`` (the mean over that branch's
sub-actions), then a softmax over atoms gives each sub-action's return distribution on the support.

All streams' first layers are one fused ``Linear(d_model, (1 + branches) * stream_hidden)`` (one matmul,
one autocast cast of the features); each stream has its own output layer. Branches of unequal size are
padded to the largest one: padded sub-actions get zero logits and ``valid_actions`` marks them invalid.

The output layers are a few columns wider than they need be (:func:`aligned_width`: 51 -> 56 atoms, 5 x 51 =
255 -> 256): with bf16 rows a multiple of 16 bytes cuBLAS can use its Hopper (sm_90) GEMMs; with 51 or 255
columns it fell back to sm_75 kernels that took about 47 us each at batch 8192 on an H200, about 0.8 ms
per update in all. The extra columns are sliced off before use: their weights get zero gradients and never
move, and the maths is unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fitdqn.nets.groups import tag

GEMM_ALIGNMENT = 8  # bf16 elements in 16 bytes


def aligned_width(width: int) -> int:
    """``width`` rounded up to a multiple of ``GEMM_ALIGNMENT`` (an output layer's padded width)."""
    return -(-width // GEMM_ALIGNMENT) * GEMM_ALIGNMENT


class PaddedLinear(nn.Linear):
    """``nn.Linear(in, aligned_width(out))`` whose first ``out`` rows start exactly as ``nn.Linear(in, out)``'s
    would (the same random draws, so seeded runs are unchanged by the padding); the padding rows start at zero."""

    def __init__(self, in_features: int, out_features: int) -> None:
        object.__setattr__(self, "used_features", out_features)  # read by reset_parameters in nn.Linear.__init__
        super().__init__(in_features, aligned_width(out_features))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()
            nn.init.kaiming_uniform_(self.weight[:self.used_features], a=math.sqrt(5))  # nn.Linear's own init
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias[:self.used_features], -bound, bound)


def dueling(value: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
    """``value [B, A]``, ``advantage [B, n, A]`` -> ``[B, n, A]``: V + A - mean over sub-actions of A."""
    return value.unsqueeze(1) + advantage - advantage.mean(dim=1, keepdim=True)


class BranchingDuelingC51(nn.Module):
    """``features [B, d_model] -> logits [B, branches, max_n, atoms]`` (padded sub-actions: zeros)."""

    def __init__(self, d_model: int, hidden: int, branches: tuple[int, ...], atoms: int) -> None:
        super().__init__()
        self.branches = tuple(branches)
        self.atoms = atoms
        self.max_n = max(branches)
        self.hidden = nn.Linear(d_model, (1 + len(branches)) * hidden)
        self.value = PaddedLinear(hidden, atoms)
        self.advantages = nn.ModuleList(PaddedLinear(hidden, n * atoms) for n in branches)
        tag(self, "dqn")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch = features.shape[0]
        streams = F.relu(self.hidden(features), inplace=True)  # [B, (1 + branches) * h]
        streams = streams.view(batch, 1 + len(self.branches), -1)  # [B, 1 + branches, h]
        value = self.value(streams[:, 0])[:, :self.atoms]  # [B, atoms] (padding columns dropped)
        logits = []
        for index, (n, layer) in enumerate(zip(self.branches, self.advantages, strict=True)):
            advantage = layer(streams[:, 1 + index])[:, :n * self.atoms].view(batch, n, self.atoms)  # [B, n, atoms]
            branch = dueling(value, advantage)  # [B, n, atoms]
            if n < self.max_n:
                branch = F.pad(branch, (0, 0, 0, self.max_n - n))  # [B, max_n, atoms]
            logits.append(branch)
        return torch.stack(logits, dim=1)  # [B, branches, max_n, atoms]
