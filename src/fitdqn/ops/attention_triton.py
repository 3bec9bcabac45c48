"""Triton kernels of the fused last-token attention (``fitdqn::last_token_attention`` on CUDA): one pass over kv.

Memory-bound and tiny per sample (at W = 8, H = 4, dh = 64: 32 scores against 4096 kv numbers), so the kernels
are built around reading kv once and writing each result once. A program owns a block of ``S`` samples x all
H heads; its tiles are ``[S, H, dh]`` (H and dh padded to powers of two, masked; the last, contiguous, axis
is d, so loads and stores are coalesced along the model width). ``S`` is ``FORWARD_BLOCK_B`` /
``BACKWARD_BLOCK_B``, fewer for wide models (at most ``TILE_ELEMENTS`` numbers a tile) or, in backward, long
windows (at most ``SCORE_ELEMENTS`` scores a program). Grid ``[ceil(B / S)]``. Everything is fp32 in registers
from the loaded q, kv and grad_out (any of bf16, fp16, fp32, and strided), rounded once at the store. Scores
are kept in log2 units (scaled by ``log2(e) / sqrt(dh)``) for ``exp2``.

Forward (``_forward_kernel``): q ``[S, H, dh]`` once; token 0's k, v start the running max ``m``, sum ``l``
(``total``) and output ``acc``; per further token w the online softmax: ``s = <q, k_w>``, ``m' = max(m, s)``,
``l = l 2^(m - m') + 2^(s - m')``, ``acc = acc 2^(m - m') + 2^(s - m') v_w``; the output is ``acc / l``.

Backward (``_backward_kernel``), nothing saved but q and kv, so the scores are recomputed: one pass over the W
tokens reads k_w and v_w once each, computing ``s_w = <q, k_w>`` and ``dp_w = <g, v_w>`` (both ``[S, H]``, kept
in ``[S, W, H]`` register tiles) and, with the same online rescaling, ``l``, ``sum_w e_w c_w``,
``sum_w e_w c_w k_w`` and ``sum_w e_w k_w`` (e_w = unnormalised weights, c_w = dp_w - dp_0: shifting by token
0's dp keeps the difference below from cancelling when the dp are all alike). Then
``grad_q = scale (sum_w e_w c_w k_w - mean_c sum_w e_w k_w) / l`` with ``mean_c = sum_w e_w c_w / l`` is stored,
and a second loop over the tokens, reading nothing, stores ``dk_w = scale p_w (c_w - mean_c) q`` and
``dv_w = p_w g`` with ``p_w = 2^(s_w - m) / l``: every element of grad_kv, so it is allocated empty.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import on_device

# Launch shapes, not tuned: at these an H200 took 37 us a forward call and about 40 us a backward at B = 8192 (bf16;
# torch.profiler of the eager update, at 137ef01), next to 1.3 ms for the IQN backward. From the sm_90 compile of
# Triton 3.9 (bf16, d = 256, H = 4, W = 8, 16-byte aligned rows; cuobjdump --dump-resource-usage): the forward at
# [8, 4, 64] tiles and 4 warps (16 numbers a thread a tile, two 16-byte loads) takes 64 registers, the backward at
# [4, 4, 64] and 4 warps 64 (at [8, 4, 64]: 123); no spills, no shared memory, every load and store a 16-byte
# vector. The token loops' loads are not software-pipelined (the stages change nothing here). B = 8192: 1024
# forward, 2048 backward programs.
FORWARD_BLOCK_B, FORWARD_WARPS, FORWARD_STAGES = 8, 4, 2
BACKWARD_BLOCK_B, BACKWARD_WARPS, BACKWARD_STAGES = 4, 4, 2
TILE_ELEMENTS = 2048  # at most S x H x dh (padded) numbers a tile (16 a thread at 4 warps): fewer samples for wide d
SCORE_ELEMENTS = 2048  # backward: at most S x W x H (padded) scores a program (and as many dp)
LOG2E = 1.4426950408889634


def fused_attention(q: torch.Tensor, kv: torch.Tensor, heads: int) -> torch.Tensor:
    """``q [B, d]``, ``kv [B, W, 2 d]`` -> ``[B, d]`` in kv's dtype (``fitdqn.ops.attention``)."""
    batch, window, _ = kv.shape
    d_model = q.shape[1]
    out = torch.empty(batch, d_model, device=kv.device, dtype=kv.dtype)  # [B, d]
    if out.numel() == 0:
        return out
    if window == 0:  # a sum over no tokens
        return out.zero_()
    blocks = _blocks(d_model, heads, window, FORWARD_BLOCK_B, backward=False)
    with on_device(kv):
        _forward_kernel[(triton.cdiv(batch, blocks["BLOCK_B"]),)](
            q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), kv.stride(2), out,
            batch, window, LOG2E / math.sqrt(d_model // heads),
            **blocks, num_warps=FORWARD_WARPS, num_stages=FORWARD_STAGES,
        )
    return out


