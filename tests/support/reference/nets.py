"""The networks' parts in plain autograd: the trunk's layers with ``F.relu``, the IQN head keeping ``[B, N, d]``
tensors, the elementwise attention with ``nn.LayerNorm``, per-branch dueling on the activations and the fold in
differentiable ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fitdqn.nets.attention import LastTokenAttention
from fitdqn.nets.c51 import BranchingDuelingC51
from fitdqn.nets.iqn import IQNHead
from fitdqn.nets.trunk import TokenMLP
from fitdqn.ops.iqn import cosine_embedding


def trunk(module: TokenMLP, obs: torch.Tensor) -> torch.Tensor:
    """``obs [B, W, S]`` -> ``[B, W, d]``: two linear layers, each with an in-place ReLU, on the token rows."""
    rows = obs.reshape(-1, obs.shape[-1])  # [B * W, S]
    hidden = F.relu(module.fc1(rows), inplace=True)  # [B * W, trunk_hidden]
    out = F.relu(module.fc2(hidden), inplace=True)  # [B * W, d_model]
    return out.view(*obs.shape[:-1], out.shape[-1])


def iqn_head(head: IQNHead, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
    """``features [B, d]``, ``taus [B, N]`` -> ``[B, N, O]`` (fp32 at least) through ``head``'s layers."""
    phi = F.relu(head.embed(cosine_embedding(taus, head.frequencies)))  # [B, N, d]
    out = head.out(features.unsqueeze(1) * phi)  # [B, N, O]
    return out.to(torch.promote_types(out.dtype, torch.float32))


def attention(module: LastTokenAttention, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens [B, W, d]`` -> ``[B, d]``: the elementwise maths and ``nn.LayerNorm`` on the residual sum."""
    batch, window, d_model = tokens.shape
    heads, head_dim = module.heads, d_model // module.heads
    last = tokens[:, -1]  # [B, d]
    q = module.query(last).view(batch, 1, heads, head_dim)  # [B, 1, H, dh]
    kv = module.key_value(tokens).view(batch, window, 2, heads, head_dim)  # [B, W, 2, H, dh]
    k, v = kv[:, :, 0], kv[:, :, 1]  # [B, W, H, dh] each (views of kv)
    scores = (k * q).sum(-1, dtype=torch.float32) * head_dim**-0.5  # [B, W, H]
    weights = torch.softmax(scores, dim=1).to(v.dtype)  # [B, W, H]: over the W tokens
    attended = (weights.unsqueeze(-1) * v).sum(1).reshape(batch, d_model)  # [B, d]
    return module.norm(last + module.out(attended))  # [B, d]


def dueling(value: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
    """``value [B, A]``, ``advantage [B, n, A]`` -> ``[B, n, A]``: V + A - mean over sub-actions of A."""
    return value.unsqueeze(1) + advantage - advantage.mean(dim=1, keepdim=True)


def c51_head(head: BranchingDuelingC51, features: torch.Tensor) -> torch.Tensor:
    """Per-branch output layers and :func:`dueling` on the activations: ``[B, branches, max_n, atoms]``."""
    batch = features.shape[0]
    streams = F.relu(head.hidden(features))  # [B, (1 + branches) * h]
    streams = streams.view(batch, 1 + len(head.branches), -1)  # [B, 1 + branches, h]
    value = head.value(streams[:, 0])[:, :head.atoms]  # [B, atoms] (padding columns dropped)
    logits = []
    for index, (n, layer) in enumerate(zip(head.branches, head.advantages, strict=True)):
        advantage = layer(streams[:, 1 + index])[:, :n * head.atoms].view(batch, n, head.atoms)  # [B, n, atoms]
        branch = dueling(value, advantage)  # [B, n, atoms]
        if n < head.max_n:
            branch = F.pad(branch, (0, 0, 0, head.max_n - n))  # [B, max_n, atoms]
        logits.append(branch)
    return torch.stack(logits, dim=1)  # [B, branches, max_n, atoms]


def fold(head: BranchingDuelingC51) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's folded output weight ``[rows, (1 + br) h]`` and bias ``[rows]`` in plain differentiable ops."""
    branches, n, atoms = len(head.branches), head.max_n, head.atoms
    hidden = head.value.in_features
    valid = torch.zeros(branches, n, 1, dtype=head.value.weight.dtype)  # [br, n, 1]
    for branch, size in enumerate(head.branches):
        valid[branch, :size] = 1.0
    adv_weight = _stacked(head, [layer.weight for layer in head.advantages])  # [br, n, atoms, h]
    adv_bias = _stacked(head, [layer.bias for layer in head.advantages])  # [br, n, atoms]
    counts = valid.sum(dim=1, keepdim=True)  # [br, 1, 1]
    adv_weight = adv_weight - adv_weight.sum(dim=1, keepdim=True) / counts.unsqueeze(-1)
    adv_bias = adv_bias - adv_bias.sum(dim=1, keepdim=True) / counts
    value_weight = head.value.weight[:atoms].expand(branches, n, atoms, hidden)  # [br, n, atoms, h]
    value_bias = head.value.bias[:atoms]  # [atoms]
    value_weight = value_weight * valid.unsqueeze(-1)  # padded sub-actions get zero logits
    adv_weight, adv_bias = adv_weight * valid.unsqueeze(-1), adv_bias * valid
    value_bias = value_bias * valid  # [br, n, atoms]
    placement = torch.eye(branches).view(branches, 1, 1, branches, 1)  # branch d -> column block d
    blocks = adv_weight.unsqueeze(3) * placement  # [br, n, atoms, br, h]: block-diagonal
    weight = torch.cat([value_weight.unsqueeze(3), blocks], dim=3).view(branches * n * atoms, -1)
    bias = (adv_bias + value_bias).reshape(-1)  # [br * n * atoms]
    return F.pad(weight, (0, 0, 0, head.padding_rows)), F.pad(bias, (0, head.padding_rows))


def _stacked(head: BranchingDuelingC51, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each branch's advantage weights or biases -> ``[br, max_n, atoms, ...]`` (padded sub-actions zero)."""
    rows = head.max_n * head.atoms
    parts = []
    for n, tensor in zip(head.branches, tensors, strict=True):
        used = tensor[:n * head.atoms]
        if n < head.max_n:
            used = F.pad(used, (0, 0) * (tensor.dim() - 1) + (0, rows - n * head.atoms))
        parts.append(used)
    stacked = torch.stack(parts)  # [br, max_n * atoms, ...]
    return stacked.view(len(head.branches), head.max_n, head.atoms, *stacked.shape[2:])
