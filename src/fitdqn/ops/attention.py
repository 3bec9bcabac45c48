"""The core of :class:`fitdqn.nets.attention.LastTokenAttention` as one PyTorch operator,
``fitdqn::last_token_attention``, with its backward as a second one.

``last_token_attention(q [B, d], kv [B, W, 2 d], heads) -> [B, d]`` (kv's dtype): everything between the
projections. With ``dh = d / heads``, k = ``kv[:, :, :d]`` and v = ``kv[:, :, d:]`` viewed ``[B, W, H, dh]``:

    scores[b, w, h] = <q[b, h, :], k[b, w, h, :]> / sqrt(dh)      (fp32; fp64 for fp64 inputs)
    p = softmax over the W tokens of scores                        (likewise)
    out[b, h, :] = sum_w p[b, w, h] v[b, w, h, :]

``last_token_attention_backward(grad_out [B, d], q, kv, heads) -> (grad_q [B, d], grad_kv [B, W, 2 d])`` in
the dtypes of q and kv, accumulated in fp32 (fp64 for fp64 inputs). With g = grad_out viewed ``[B, H, dh]``:

    dv[b, w, h, :] = p[b, w, h] g[b, h, :]           dp[b, w, h] = <g[b, h, :], v[b, w, h, :]>
    ds = p * (dp - sum_w p dp)                        dk[b, w, h, :] = ds[b, w, h] q[b, h, :] / sqrt(dh)
    dq[b, h, :] = sum_w ds[b, w, h] k[b, w, h, :] / sqrt(dh)

Kernels: on CUDA the Triton kernels of :mod:`fitdqn.ops.attention_triton` when q and kv are bf16, fp16 or
fp32 (:data:`fitdqn.ops.kernels.FUSED_DTYPES`); everywhere else (and for fp64 on CUDA) the plain torch maths
(:func:`attention_core`, the elementwise code of ``LastTokenAttention.reference``, and the closed-form
gradient :func:`attention_core_grads`).

Why an operator (as ``fitdqn::iqn_quantile_head``): the memory planner traces the update on fake tensors
(``fitdqn.memory.trace``, often fake *CPU* tensors standing in for CUDA ones) and counts every storage an op
returns. The fake kernels (``register_fake``) allocate exactly what the Triton path allocates, whatever device
the fake tensors claim:

- forward: the output ``[B, d]`` in kv's dtype; autograd saves only the inputs q ``[B, d]`` and kv
  ``[B, W, 2 d]`` (the backward recomputes the W x H scores and weights of each sample: 32 numbers at W = 8,
  H = 4, cheaper to recompute than to store);
- backward op: grad_q ``[B, d]`` in q's dtype and grad_kv ``[B, W, 2 d]`` in kv's dtype, every element
  written by the kernel (no zero fill, no [B, W, 2 d] temporaries besides it).
"""

from __future__ import annotations

import torch

from fitdqn.ops.kernels import runs_triton, triton_module


def _triton():
    return triton_module("fitdqn.ops.attention_triton")


