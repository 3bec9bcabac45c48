"""Branching dueling C51 head (Tavakoli et al. 2018 action branching + Bellemare et al. 2017 C51).

A value stream V(s) ``[B, atoms]`` and one advantage stream per branch ``A_d(s, .) [B, n_d, atoms]``,
combined per branch on the logits: ``logits_d = V + A_d - mean_a A_d`` (the mean over that branch's
sub-actions), then a softmax over atoms gives each sub-action's return distribution on the support.

All streams' first layers are one ``Linear(d_model, (1 + branches) * stream_hidden)`` (one matmul, no cast of
the features: the attention hands them over in bf16 under autocast; its ReLU runs in the product's epilogue,
``fitdqn.ops.linear_relu``); each stream has its own output layer. Branches of unequal size are padded to the
largest one: padded sub-actions get zero logits and ``valid_actions`` marks them invalid.

The output layers are a few columns wider than they need be (:func:`aligned_width`: 51 -> 56 atoms, 5 x 51 =
255 -> 256): with bf16 rows a multiple of 16 bytes cuBLAS can use its Hopper (sm_90) GEMMs; with 51 or 255
columns it fell back to sm_75 kernels that took about 47 us each at batch 8192 on an H200, about 0.8 ms
per update in all. The extra columns are sliced off before use: their weights get zero gradients and never
move, and the maths is unchanged.

The dueling combination is linear, so it is applied to the *weights*, not the activations
(:meth:`BranchingDuelingC51.folded_output`): with ``A_a = W_a h_d + b_a``, ``A_a - mean_a' A_a' =
(W_a - mean W) h_d + (b_a - mean b)``, and ``V + that`` is one linear map of the stacked streams
``[h_V, h_1, .., h_br]``. The whole head is then one GEMM ``[B, (1 + br) h] x [(1 + br) h, br n atoms]`` on a
weight built per forward from the same parameters, independent of the batch. Per-branch layers and dueling on
the activations (the test oracle, ``tests/support/reference``) took 14 kernels on ``[B, ...]`` tensors a forward and
about 0.5 ms of the update at batch 8192 on an H200, most of it elementwise ``[B, n, atoms]`` passes and their
backward. The zero blocks of the folded weight cost FLOPs (a third of them are used), not time: the GEMM is small.

The fold is the operator ``fitdqn::folded_output`` (:mod:`fitdqn.ops.fold`): on CUDA one Triton launch per branch
forward, each writing every column of its branch's rows (zeros included: no fill), and one per branch plus one for
the value layer backward; on the CPU a few ATen ops each way into views of one zeroed buffer (autograd through the
same maths in plain ops took 11 ops forward and 22 backward at the default (5, 5, 5) branches and 51 atoms, most of
the backward undoing the slices and pads of the parameters).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fitdqn.nets.groups import tag
from fitdqn.ops.casts import derived_once
from fitdqn.ops.fold import folded_output
from fitdqn.ops.linear import linear
from fitdqn.ops.linear_relu import linear_relu

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
        width = len(branches) * self.max_n * atoms
        self.padding_rows = aligned_width(width) - width
        tag(self, "dqn")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch = features.shape[0]
        streams = linear_relu(features, self.hidden.weight, self.hidden.bias)  # [B, (1 + br) h]
        weight, bias = self.folded_output()  # [rows, (1 + branches) * h], [rows]
        logits = linear(streams, weight, bias)  # [B, rows]: the bias gradient a matrix-vector product
        width = len(self.branches) * self.max_n * self.atoms
        return logits[:, :width].view(batch, len(self.branches), self.max_n, self.atoms)

    def folded_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The value and advantage output layers and the dueling combination as one linear map of the streams:
        weight ``[rows, (1 + branches) h]`` and bias ``[rows]``, rows = branches * max_n * atoms padded to
        ``aligned_width``. Row (d, a, k) holds V's row k in column block 0 and ``W_{d,a,k} - mean_a W_{d,.,k}``
        in block 1 + d; padded sub-actions and padding rows are zero. Inside the learner's update built once
        while the parameters are unchanged (``fitdqn.ops.casts.derived_once``: the online network's two passes
        share it, and its cast)."""
        return derived_once(self, self._fold)

    def _fold(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fold of this head's output layers: the operator ``fitdqn::folded_output`` (:mod:`fitdqn.ops.fold`)."""
        return folded_output(self.value.weight, self.value.bias, [layer.weight for layer in self.advantages],
                             [layer.bias for layer in self.advantages], self.branches, self.atoms, self.padding_rows)
