"""IQN head (Dabney et al. 2018) on the shared trunk features, fused and chunked over quantiles.

Maths (unchanged from the paper): for each quantile level tau,
``phi(tau) = ReLU(Linear_E->d(cos(pi * i * tau), i = 0..E-1))``, ``Z_tau(s, .) = Linear_d->O(psi(s) * phi(tau))``
with psi(s) the trunk features ``[B, d_model]`` and O = one output per sub-action (15).

Memory: the plain module keeps ``[B, N, E]`` cosines, ``[B, N, d]`` ReLU outputs and ``[B, N, d]`` products
for backward — ``N * (E + 2 d)`` elements per sample (36,864 for N = 64, E = 64, d = 256: 72 KB in bf16,
the largest activation of the whole update). :class:`QuantileHeadFunction` saves only its inputs
(features ``[B, d]`` and taus ``[B, N]``) and recomputes a ``chunk`` of quantiles at a time in backward:
nothing of size N x d outlives its chunk. Transients per sample: psi(s) expanded to ``[chunk, d]``
plus, per chunk, at most three ``[chunk, d]`` tensors (phi, its gradient and one product): about
32 KB in bf16 for chunk 16. Forward (targets included) is chunked the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fitdqn.nets.groups import tag


def cosine_embedding(taus: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """``taus [B, N]``, ``frequencies [E]`` (pi * i) -> ``[B, N, E]`` = cos(pi * i * tau), fp32 at least."""
    dtype = torch.promote_types(taus.dtype, torch.float32)
    return torch.cos(taus.to(dtype).unsqueeze(-1) * frequencies.to(dtype))


def compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The dtype autocast would give a matmul here (``default`` when autocast is off)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


class QuantileHeadFunction(torch.autograd.Function):
    """Fused IQN head: ``(features [B, d], taus [B, N]) -> [B, N, O]`` (fp32 at least), recomputing in backward.

    Per chunk of c quantiles, every matmul is one large GEMM over the B * c rows (fast on cuBLAS):
    ``phi = relu(cos @ embed_w.T + embed_b)`` (ReLU in the GEMM epilogue on CUDA), ``h = phi * psi`` and
    ``Z = h @ out_w.T + out_b``. psi(s) is expanded once per call to a contiguous ``[B, c, d]`` so the
    products run as vectorised same-shape kernels, not broadcasts. Backward recomputes ``phi`` and ``h``:
    ``out_w`` gets ``g.T @ h``; ``dh = g @ out_w``; psi gets ``sum_n dh * phi``; ``embed_w`` gets
    ``(dh * psi masked by the ReLU).T @ cos``; ``embed_b`` multiplies the i = 0 cosine, which is 1, so its
    gradient is ``embed_w``'s first column. Matmuls run in ``dtype`` (bf16 under autocast); gradients
    accumulate in fp32 (at least) across chunks. Taus get no gradient (they are sampled).
    """

    @staticmethod
    def forward(ctx, features, taus, frequencies, embed_w, embed_b, out_w, out_b, chunk: int,
                dtype: torch.dtype):
        batch, quantiles = taus.shape
        out_dtype = torch.promote_types(features.dtype, torch.float32)
        out = torch.empty(batch, quantiles, out_w.shape[0], device=features.device, dtype=out_dtype)
        with torch.autocast(features.device.type, enabled=False):
            w1, b1, w2, b2 = embed_w.to(dtype), embed_b.to(dtype), out_w.to(dtype), out_b.to(dtype)
            psi = _expand(features, min(chunk, quantiles), dtype)  # [B, c, d] contiguous
            for start in range(0, quantiles, chunk):
                cos = cosine_embedding(taus[:, start:start + chunk], frequencies).to(dtype)  # [B, c, E]
                h = _linear_relu(cos, w1, b1).mul_(psi[:, :cos.shape[1]])  # [B, c, d]
                out[:, start:start + chunk] = F.linear(h, w2, b2)  # [B, c, O]
                del cos, h
        ctx.save_for_backward(features, taus, frequencies, embed_w, embed_b, out_w, out_b)
        ctx.chunk, ctx.dtype = chunk, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [B, N, O]
        features, taus, frequencies, embed_w, embed_b, out_w, out_b = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        quantiles = taus.shape[1]
        acc = torch.promote_types(features.dtype, torch.float32)  # gradients accumulate in fp32 at least
        grad_x = torch.zeros(features.shape, device=features.device, dtype=acc)  # [B, d]
        grad_w1 = torch.zeros(embed_w.shape, device=features.device, dtype=acc)  # [d, E]
        grad_w2 = torch.zeros(out_w.shape, device=features.device, dtype=acc)  # [O, d]
        with torch.autocast(features.device.type, enabled=False):
            w1, b1, w2 = embed_w.to(dtype), embed_b.to(dtype), out_w.to(dtype)
            psi_all = _expand(features, min(chunk, quantiles), dtype)  # [B, c, d] contiguous
            for start in range(0, quantiles, chunk):
                cos = cosine_embedding(taus[:, start:start + chunk], frequencies).to(dtype)  # [B, c, E]
                psi = psi_all[:, :cos.shape[1]]  # [B, c, d]
                phi = _linear_relu(cos, w1, b1)  # [B, c, d]
                g = grad_out[:, start:start + chunk].to(dtype).flatten(0, 1)  # [B * c, O]
                grad_w2 += (g.T @ (phi * psi).flatten(0, 1)).to(acc)  # [O, d]
                d_h = (g @ w2).view(phi.shape)  # [B, c, d]: gradient w.r.t. h = phi * psi
                del g
                grad_x += (d_h * phi).sum(dim=1, dtype=acc)  # [B, d]
                d_pre = d_h.mul_(psi)  # [B, c, d]: through the product ...
                torch.ops.aten.threshold_backward.grad_input(d_pre, phi, 0, grad_input=d_pre)  # ... and ReLU
                del phi
                grad_w1 += (d_pre.flatten(0, 1).T @ cos.flatten(0, 1)).to(acc)  # [d, E]
                del d_pre, cos  # nothing of this chunk outlives it
        grad_b1 = grad_w1[:, 0].clone()  # cos(pi * 0 * tau) = 1: the bias is the first column's twin
        grad_b2 = grad_out.sum(dim=(0, 1), dtype=acc)  # [O]
        return (grad_x.to(features.dtype), None, None, grad_w1.to(embed_w.dtype), grad_b1.to(embed_b.dtype),
                grad_w2.to(out_w.dtype), grad_b2.to(out_b.dtype), None, None)


def _expand(features: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """psi(s) repeated over a chunk of quantiles, contiguous: ``[B, d] -> [B, chunk, d]`` in ``dtype``."""
    return features.to(dtype).unsqueeze(1).expand(-1, chunk, -1).contiguous()


def _linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu(x @ weight.T + bias)`` for ``x [B, c, E]`` -> ``[B, c, d]``; on CUDA the ReLU runs in the
    GEMM's epilogue (cuBLASLt), so the pre-activation is never written. No autograd (manual backward)."""
    flat = torch._addmm_activation(bias, x.flatten(0, 1), weight.t())  # [B * c, d]
    return flat.view(*x.shape[:-1], weight.shape[0])


