"""Each forward operator of :mod:`fitdqn.ops` as plain ATen ops: what a program exported with ``torch.export``
runs in place of the ``fitdqn::`` operators, so that it loads and runs without fitdqn
(``ExportedProgram.run_decompositions(plain_decompositions())``).

Each decomposition is the operator's maths in functional ops (no ``out=``, nothing in place: export's tracer
wants a functional graph), in the operator's dtypes: the elementwise attention, the residual add + LayerNorm, the
fold as one differentiable formula, C51's means as softmax, product and sum, the IQN head over all quantiles at
once (no chunks: an exported program acts on a few observations at a time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fitdqn.ops.attention import attention_core
from fitdqn.ops.c51_means import expected_values
from fitdqn.ops.fold import plain_fold
from fitdqn.ops.iqn import accumulate_dtype, cosine_embedding
from fitdqn.ops.residual_norm import residual_norm_maths


def iqn_quantiles(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype):
    """``fitdqn::iqn_quantile_head``'s forward for all N quantiles at once: ``[B, N, O]`` fp32 at least."""
    with torch.autocast(features.device.type, enabled=False):
        cos = cosine_embedding(taus, frequencies).to(dtype)  # [B, N, E]
        phi = F.relu(F.linear(cos, embed_w.to(dtype), embed_b.to(dtype)))  # [B, N, d]
        out = F.linear(features.to(dtype).unsqueeze(1) * phi, out_w.to(dtype), out_b.to(dtype))  # [B, N, O]
    return out.to(accumulate_dtype(features))


def plain_decompositions() -> dict[torch._ops.OpOverload, Callable]:
    """``{fitdqn operator: its plain maths}`` for every forward operator a network runs when it acts."""
    ops = torch.ops.fitdqn
    return {
        ops.iqn_quantile_head.default: iqn_quantiles,
        ops.last_token_attention.default: attention_core,
        ops.residual_layer_norm.default: residual_norm_maths,
        ops.folded_output.default: plain_fold,
        ops.c51_means.default: expected_values,
    }
