"""IQL value net V(s) (Kostrikov et al. 2021): state -> iql_hidden -> iql_hidden -> 1, ReLU.

It reads the current bar's state only (the last token of ``obs``, ``[B, S]``), not the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fitdqn.nets.groups import tag


class ValueNet(nn.Module):
    """``state [B, S] -> V(s) [B]`` (fp32)."""

    def __init__(self, state_dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(state_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)
        tag(self, "iql")

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.fc1(state), inplace=True)  # [B, h]
        hidden = F.relu(self.fc2(hidden), inplace=True)  # [B, h]
        return self.fc3(hidden).squeeze(-1).float()  # [B]