def triton_takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the Triton kernels take these dtypes (else the torch maths runs, on any device)."""
    return runs_triton(q, kv)


def check_shapes(q: torch.Tensor, kv: torch.Tensor, heads: int) -> None:
    """q ``[B, d]``, kv ``[B, W, 2 d]``, d divisible by ``heads``: else ValueError."""
    if q.dim() != 2 or kv.dim() != 3 or kv.shape[0] != q.shape[0] or kv.shape[2] != 2 * q.shape[1]:
        raise ValueError(f"last_token_attention wants q [B, d] and kv [B, W, 2 d], got {tuple(q.shape)} and "
                         f"{tuple(kv.shape)}")
    if heads < 1 or q.shape[1] % heads:
        raise ValueError(f"d_model {q.shape[1]} is not divisible by {heads} heads")


def attention_core(q: torch.Tensor, kv: torch.Tensor, heads: int) -> torch.Tensor:
    """``q [B, d]``, ``kv [B, W, 2 d]`` -> ``[B, d]``: the elementwise maths of ``LastTokenAttention.reference``
    (same ops, same roundings: bf16 products and weights under autocast), but with fp64 scores for fp64 inputs
    (the module's are fp32 whatever the inputs)."""
    batch, window, _ = kv.shape
    d_model = q.shape[1]
    head_dim = d_model // heads
    q = q.reshape(batch, 1, heads, head_dim)  # [B, 1, H, dh] (a view of the contiguous projection)
    kv = kv.reshape(batch, window, 2, heads, head_dim)  # [B, W, 2, H, dh]
    k, v = kv[:, :, 0], kv[:, :, 1]  # [B, W, H, dh] each
    acc = torch.promote_types(torch.promote_types(q.dtype, kv.dtype), torch.float32)
    scores = (k * q).sum(-1, dtype=acc) * head_dim**-0.5  # [B, W, H]
    weights = torch.softmax(scores, dim=1).to(v.dtype)  # [B, W, H]: over the W tokens
    return (weights.unsqueeze(-1) * v).sum(1).reshape(batch, d_model)  # [B, d]


def attention_core_grads(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, heads: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed-form gradients (module docstring) in fp32 (fp64 for fp64 inputs): grad_q ``[B, d]`` in q's
    dtype, grad_kv ``[B, W, 2 d]`` in kv's dtype."""
    batch, window, _ = kv.shape
    d_model = q.shape[1]
    head_dim = d_model // heads
    scale = head_dim**-0.5
    acc = torch.promote_types(torch.promote_types(q.dtype, kv.dtype), torch.float32)
    qf = q.to(acc).reshape(batch, 1, heads, head_dim)  # [B, 1, H, dh]
    g = grad_out.to(acc).reshape(batch, 1, heads, head_dim)  # [B, 1, H, dh]
    kvf = kv.to(acc).reshape(batch, window, 2, heads, head_dim)
    k, v = kvf[:, :, 0], kvf[:, :, 1]  # [B, W, H, dh] each
    p = torch.softmax((k * qf).sum(-1) * scale, dim=1)  # [B, W, H]
    dp = (v * g).sum(-1)  # [B, W, H]
    ds = p * (dp - (p * dp).sum(1, keepdim=True))  # [B, W, H]
    grad_q = (ds.unsqueeze(-1) * k).sum(1).reshape(batch, d_model) * scale  # [B, d]
    grad_k = ds.unsqueeze(-1) * qf * scale  # [B, W, H, dh]
    grad_v = p.unsqueeze(-1) * g  # [B, W, H, dh]
    grad_kv = torch.stack((grad_k, grad_v), dim=2).reshape(batch, window, 2 * d_model)  # [B, W, 2 d]
    return grad_q.to(q.dtype), grad_kv.to(kv.dtype)


# ---------------------------------------------------------------------------------------------- forward

@torch.library.custom_op("fitdqn::last_token_attention", mutates_args=())
def last_token_attention(q: torch.Tensor, kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Attention of the last token over the W tokens ``[B, d]``; the default (CPU) kernel is the torch maths."""
    check_shapes(q, kv, heads)
    return attention_core(q, kv, heads)


@last_token_attention.register_kernel("cuda")
def _attention_cuda(q, kv, heads):
    check_shapes(q, kv, heads)
    if not triton_takes(q, kv):
        return attention_core(q, kv, heads)
    return _triton().fused_attention(q, kv, heads)


@last_token_attention.register_fake
def _attention_fake(q, kv, heads):
    check_shapes(q, kv, heads)
    return kv.new_empty((kv.shape[0], kv.shape[2] // 2))  # [B, d], kv's dtype


# ---------------------------------------------------------------------------------------------- backward

@torch.library.custom_op("fitdqn::last_token_attention_backward", mutates_args=())
def last_token_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, heads: int
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_out [B, d]`` -> grad_q ``[B, d]`` (q's dtype), grad_kv ``[B, W, 2 d]`` (kv's dtype). Default (CPU)
    kernel: the closed form in torch maths."""
    check_shapes(q, kv, heads)
    return attention_core_grads(grad_out, q, kv, heads)


@last_token_attention_backward.register_kernel("cuda")
def _grads_cuda(grad_out, q, kv, heads):
    check_shapes(q, kv, heads)
    if not triton_takes(q, kv):
        return attention_core_grads(grad_out, q, kv, heads)
    return _triton().fused_attention_grads(grad_out, q, kv, heads)


@last_token_attention_backward.register_fake
def _grads_fake(grad_out, q, kv, heads):
    check_shapes(q, kv, heads)
    return q.new_empty(q.shape), kv.new_empty(kv.shape)  # [B, d] q's dtype, [B, W, 2 d] kv's dtype


# ---------------------------------------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output) -> None:
    q, kv, heads = inputs
    ctx.save_for_backward(q, kv)  # the inputs only: scores and weights are recomputed
    ctx.heads = heads


def _backward(ctx, grad_out):  # grad_out [B, d]
    q, kv = ctx.saved_tensors
    grad_q, grad_kv = torch.ops.fitdqn.last_token_attention_backward(grad_out, q, kv, ctx.heads)
    return grad_q, grad_kv, None


last_token_attention.register_autograd(_backward, setup_context=_setup_context)
