"""The IQN head's quantile network ``(features [B, d], taus [B, N]) -> [B, N, O]`` as one PyTorch operator,
``fitdqn::iqn_quantile_head``, with its backward as a second one: on the CPU the chunked maths below, on CUDA the
fused Triton kernels of :mod:`fitdqn.ops.iqn_triton`.

**The chunked maths** (:func:`chunked_quantiles`, :func:`chunked_quantile_grads`), the CPU kernels, ``CHUNK``
quantiles at a time. Per chunk of c quantiles every matmul is one large GEMM over
the B * c rows: ``phi = relu(cos @ embed_w.T + embed_b)`` (ReLU in the GEMM epilogue on
CUDA), ``h = phi * psi`` and ``Z = h @ out_w.T + out_b``. psi(s) is expanded once per call to a contiguous
``[B, c, d]`` so the products run as vectorised same-shape kernels, not broadcasts. Backward recomputes
``phi`` and ``h``: ``out_w`` gets ``g.T @ h``; ``dh = g @ out_w``; psi gets ``sum_n dh * phi``; ``embed_w``
gets ``(dh * psi masked by the ReLU).T @ cos``; ``embed_b`` multiplies the i = 0 cosine, which is 1, so its
gradient is ``embed_w``'s first column. Matmuls run in ``dtype`` (bf16 under autocast); gradients accumulate
in fp32 (at least) across chunks. Taus get no gradient (they are sampled).
Memory: only the inputs (features ``[B, d]``, taus ``[B, N]``) are saved; per sample, psi(s) expanded to
``[chunk, d]`` plus, per chunk, at most three ``[chunk, d]`` tensors (phi, its gradient and one product).
The plain autograd form (``tests/support/reference``) keeps ``[B, N, E]`` cosines and two ``[B, N, d]`` tensors
for backward; the chunk bounds the transients without costing the CPU speed (the GEMMs stay large).

**The operator** ``iqn_quantile_head(features [B, d], taus [B, N], frequencies [E], embed_w [d, E], embed_b [d],
out_w [O, d], out_b [O], dtype) -> [B, N, O]`` (fp32 at least).
Kernels: on CUDA the fused Triton kernels of :mod:`fitdqn.ops.iqn_triton` (compute dtype bf16, fp16 or
fp32; :func:`fitdqn.ops.kernels.runs_triton`); everywhere else (and for fp64 on CUDA) the chunked maths.

Why an operator and not an ``autograd.Function``: the memory planner traces the update on fake tensors
(``fitdqn.memory.trace``, often fake *CPU* tensors standing in for CUDA ones) and counts every storage an op
returns. Its fake kernels (``register_fake``) allocate exactly what the Triton path allocates, whatever
device the fake tensors claim, so the trace of a CUDA target sees the GPU's bytes:

- forward: the output ``[B, N, O]`` fp32; autograd saves only the inputs (features ``[B, d]``, taus
  ``[B, N]`` and the parameters); nothing of size ``[B, N, d]`` exists at any time;
- backward op: grad features ``[B, d]`` in the features' dtype (summed in fp32 at least, rounded once: bf16
  features, as the fused attention's under autocast, get a bf16 gradient without a cast kernel of its own)
  and the weight gradients as per-program partial sums
  (``[P, d, E]``, ``[P, O, d]``, ``[P, O]`` fp32, ``P = min(WEIGHT_GRAD_PROGRAMS, tiles)``: 8 MiB +
  1.9 MiB at d = 256, E = 64, O = 15, independent of the batch beyond 128 tiles), summed over P by torch in the
  autograd backward (:func:`_backward`), where the trace sees those sums too.

The CPU kernel of the backward op returns its (exact, chunked) gradients in partial row 0 and zeros in the
others, so both kernels have one output contract.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fitdqn.ops.kernels import next_power_of_2, runs_triton, triton_module

CHUNK = 16  # quantiles per chunk of the CPU kernels: about 32 KB a sample of transients in bf16 at d = 256
TILE_ROWS = 64  # (sample, quantile) rows per Triton tile
WEIGHT_GRAD_PROGRAMS = 128  # programs along the batch in backward (x the d slices: 8 at d = 256)


class TileGeometry(NamedTuple):
    """How the Triton kernels cut the ``B x N`` rows: tiles of ``samples`` whole samples x ``block_quantiles``."""

    block_quantiles: int  # quantiles per tile: N rounded up to a power of two, at most TILE_ROWS
    samples: int  # samples per tile: TILE_ROWS // block_quantiles
    quantile_blocks: int  # tiles along one sample's quantiles (N > TILE_ROWS only)
    tiles: int  # tiles along the batch
    programs: int  # backward programs along the batch (each owns tiles p, p + programs, ...)


def tile_geometry(batch: int, quantiles: int) -> TileGeometry:
    block = min(next_power_of_2(quantiles), TILE_ROWS)
    samples = TILE_ROWS // block
    tiles = -(-batch // samples)
    return TileGeometry(block, samples, -(-quantiles // block), tiles, min(WEIGHT_GRAD_PROGRAMS, tiles))


def _triton():
    return triton_module("fitdqn.ops.iqn_triton")


def fused_kernel_takes(features: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels run for these dtypes (else the chunked maths runs, on any device)."""
    return runs_triton(features, dtypes=(dtype,))


