"""Triton kernels of the fused IQN head (``fitdqn::iqn_quantile_head`` on CUDA): nothing ``[B, N, d]`` is written.

Rows are (sample, quantile) pairs; a tile is ``TILE_ROWS`` = 64 of them: S = 64 / BN whole samples x BN
quantiles (BN = N rounded up to a power of two, at most 64; a larger N takes several quantile blocks per
sample). The model width d is walked in slices of D columns (64 forward, 128 backward), E (64) and O (15) are
padded to powers of two of at least 16 (``tl.dot``'s smallest). Numerics follow the chunked path: cosines in fp32 from
the taus, then every ``tl.dot`` takes ``dtype`` inputs (bf16 under autocast) and accumulates in fp32;
phi = relu(pre) and h = phi * psi are rounded to ``dtype`` as the chunked path's tensors are. The chunked path
also rounds each GEMM's output (Z, dh, per-chunk weight gradients) to ``dtype``; these kernels keep them fp32.

Forward (``_forward_kernel``), grid ``[tiles, quantile blocks]``, one tile per program:
cos ``[64, E]`` in registers; per d slice: ``pre = cos @ embed_w.T + embed_b``, ``phi = relu(pre)``,
``h = phi * psi[b]``, ``out += h @ out_w.T`` (``[64, 16]`` fp32); then ``out + out_b`` is stored ``[B, N, O]``.

Backward (``_backward_kernel_t``), grid ``[P, d / D]``: program (p, c) owns d slice c and whole samples (tiles p,
p + P, ...), so it writes grad features ``[B, d]`` itself, no atomics, and stores its weight gradients, summed in
fp32 registers, once into its row of the ``[P, ...]`` partial sums (the op's autograd backward sums them over P).
It holds every tile transposed, the d slice as the rows of each product (the flash-attention layout):
``pre^T = embed_w[c] @ cos^T`` ``[D, R]``, ``dh^T = out_w[:, c]^T @ g^T``,
``grad_features[b, c] = sum over the row axis of dh^T * phi^T`` (within a warp: no shared-memory reduction),
``grad embed_w += d_pre^T @ cos`` and ``grad out_w^T += h^T @ g``: each product's left operand comes straight from
the registers of the one before, all four are 64-row wgmma products (out_w's is ``[D, O]``, not ``[O, D]``: 16 rows
and mma.sync), and cos is made once a tile, one copy in shared memory read by both products that take it. Compiled
for sm_90 by Triton 3.6 (cuobjdump resource usage), at 128 columns and 8 warps it takes 255 registers and 72 bytes
of stack (32 of them libdevice's cosine); a row-major layout of the same maths spilled 1008 bytes a thread and
took 0.58 ms where this one takes 0.37 ms (B = 8192, H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.iqn import tile_geometry
from fitdqn.ops.kernels import on_device

# Launch shapes, timed on an H200 (Triton 3.6, bf16, B = 8192, N = 64, d = 256; benchmarks/tune_kernels.py at
# 7ca0b9d): forward 0.165 ms at 64-column slices, 4 warps, 2 stages (3 stages 0.183, 128 columns 0.194,
# 8 warps 0.323). Backward at 256 columns (the whole d = 256 in one slice), 16 warps, 2 stages: alone 0.37 ms at
# B = 8192 against 0.58 ms at 128 columns and 8 warps, and inside the whole graphed update 3.40 against 3.63 ms at
# 8192, 1.27 against 1.30 ms at 1024 (benchmarks/update_vs_compile.py, the full widths, H200, at 21737dc)
FORWARD_BLOCK_D, FORWARD_WARPS, FORWARD_STAGES = 64, 4, 2
TRANSPOSED_BLOCK_D, TRANSPOSED_WARPS, TRANSPOSED_STAGES = 256, 16, 2
# a head narrower than that slice keeps the tile it was timed with (the small networks' d = 64: 128 columns,
# 8 warps), not three quarters of a wide tile masked off
NARROW_BLOCK_D, NARROW_WARPS = 128, 8
PRECISION = "ieee"  # fp32 compute (no autocast): exact fp32 products, like torch's default matmul
_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def fused_quantiles(features: torch.Tensor, taus: torch.Tensor, frequencies: torch.Tensor, embed_w: torch.Tensor,
                    embed_b: torch.Tensor, out_w: torch.Tensor, out_b: torch.Tensor, dtype: torch.dtype
                    ) -> torch.Tensor:
    """``features [B, d]``, ``taus [B, N]`` -> ``[B, N, O]`` fp32, matmuls in ``dtype``."""
    batch, quantiles = taus.shape
    (d_model, embedding), outputs = embed_w.shape, out_w.shape[0]
    out = torch.empty(batch, quantiles, outputs, device=features.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    geometry = tile_geometry(batch, quantiles)
    with on_device(features):
        _forward_kernel[(geometry.tiles, geometry.quantile_blocks)](
            features, features.stride(0), features.stride(1), taus, taus.stride(0), taus.stride(1), frequencies,
            embed_w.contiguous(), embed_b, out_w.contiguous(), out_b, out,
            batch, quantiles, embedding, d_model, outputs,
            **_blocks(geometry, embedding, outputs, dtype), BLOCK_D=FORWARD_BLOCK_D, num_warps=FORWARD_WARPS,
            num_stages=FORWARD_STAGES,
        )
    return out


def fused_quantile_grads(grad_out: torch.Tensor, features: torch.Tensor, taus: torch.Tensor,
                         frequencies: torch.Tensor, embed_w: torch.Tensor, embed_b: torch.Tensor,
                         out_w: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_out [B, N, O]`` -> grad features ``[B, d]`` in the features' dtype (summed in fp32, rounded once at
    the store) and partial sums ``[P, d, E]``, ``[P, O, d]``, ``[P, O]`` fp32 of the gradients of embed_w, out_w
    and out_b (``fitdqn.ops.iqn``)."""
    batch, quantiles = taus.shape
    (d_model, embedding), outputs = embed_w.shape, out_w.shape[0]
    geometry = tile_geometry(batch, quantiles)
    programs = geometry.programs
    empty = lambda *shape: torch.empty(shape, device=features.device, dtype=torch.float32)  # noqa: E731
    grad_x = torch.empty(batch, d_model, device=features.device, dtype=features.dtype)  # [B, d]
    w1_parts, w2_parts, b2_parts = empty(programs, d_model, embedding), empty(programs, outputs, d_model), \
        empty(programs, outputs)  # [P, d, E], [P, O, d], [P, O]
    if programs == 0 or quantiles == 0:  # no rows: zero gradients, nothing to launch
        return grad_x.zero_(), w1_parts.zero_(), w2_parts.zero_(), b2_parts.zero_()
    arguments = (grad_out, grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
                 features, features.stride(0), features.stride(1), taus, taus.stride(0), taus.stride(1), frequencies,
                 embed_w.contiguous(), embed_b, out_w.contiguous(),
                 grad_x, w1_parts, w2_parts, b2_parts,
                 batch, quantiles, embedding, d_model, outputs, geometry.tiles, programs)
    blocks = _blocks(geometry, embedding, outputs, dtype)
    with on_device(features):
        block_d, warps = _transposed_tile(d_model)
        _backward_kernel_t[(programs, triton.cdiv(d_model, block_d))](
            *arguments, **blocks, BLOCK_D=block_d, num_warps=warps, num_stages=TRANSPOSED_STAGES)
    return grad_x, w1_parts, w2_parts, b2_parts