def fused_attention_grads(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, heads: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_out [B, d]`` -> grad_q ``[B, d]`` in q's dtype and grad_kv ``[B, W, 2 d]`` in kv's dtype."""
    batch, window, _ = kv.shape
    d_model = q.shape[1]
    grad_q = torch.empty(batch, d_model, device=q.device, dtype=q.dtype)  # [B, d]
    grad_kv = torch.empty(kv.shape, device=kv.device, dtype=kv.dtype)  # [B, W, 2 d]: every element written
    if grad_q.numel() == 0:
        return grad_q, grad_kv
    if window == 0:  # the output was zeros, whatever q
        return grad_q.zero_(), grad_kv
    blocks = _blocks(d_model, heads, window, BACKWARD_BLOCK_B, backward=True)
    scale = 1.0 / math.sqrt(d_model // heads)
    with on_device(kv):
        _backward_kernel[(triton.cdiv(batch, blocks["BLOCK_B"]),)](
            grad_out, grad_out.stride(0), grad_out.stride(1), q, q.stride(0), q.stride(1),
            kv, kv.stride(0), kv.stride(1), kv.stride(2), grad_q, grad_kv,
            batch, window, scale, scale * LOG2E,
            **blocks, BLOCK_W=triton.next_power_of_2(window), num_warps=BACKWARD_WARPS, num_stages=BACKWARD_STAGES,
        )
    return grad_q, grad_kv


def _blocks(d_model: int, heads: int, window: int, block_b: int, backward: bool) -> dict:
    """The tile's constexprs: S samples (a power of two) x BLOCK_H heads x BLOCK_DH head columns."""
    head_dim = d_model // heads
    block_h, block_dh = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    samples = min(block_b, max(1, TILE_ELEMENTS // (block_h * block_dh)))
    if backward:
        samples = min(samples, max(1, SCORE_ELEMENTS // (triton.next_power_of_2(window) * block_h)))
    return dict(HEADS=heads, HEAD_DIM=head_dim, BLOCK_B=1 << (samples.bit_length() - 1), BLOCK_H=block_h,
                BLOCK_DH=block_dh, PADDED=block_h != heads or block_dh != head_dim)


@triton.jit
def _tile(batch, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
          BLOCK_DH: tl.constexpr, PADDED: tl.constexpr):
    """The program's samples ``[S, 1, 1]`` (int64), columns ``h * dh + j`` of d ``[1, H, dh]`` and which
    (sample, column) pairs exist."""
    sample = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)[:, None, None]
    head = tl.arange(0, BLOCK_H)[None, :, None]
    j = tl.arange(0, BLOCK_DH)[None, None, :]
    valid = sample < batch
    if PADDED:
        valid = valid & (head < HEADS) & (j < HEAD_DIM)
    return sample, head * HEAD_DIM + j, valid


@triton.jit
def _forward_kernel(
    q_ptr, stride_qb, stride_qd, kv_ptr, stride_kb, stride_kw, stride_kd, out_ptr,
    batch, window, score_scale,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr, PADDED: tl.constexpr,
):
    sample, column, valid = _tile(batch, HEADS, HEAD_DIM, BLOCK_B, BLOCK_H, BLOCK_DH, PADDED)
    q = tl.load(q_ptr + sample * stride_qb + column * stride_qd, mask=valid, other=0.0).to(tl.float32)  # [S, H, dh]
    key = kv_ptr + sample * stride_kb + column * stride_kd  # token 0's k [S, H, dh]
    value = key + HEADS * HEAD_DIM * stride_kd  # token 0's v
    k = tl.load(key, mask=valid, other=0.0).to(tl.float32)
    m = tl.sum(q * k, axis=2) * score_scale  # [S, H]: running max of the scores (log2 units)
    total = tl.full((BLOCK_B, BLOCK_H), 1.0, tl.float32)  # [S, H]: running sum of 2^(s - m)
    acc = tl.load(value, mask=valid, other=0.0).to(tl.float32)  # [S, H, dh]: running sum of 2^(s - m) v
    for w in range(1, window):
        k = tl.load(key + w * stride_kw, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(value + w * stride_kw, mask=valid, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=2) * score_scale  # [S, H]
        m_new = tl.maximum(m, s)
        alpha = tl.exp2(m - m_new)
        e = tl.exp2(s - m_new)
        total = total * alpha + e
        acc = acc * alpha[:, :, None] + e[:, :, None] * v
        m = m_new
    out = acc / total[:, :, None]
    tl.store(out_ptr + sample * (HEADS * HEAD_DIM) + column, out.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _backward_kernel(
    grad_ptr, stride_gb, stride_gd, q_ptr, stride_qb, stride_qd, kv_ptr, stride_kb, stride_kw, stride_kd,
    grad_q_ptr, grad_kv_ptr, batch, window, scale, score_scale,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr, PADDED: tl.constexpr, BLOCK_W: tl.constexpr,
):
    sample, column, valid = _tile(batch, HEADS, HEAD_DIM, BLOCK_B, BLOCK_H, BLOCK_DH, PADDED)
    q = tl.load(q_ptr + sample * stride_qb + column * stride_qd, mask=valid, other=0.0).to(tl.float32)  # [S, H, dh]
    g = tl.load(grad_ptr + sample * stride_gb + column * stride_gd, mask=valid, other=0.0).to(tl.float32)
    key = kv_ptr + sample * stride_kb + column * stride_kd  # token 0's k [S, H, dh]
    value = key + HEADS * HEAD_DIM * stride_kd  # token 0's v
    token = tl.arange(0, BLOCK_W)[None, :, None]  # [1, W, 1]
    # token 0 starts the running sums
    k = tl.load(key, mask=valid, other=0.0).to(tl.float32)
    m = tl.sum(q * k, axis=2) * score_scale  # [S, H]: running max of the scores (log2 units)
    shift = tl.sum(g * tl.load(value, mask=valid, other=0.0).to(tl.float32), axis=2)  # [S, H]: dp_0
    total = tl.full((BLOCK_B, BLOCK_H), 1.0, tl.float32)  # sum_w e_w
    ec = tl.zeros((BLOCK_B, BLOCK_H), dtype=tl.float32)  # sum_w e_w c_w (c_0 = 0)
    eck = tl.zeros((BLOCK_B, BLOCK_H, BLOCK_DH), dtype=tl.float32)  # sum_w e_w c_w k_w
    ek = k  # sum_w e_w k_w
    scores = tl.where(token == 0, m[:, None, :], 0.0)  # [S, W, H]: s_w
    centred = tl.zeros((BLOCK_B, BLOCK_W, BLOCK_H), dtype=tl.float32)  # [S, W, H]: c_w = dp_w - dp_0
    for w in range(1, window):
        k = tl.load(key + w * stride_kw, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(value + w * stride_kw, mask=valid, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=2) * score_scale  # [S, H]
        c = tl.sum(g * v, axis=2) - shift  # [S, H]
        m_new = tl.maximum(m, s)
        alpha = tl.exp2(m - m_new)
        e = tl.exp2(s - m_new)
        total = total * alpha + e
        ec = ec * alpha + e * c
        eck = eck * alpha[:, :, None] + (e * c)[:, :, None] * k
        ek = ek * alpha[:, :, None] + e[:, :, None] * k
        m = m_new
        scores = tl.where(token == w, s[:, None, :], scores)
        centred = tl.where(token == w, c[:, None, :], centred)
    inv_l = 1.0 / total
    mean_c = ec * inv_l  # [S, H]: sum_w p_w c_w
    grad_q = (eck - mean_c[:, :, None] * ek) * (inv_l * scale)[:, :, None]  # scale sum_w p_w (c_w - mean_c) k_w
    tl.store(grad_q_ptr + sample * (HEADS * HEAD_DIM) + column, grad_q.to(grad_q_ptr.dtype.element_ty), mask=valid)
    grad_key = grad_kv_ptr + sample * (window * 2 * HEADS * HEAD_DIM) + column  # token 0's dk [S, H, dh]
    for w in range(0, window):
        s = tl.sum(tl.where(token == w, scores, 0.0), axis=1)  # [S, H]
        c = tl.sum(tl.where(token == w, centred, 0.0), axis=1)
        p = tl.exp2(s - m) * inv_l
        ds = p * (c - mean_c) * scale
        row = grad_key + w * (2 * HEADS * HEAD_DIM)
        tl.store(row, (ds[:, :, None] * q).to(grad_kv_ptr.dtype.element_ty), mask=valid)
        tl.store(row + HEADS * HEAD_DIM, (p[:, :, None] * g).to(grad_kv_ptr.dtype.element_ty), mask=valid)
