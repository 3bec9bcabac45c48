"""Self-attention over the W bar tokens, evaluated for the last (current-bar) token only.

Choice: a 4-head self-attention block (d_model 256) with a residual connection and LayerNorm, whose output
is the representation of the *last* token ``[B, d_model]``: the current bar, having attended to the W bars
of the window (itself included). Only that token's output is used downstream, so only its query is
computed; keys and values are computed for all W tokens. This is exactly the last row of full W x W
self-attention (with or without a causal mask, the last token sees every token), at a fraction of the cost.

Memory per sample saved for backward (elements; bf16 under autocast = 2 bytes each):
- K/V projection output ``[W, 2 * d_model]`` (4096 for W = 8, d_model = 256: 8 KB) — the dominant term;
- query, attention weights ``[W, heads]`` (32 numbers), attention output, output projection, residual:
  ``[d_model]`` each at most;
- LayerNorm: the residual sum ``[d_model]`` in the compute dtype (bf16 under autocast: 512 B) and two fp32
  per-sample statistics (below).
A full-sequence block (queries, outputs, residuals for all W tokens) would keep about W times the
``[d_model]`` terms as well; nothing reads the other W - 1 outputs, so they are not computed.

Everything between the projections is one operator (:mod:`fitdqn.ops.attention`),
``fitdqn::last_token_attention(q [B, d], kv [B, W, 2 d], heads)``, Triton kernels on CUDA
(:mod:`fitdqn.ops.attention_triton`). The elementwise form in plain autograd (``tests/support/reference``) spends its
time in strided, non-vectorised multiplies, reductions with staging buffers and, in backward,
``select_backward`` + ``CopySlices`` zero-filling ``[B, W, 2 d]``. Measured on an H200 at B = 8192 (bf16): the
operator's forward takes 37 us a call, 3 calls an update; the graphed update went from 8.05 to 6.09 ms with this
operator, the IQN backward's wider slices (-0.78 ms) and the Huber kernel at 2 warps (-0.05 ms): about 1.1 ms is
this operator's. Per sample (bf16 under autocast, W = 8, d = 256, 4 heads) the operator keeps for backward
only the core's inputs, q ``[d]`` and kv ``[W, 2 d]`` (8.5 KB: the K/V projection output is kept either way),
not the fp32 softmax and its bf16 copy ``[W, heads]`` (192 B): the backward recomputes the W x heads scores and
weights from q and kv, 32 numbers a sample. It also makes no transients: the forward allocates only its ``[d]``
output (the elementwise form about 9.5 KB: two ``[W, d]`` products, the score tensors, an fp32 ``[d]`` sum), the
backward only grad q ``[d]`` and grad kv ``[W, 2 d]`` (8.5 KB, every element written; the elementwise form about
50 KB: six ``[W, d]`` products and casts, two zero-filled ``[W, 2 d]`` select gradients and their ``[W, 2 d]``
sum). Its fake kernels allocate exactly those outputs, so the planner's trace sees what the GPU allocates. On
the CPU the operator runs the elementwise maths (forward) and the closed-form gradient (backward).

The block ends with a second operator, ``fitdqn::residual_layer_norm`` (:mod:`fitdqn.ops.residual_norm`,
Triton on CUDA): the residual add and the LayerNorm in one kernel, and their backward (the input gradient and the
weight and bias gradients' per-program partial sums) in another. Under CUDA bf16 autocast a plain block runs a
bf16 add, a cast of the sum to fp32, ATen's LayerNorm with fp32 output, and its consumers cast the features back to
bf16; the operator rounds the sum to bf16 as that add did, normalises it in fp32 and writes the features once, in
bf16, which the heads read directly. Saved for backward per sample: the bf16 sum ``[d]`` (512 B at d = 256) and the
fp32 mean and rstd, not the fp32 LayerNorm input (1 KB); the features the heads keep are bf16 as well.

Why not ``scaled_dot_product_attention``: with one query per sample the attention weights are
``[heads, W]`` = 32 numbers, so materialising them costs nothing, and SDPA's flash and cuDNN kernels are built for
blocks of many queries; with one query per sample they were slower here. Measured on an H200 (bf16,
B = 8192, W = 8, fwd + bwd of this block alone): cuDNN SDPA (PyTorch's default there) 1.17 ms,
memory-efficient 1.37 ms, flash 3.59 ms, math 1.52 ms, this elementwise form 0.91 ms with the same peak
memory (21 KB/sample); the whole graphed update went from 10.4 to 10.0 ms. It also runs the same ops on
every device, so a memory trace on the CPU (``fitdqn.memory.trace``) sees what the GPU allocates (SDPA picks a
different kernel, with different saved tensors and workspaces, per device).
"""

from __future__ import annotations

import torch
from torch import nn

from fitdqn.nets.groups import tag
from fitdqn.ops.attention import last_token_attention
from fitdqn.ops.linear import linear
from fitdqn.ops.residual_norm import residual_layer_norm


class LastTokenAttention(nn.Module):
    """``tokens [B, W, d_model] -> [B, d_model]``: LayerNorm(last + out(attention(last -> all tokens))).

    The core between the projections is the operator ``fitdqn::last_token_attention`` (Triton on CUDA, the
    elementwise maths elsewhere), the residual add and LayerNorm the operator ``fitdqn::residual_layer_norm``
    (output in the compute dtype: bf16 under autocast, where ``nn.LayerNorm``'s is fp32), and the projections take
    their bias gradients as matrix-vector products (:func:`fitdqn.ops.linear.linear`).
    """

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not divisible by {heads} heads")
        self.heads = heads
        self.query = nn.Linear(d_model, d_model)
        self.key_value = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        tag(self, "attention")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        last = tokens[:, -1]  # [B, d]
        q = linear(last, self.query.weight, self.query.bias)  # [B, d]
        kv = linear(tokens, self.key_value.weight, self.key_value.bias)  # [B, W, 2d]
        attended = last_token_attention(q, kv, self.heads)  # [B, d]: the operator (module docstring)
        projected = linear(attended, self.out.weight, self.out.bias)  # [B, d]
        norm = self.norm
        return residual_layer_norm(projected, last, norm.weight, norm.bias, norm.eps)  # [B, d]: the operator
