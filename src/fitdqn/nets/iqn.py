"""IQN head (Dabney et al. 2018) on the shared trunk features: nothing ``[B, N, d]`` is kept.

Maths (unchanged from the paper): for each quantile level tau,
``phi(tau) = ReLU(Linear_E->d(cos(pi * i * tau), i = 0..E-1))``, ``Z_tau(s, .) = Linear_d->O(psi(s) * phi(tau))``
with psi(s) the trunk features ``[B, d_model]`` and O = one output per sub-action (15).

Plain autograd (the test oracle, ``tests/support/reference``) would keep ``[B, N, E]`` cosines, ``[B, N, d]`` ReLU
outputs and ``[B, N, d]`` products for backward: ``N * (E + 2 d)`` elements per sample (36,864 for N = 64,
E = 64, d = 256: 72 KB in bf16, the largest activation of the whole update). The head is instead the operator
``fitdqn::iqn_quantile_head`` (:mod:`fitdqn.ops.iqn`): Triton kernels on CUDA
(:mod:`fitdqn.ops.iqn_triton`) that compute cosines, phi and h in registers, tile by tile, and the chunked maths
on the CPU. Per sample: saved for backward only the inputs, features ``[d]`` + taus ``[N]`` (512 B + 256 B: the
attention's features are bf16 under autocast, fp32 without); output ``[N, O]`` fp32 (3.75 KB at N = 64); in
backward grad features ``[d]`` in the features' dtype (512 B) and, independent of the batch, per-program partial
sums of the weight gradients (``[P, d, E]`` + ``[P, O, d]`` + ``[P, O]`` fp32, P = 128: about 10 MiB).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fitdqn.nets.groups import tag
from fitdqn.ops.iqn import compute_dtype, iqn_quantile_head


class IQNHead(nn.Module):
    """``features [B, d_model]``, ``taus [B, N]`` -> quantile values ``[B, N, outputs]`` (fp32): the
    ``fitdqn::iqn_quantile_head`` operator."""

    def __init__(self, d_model: int, embedding: int, outputs: int) -> None:
        super().__init__()
        self.embed = nn.Linear(embedding, d_model)
        self.out = nn.Linear(d_model, outputs)
        # pi * i for i = 0..E-1 (the paper's range): i = 0 makes a constant 1 feature, which both backwards
        # rely on (the bias gradient is that column's)
        self.register_buffer("frequencies", math.pi * torch.arange(embedding, dtype=torch.float32),
                             persistent=False)
        tag(self, "iqn")

    def forward(self, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(features.device.type, self.out.weight.dtype)
        return iqn_quantile_head(features, taus, self.frequencies, self.embed.weight, self.embed.bias,
                                 self.out.weight, self.out.bias, dtype)
