"""IQN head (Dabney et al. 2018) on the shared trunk features, fused: nothing ``[B, N, d]`` is kept.

Maths (unchanged from the paper): for each quantile level tau,
``phi(tau) = ReLU(Linear_E->d(cos(pi * i * tau), i = 0..E-1))``, ``Z_tau(s, .) = Linear_d->O(psi(s) * phi(tau))``
with psi(s) the trunk features ``[B, d_model]`` and O = one output per sub-action (15).

The plain module (:meth:`IQNHead.reference`, the test oracle) keeps ``[B, N, E]`` cosines, ``[B, N, d]`` ReLU
outputs and ``[B, N, d]`` products for backward: ``N * (E + 2 d)`` elements per sample (36,864 for N = 64,
E = 64, d = 256: 72 KB in bf16, the largest activation of the whole update). Two implementations avoid
that, picked once at construction (``net.kernels``, :func:`fitdqn.ops.kernels.resolve_kernels`):

- ``'triton'``: the operator ``fitdqn::iqn_quantile_head`` (:mod:`fitdqn.ops.iqn`), fused Triton kernels
  on CUDA (:mod:`fitdqn.ops.iqn_triton`) that compute cosines, phi and h in registers, tile by tile. Per
  sample: saved for backward only the inputs, features ``[d]`` + taus ``[N]`` (512 B + 256 B: the fused
  attention's features are bf16 under autocast, fp32 without); output ``[N, O]`` fp32 (3.75 KB at N = 64); in
  backward grad features ``[d]`` in the features' dtype (512 B) and, independent of the batch, per-program
  partial sums of the weight gradients (``[P, d, E]`` + ``[P, O, d]`` + ``[P, O]`` fp32, P = 128: about
  10 MiB). On the CPU the same operator runs the chunked maths.
- ``'torch'``: :class:`QuantileHeadFunction` (:mod:`fitdqn.ops.iqn`), cuBLAS GEMMs over ``chunk``
  quantiles at a time (``net.iqn_chunk``): the same saved inputs, plus about 32 KB per sample of transients
  in bf16 at chunk 16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fitdqn.nets.groups import tag
from fitdqn.ops.iqn import QuantileHeadFunction, compute_dtype, cosine_embedding, iqn_quantile_head

__all__ = ["IQNHead", "QuantileHeadFunction", "compute_dtype", "cosine_embedding"]


class IQNHead(nn.Module):
    """``features [B, d_model]``, ``taus [B, N]`` -> quantile values ``[B, N, outputs]`` (fp32).

    ``fused``: the ``fitdqn::iqn_quantile_head`` operator (Triton on CUDA, chunked maths on the CPU), else
    :class:`QuantileHeadFunction`; ``chunk`` quantiles at a time wherever the chunked maths runs.
    """

    def __init__(self, d_model: int, embedding: int, outputs: int, chunk: int, fused: bool = False) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"IQN chunk must be at least 1, got {chunk}")
        self.chunk = chunk
        self.fused = fused
        self.embed = nn.Linear(embedding, d_model)
        self.out = nn.Linear(d_model, outputs)
        # pi * i for i = 0..E-1 (the paper's range): i = 0 makes a constant 1 feature, which both backwards
        # rely on (the bias gradient is that column's)
        self.register_buffer("frequencies", math.pi * torch.arange(embedding, dtype=torch.float32),
                             persistent=False)
        tag(self, "iqn")

    def forward(self, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(features.device.type, self.out.weight.dtype)
        head = iqn_quantile_head if self.fused else QuantileHeadFunction.apply
        return head(features, taus, self.frequencies, self.embed.weight, self.embed.bias, self.out.weight,
                    self.out.bias, self.chunk, dtype)

    def reference(self, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        """The same maths in plain autograd (keeps [B, N, d] tensors): the fused paths' test oracle."""
        phi = F.relu(self.embed(cosine_embedding(taus, self.frequencies)))  # [B, N, d]
        out = self.out(features.unsqueeze(1) * phi)  # [B, N, O]
        return out.to(torch.promote_types(out.dtype, torch.float32))
