"""The per-token trunk MLP: each bar token's state -> trunk_hidden -> d_model (ReLU after each layer).

Applied to every one of the W tokens of ``obs [B, W, S]`` (the attention block needs all W tokens for its
keys and values). ReLUs run in place on the linear outputs: a linear layer saves its input, not its output,
so only the ReLU outputs are kept for backward: ``W * (trunk_hidden + d_model)`` elements per sample. The
tokens are flattened to rows first: a linear layer on a 3-D input returns a *view* of its 2-D product, and an
in-place ReLU on a view costs a ``CopySlices`` in backward (a clone and a copy of the whole output: 0.22 ms of
the update at batch 8192 on an H200).

Each layer's ReLU runs in its matrix product's epilogue (:func:`fitdqn.ops.linear_relu.linear_relu`, one cuBLASLt
call on CUDA instead of a product and an elementwise pass over it); the values and saved tensors of
``relu(linear(x))``.
"""

from __future__ import annotations

import torch
from torch import nn

from fitdqn.nets.groups import tag
from fitdqn.ops.linear_relu import linear_relu


class TokenMLP(nn.Module):
    """state_dim -> hidden -> d_model on the last dimension: ``[..., S] -> [..., d_model]``."""

    def __init__(self, state_dim: int, hidden: int, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(state_dim, hidden)
        self.fc2 = nn.Linear(hidden, d_model)
        tag(self, "dqn")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        rows = obs.reshape(-1, obs.shape[-1])  # [B * W, S]: 2-D, so each linear output is its own tensor
        hidden = linear_relu(rows, self.fc1.weight, self.fc1.bias)  # [B * W, trunk_hidden]
        out = linear_relu(hidden, self.fc2.weight, self.fc2.bias)  # [B * W, d_model]
        return out.view(*obs.shape[:-1], out.shape[-1])  # [B, W, d_model]