# ---------------------------------------------------------------------------------------------- chunked maths
def cosine_embedding(taus: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """``taus [B, N]``, ``frequencies [E]`` (pi * i) -> ``[B, N, E]`` = cos(pi * i * tau), fp32 at least."""
    dtype = torch.promote_types(taus.dtype, torch.float32)
    return torch.cos(taus.to(dtype).unsqueeze(-1) * frequencies.to(dtype))


def compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The dtype autocast would give a matmul here (``default`` when autocast is off)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


def accumulate_dtype(features: torch.Tensor) -> torch.dtype:
    """Outputs and gradient sums: fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(features.dtype, torch.float32)


def chunked_quantiles(features: torch.Tensor, taus: torch.Tensor, frequencies: torch.Tensor,
                      embed_w: torch.Tensor, embed_b: torch.Tensor, out_w: torch.Tensor, out_b: torch.Tensor,
                      dtype: torch.dtype, chunk: int = CHUNK) -> torch.Tensor:
    """Forward: ``features [B, d]``, ``taus [B, N]`` -> ``[B, N, O]`` (:func:`accumulate_dtype`), no autograd."""
    batch, quantiles = taus.shape
    out = torch.empty(batch, quantiles, out_w.shape[0], device=features.device, dtype=accumulate_dtype(features))
    with torch.autocast(features.device.type, enabled=False):
        w1, b1, w2, b2 = embed_w.to(dtype), embed_b.to(dtype), out_w.to(dtype), out_b.to(dtype)
        psi = _expand(features, min(chunk, quantiles), dtype)  # [B, c, d] contiguous
        for start in range(0, quantiles, chunk):
            cos = cosine_embedding(taus[:, start:start + chunk], frequencies).to(dtype)  # [B, c, E]
            h = _linear_relu(cos, w1, b1).mul_(psi[:, :cos.shape[1]])  # [B, c, d]
            out[:, start:start + chunk] = F.linear(h, w2, b2)  # [B, c, O]
            del cos, h
    return out


def chunked_quantile_grads(grad_out: torch.Tensor, features: torch.Tensor, taus: torch.Tensor,
                           frequencies: torch.Tensor, embed_w: torch.Tensor, embed_b: torch.Tensor,
                           out_w: torch.Tensor, dtype: torch.dtype, chunk: int = CHUNK
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward for ``grad_out [B, N, O]``: gradients of features ``[B, d]``, ``embed_w [d, E]``, ``out_w [O, d]``
    and ``out_b [O]``, all in :func:`accumulate_dtype` (``embed_b``'s is ``embed_w``'s first column)."""
    quantiles = taus.shape[1]
    acc = accumulate_dtype(features)
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
    grad_b2 = grad_out.sum(dim=(0, 1), dtype=acc)  # [O]
    return grad_x, grad_w1, grad_w2, grad_b2


def _expand(features: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """psi(s) repeated over a chunk of quantiles, contiguous: ``[B, d] -> [B, chunk, d]`` in ``dtype``."""
    return features.to(dtype).unsqueeze(1).expand(-1, chunk, -1).contiguous()


def _linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu(x @ weight.T + bias)`` for ``x [B, c, E]`` -> ``[B, c, d]``; on CUDA the ReLU runs in the
    GEMM's epilogue (cuBLASLt), so the pre-activation is never written. No autograd (manual backward)."""
    flat = torch._addmm_activation(bias, x.flatten(0, 1), weight.t())  # [B * c, d]
    return flat.view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------- forward

@torch.library.custom_op("fitdqn::iqn_quantile_head", mutates_args=())
def iqn_quantile_head(features: torch.Tensor, taus: torch.Tensor, frequencies: torch.Tensor,
                      embed_w: torch.Tensor, embed_b: torch.Tensor, out_w: torch.Tensor, out_b: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Quantile values ``[B, N, O]``; the default (CPU) kernel is the chunked maths."""
    return chunked_quantiles(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype)


@iqn_quantile_head.register_kernel("cuda")
def _quantiles_cuda(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype):
    if not fused_kernel_takes(features, dtype):
        return chunked_quantiles(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype)
    return _triton().fused_quantiles(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype)


@iqn_quantile_head.register_fake
def _quantiles_fake(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype):
    batch, quantiles = taus.shape
    return features.new_empty((batch, quantiles, out_w.shape[0]), dtype=accumulate_dtype(features))


# ---------------------------------------------------------------------------------------------- backward

@torch.library.custom_op("fitdqn::iqn_quantile_head_backward", mutates_args=())
def iqn_quantile_head_backward(grad_out: torch.Tensor, features: torch.Tensor, taus: torch.Tensor,
                               frequencies: torch.Tensor, embed_w: torch.Tensor, embed_b: torch.Tensor,
                               out_w: torch.Tensor, dtype: torch.dtype
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_out [B, N, O]`` -> grad features ``[B, d]`` (features' dtype), partial sums of the gradients of
    embed_w ``[P, d, E]``, out_w ``[P, O, d]`` and out_b ``[P, O]`` (module docstring). Default (CPU) kernel: the
    chunked maths."""
    return _chunked_grads(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype)


@iqn_quantile_head_backward.register_kernel("cuda")
def _grads_cuda(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype):
    if not fused_kernel_takes(features, dtype):
        return _chunked_grads(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype)
    return _triton().fused_quantile_grads(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype)


@iqn_quantile_head_backward.register_fake
def _grads_fake(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype):
    programs = tile_geometry(*taus.shape).programs
    acc = accumulate_dtype(features)
    (d_model, embedding), outputs = embed_w.shape, out_w.shape[0]
    return (features.new_empty(features.shape),
            features.new_empty((programs, d_model, embedding), dtype=acc),
            features.new_empty((programs, outputs, d_model), dtype=acc),
            features.new_empty((programs, outputs), dtype=acc))


def _chunked_grads(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype):
    """The backward op's contract from the chunked maths: grad features in their dtype, the exact weight
    gradients in partial row 0."""
    grad_x, grad_w1, grad_w2, grad_b2 = chunked_quantile_grads(
        grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype)
    programs = tile_geometry(*taus.shape).programs
    return (grad_x.to(features.dtype), _in_row_zero(grad_w1, programs), _in_row_zero(grad_w2, programs),
            _in_row_zero(grad_b2, programs))


def _in_row_zero(total: torch.Tensor, programs: int) -> torch.Tensor:
    """``total`` as ``[programs, *shape]`` partial sums: itself in row 0, zeros in the others."""
    parts = total.new_zeros((programs, *total.shape))
    if programs:
        parts[0] = total
    return parts


# ---------------------------------------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output) -> None:
    features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype = inputs
    ctx.save_for_backward(features, taus, frequencies, embed_w, embed_b, out_w)  # inputs only
    ctx.dtype, ctx.out_b_dtype = dtype, out_b.dtype


def _backward(ctx, grad_out):  # grad_out [B, N, O]
    features, taus, frequencies, embed_w, embed_b, out_w = ctx.saved_tensors
    grad_x, w1_parts, w2_parts, b2_parts = torch.ops.fitdqn.iqn_quantile_head_backward(
        grad_out, features, taus, frequencies, embed_w, embed_b, out_w, ctx.dtype)
    grad_w1 = w1_parts.sum(0)  # [d, E]
    grad_b1 = grad_w1[:, 0].clone()  # cos(pi * 0 * tau) = 1: the bias is the first column's twin
    return (grad_x, None, None, grad_w1.to(embed_w.dtype), grad_b1.to(embed_b.dtype),  # grad_x: features' dtype
            w2_parts.sum(0).to(out_w.dtype), b2_parts.sum(0).to(ctx.out_b_dtype), None)


iqn_quantile_head.register_autograd(_backward, setup_context=_setup_context)
