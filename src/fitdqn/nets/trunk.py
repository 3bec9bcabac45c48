"""The per-token trunk MLP: each bar token's state -> trunk_hidden -> d_model (ReLU after each layer).

Applied to every one of the W tokens of ``obs [B, W, S]`` (the attention block needs all W tokens for its
keys and values). ReLUs run in place on the linear outputs: a linear layer saves its input, not its output,
so only the ReLU outputs are kept for backward: ``W * (trunk_hidden + d_model)`` elements per sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fitdqn.nets.groups import tag


class TokenMLP(nn.Module):
    """state_dim -> hidden -> d_model on the last dimension: ``[..., S] -> [..., d_model]``."""

    def __init__(self, state_dim: int, hidden: int, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(state_dim, hidden)
        self.fc2 = nn.Linear(hidden, d_model)
        tag(self, "dqn")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.fc1(obs), inplace=True)  # [B, W, trunk_hidden]
        return F.relu(self.fc2(hidden), inplace=True)  # [B, W, d_model]