def _transposed_tile(d_model: int) -> tuple[int, int]:
    """Columns per slice and warps of the backward for a head of width ``d_model``."""
    if d_model >= TRANSPOSED_BLOCK_D:
        return TRANSPOSED_BLOCK_D, TRANSPOSED_WARPS
    return NARROW_BLOCK_D, NARROW_WARPS


def _blocks(geometry, embedding: int, outputs: int, dtype: torch.dtype) -> dict:
    return dict(SAMPLES=geometry.samples, BLOCK_N=geometry.block_quantiles,
                BLOCK_E=max(16, triton.next_power_of_2(embedding)),
                BLOCK_O=max(16, triton.next_power_of_2(outputs)), COMPUTE=_TRITON_DTYPES[dtype], PRECISION=PRECISION)


@triton.jit
def _rows(tile, quantile_block, batch, quantiles, SAMPLES: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's rows: sample and quantile indices ``[S * BN]`` and which of them exist."""
    row = tl.arange(0, SAMPLES * BLOCK_N)
    sample = tile * SAMPLES + row // BLOCK_N
    quantile = quantile_block * BLOCK_N + row % BLOCK_N
    return sample, quantile, (sample < batch) & (quantile < quantiles)


@triton.jit
def _cosines(taus_ptr, stride_tb, stride_tn, frequencies_ptr, sample, quantile, valid, embedding,
             BLOCK_E: tl.constexpr, COMPUTE: tl.constexpr):
    """``cos(pi * i * tau)`` ``[rows, E]``: fp32 from the taus, then rounded to the compute dtype."""
    tau = tl.load(taus_ptr + sample * stride_tb + quantile * stride_tn, mask=valid, other=0.0).to(tl.float32)
    e = tl.arange(0, BLOCK_E)
    frequency = tl.load(frequencies_ptr + e, mask=e < embedding, other=0.0).to(tl.float32)  # pi * i
    return tl.cos(tau[:, None] * frequency[None, :]).to(COMPUTE)


@triton.jit
def _features(features_ptr, stride_fb, stride_fd, tile, columns, batch, d_model, SAMPLES: tl.constexpr,
              BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    """psi(s) of the tile's samples on a d slice, loaded once per sample (``[S, D]``) and repeated over each
    sample's rows: ``[rows, D]`` in the compute dtype."""
    samples = tile * SAMPLES + tl.arange(0, SAMPLES)
    mask = (samples < batch)[:, None] & (columns < d_model)[None, :]
    psi = tl.load(features_ptr + samples[:, None] * stride_fb + columns[None, :] * stride_fd, mask=mask, other=0.0)
    psi = psi.to(COMPUTE)  # [S, D]
    if SAMPLES == 1:
        return tl.broadcast_to(psi, (BLOCK_N, psi.shape[1]))
    return tl.reshape(tl.broadcast_to(psi[:, None, :], (SAMPLES, BLOCK_N, psi.shape[1])),
                      (SAMPLES * BLOCK_N, psi.shape[1]))


@triton.jit
def _forward_kernel(
    features_ptr, stride_fb, stride_fd, taus_ptr, stride_tb, stride_tn, frequencies_ptr,
    embed_w_ptr, embed_b_ptr, out_w_ptr, out_b_ptr, out_ptr,
    batch, quantiles, embedding, d_model, outputs,
    SAMPLES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_O: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):
    sample, quantile, valid = _rows(tl.program_id(0), tl.program_id(1), batch, quantiles, SAMPLES, BLOCK_N)
    cos = _cosines(taus_ptr, stride_tb, stride_tn, frequencies_ptr, sample, quantile, valid, embedding,
                   BLOCK_E, COMPUTE)  # [R, E]
    e = tl.arange(0, BLOCK_E)
    o = tl.arange(0, BLOCK_O)
    out = tl.zeros((SAMPLES * BLOCK_N, BLOCK_O), dtype=tl.float32)  # [R, O]
    for start in range(0, d_model, BLOCK_D):
        columns = start + tl.arange(0, BLOCK_D)
        column_ok = columns < d_model
        w1t = tl.load(embed_w_ptr + columns[None, :] * embedding + e[:, None],
                      mask=column_ok[None, :] & (e[:, None] < embedding), other=0.0).to(COMPUTE)  # [E, D]
        b1 = tl.load(embed_b_ptr + columns, mask=column_ok, other=0.0).to(COMPUTE).to(tl.float32)  # [D]
        pre = tl.dot(cos, w1t, input_precision=PRECISION) + b1[None, :]  # [R, D] fp32
        phi = tl.maximum(pre, 0.0).to(COMPUTE).to(tl.float32)
        psi = _features(features_ptr, stride_fb, stride_fd, tl.program_id(0), columns, batch, d_model, SAMPLES,
                        BLOCK_N, COMPUTE)
        h = (phi * psi.to(tl.float32)).to(COMPUTE)  # [R, D]
        w2t = tl.load(out_w_ptr + o[None, :] * d_model + columns[:, None],
                      mask=column_ok[:, None] & (o[None, :] < outputs), other=0.0).to(COMPUTE)  # [D, O]
        out = tl.dot(h, w2t, out, input_precision=PRECISION)
    b2 = tl.load(out_b_ptr + o, mask=o < outputs, other=0.0).to(COMPUTE).to(tl.float32)  # [O]
    out = out + b2[None, :]
    row = sample * quantiles + quantile
    tl.store(out_ptr + row[:, None] * outputs + o[None, :], out, mask=valid[:, None] & (o[None, :] < outputs))


@triton.jit
def _backward_kernel_t(
    grad_ptr, stride_gb, stride_gn, stride_go, features_ptr, stride_fb, stride_fd, taus_ptr, stride_tb, stride_tn,
    frequencies_ptr, embed_w_ptr, embed_b_ptr, out_w_ptr,
    grad_features_ptr, w1_parts_ptr, w2_parts_ptr, b2_parts_ptr,
    batch, quantiles, embedding, d_model, outputs, tiles, programs,
    SAMPLES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_O: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):
    """The backward with the model width as the rows of every product (``[D, R]`` tiles, R = the tile's rows)."""
    program = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    column_ok = columns < d_model
    e = tl.arange(0, BLOCK_E)
    o = tl.arange(0, BLOCK_O)
    w1 = tl.load(embed_w_ptr + columns[:, None] * embedding + e[None, :],
                 mask=column_ok[:, None] & (e[None, :] < embedding), other=0.0).to(COMPUTE)  # [D, E]
    b1 = tl.load(embed_b_ptr + columns, mask=column_ok, other=0.0).to(COMPUTE).to(tl.float32)  # [D]
    w2t = tl.load(out_w_ptr + o[None, :] * d_model + columns[:, None],
                  mask=(o[None, :] < outputs) & column_ok[:, None], other=0.0).to(COMPUTE)  # [D, O]
    grad_w1 = tl.zeros((BLOCK_D, BLOCK_E), dtype=tl.float32)  # [D, E]
    grad_w2t = tl.zeros((BLOCK_D, BLOCK_O), dtype=tl.float32)  # [D, O]
    grad_b2 = tl.zeros((BLOCK_O,), dtype=tl.float32)  # [O]
    for tile in range(program, tiles, programs):
        grad_psi = tl.zeros((BLOCK_D, SAMPLES), dtype=tl.float32)  # [D, S]
        for quantile_block in range(0, tl.cdiv(quantiles, BLOCK_N)):
            sample, quantile, valid = _rows(tile, quantile_block, batch, quantiles, SAMPLES, BLOCK_N)
            cos = _cosines(taus_ptr, stride_tb, stride_tn, frequencies_ptr, sample, quantile, valid, embedding,
                           BLOCK_E, COMPUTE)  # [R, E]
            pre = tl.dot(w1, tl.trans(cos), input_precision=PRECISION) + b1[:, None]  # [D, R]
            phi = tl.maximum(pre, 0.0).to(COMPUTE).to(tl.float32)  # [D, R]
            psi = tl.trans(_features(features_ptr, stride_fb, stride_fd, tile, columns, batch, d_model, SAMPLES,
                                     BLOCK_N, COMPUTE)).to(tl.float32)  # [D, R]
            g = tl.load(grad_ptr + sample[:, None] * stride_gb + quantile[:, None] * stride_gn + o[None, :] * stride_go,
                        mask=valid[:, None] & (o[None, :] < outputs), other=0.0).to(tl.float32)  # [R, O]
            grad_b2 += tl.sum(g, axis=0)
            g = g.to(COMPUTE)
            d_h = tl.dot(w2t, tl.trans(g), input_precision=PRECISION)  # [D, R]: gradient w.r.t. h = phi * psi
            if SAMPLES == 1:
                grad_psi += tl.sum(d_h * phi, axis=1)[:, None]
            else:
                grad_psi += tl.sum(tl.reshape(d_h * phi, (BLOCK_D, SAMPLES, BLOCK_N)), axis=2)
            grad_w2t = tl.dot((phi * psi).to(COMPUTE), g, grad_w2t, input_precision=PRECISION)  # [D, O]
            d_pre = tl.where(phi > 0, d_h * psi, 0.0).to(COMPUTE)  # [D, R]: through the product and ReLU
            grad_w1 = tl.dot(d_pre, cos, grad_w1, input_precision=PRECISION)  # [D, E]
        samples = tile * SAMPLES + tl.arange(0, SAMPLES)
        tl.store(grad_features_ptr + samples[None, :] * d_model + columns[:, None],
                 grad_psi.to(grad_features_ptr.dtype.element_ty),
                 mask=(samples < batch)[None, :] & column_ok[:, None])
    tl.store(w1_parts_ptr + program * d_model * embedding + columns[:, None] * embedding + e[None, :], grad_w1,
             mask=column_ok[:, None] & (e[None, :] < embedding))
    tl.store(w2_parts_ptr + program * outputs * d_model + o[None, :] * d_model + columns[:, None], grad_w2t,
             mask=(o[None, :] < outputs) & column_ok[:, None])
    if tl.program_id(1) == 0:  # every d slice summed the same g: one stores it
        tl.store(b2_parts_ptr + program * outputs + o, grad_b2, mask=o < outputs)