class IQNHead(nn.Module):
    """``features [B, d_model]``, ``taus [B, N]`` -> quantile values ``[B, N, outputs]`` (fp32)."""

    def __init__(self, d_model: int, embedding: int, outputs: int, chunk: int) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"IQN chunk must be at least 1, got {chunk}")
        self.chunk = chunk
        self.embed = nn.Linear(embedding, d_model)
        self.out = nn.Linear(d_model, outputs)
        # pi * i for i = 0..E-1 (the paper's range): i = 0 makes a constant 1 feature, which the fused
        # backward relies on (the bias gradient is that column's)
        self.register_buffer("frequencies", math.pi * torch.arange(embedding, dtype=torch.float32),
                             persistent=False)
        tag(self, "iqn")

    def forward(self, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(features.device.type, self.out.weight.dtype)
        return QuantileHeadFunction.apply(
            features, taus, self.frequencies, self.embed.weight, self.embed.bias, self.out.weight,
            self.out.bias, self.chunk, dtype,
        )

    def reference(self, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        """The same maths in plain autograd (keeps [B, N, d] tensors): the fused path's test oracle."""
        phi = F.relu(self.embed(cosine_embedding(taus, self.frequencies)))  # [B, N, d]
        out = self.out(features.unsqueeze(1) * phi)  # [B, N, O]
        return out.to(torch.promote_types(out.dtype, torch.float32))
