"""IQL value net V(s) (Kostrikov et al. 2021): state -> iql_hidden -> iql_hidden -> 1, ReLU.

It reads the current bar's state only (the last token of ``obs``, ``[B, S]``), not the window.

The hidden layers' ReLU runs in their products' epilogue (:func:`fitdqn.ops.linear_relu.linear_relu`, as the
trunk's) and the output layer is :func:`fitdqn.ops.linear.linear`, so the parameters are cast once an update (the
learner runs V on ``obs`` and on ``next_obs``) and the gradients are written in fp32 by their products. The maths
are autograd's layers'.
"""

from __future__ import annotations

import torch
from torch import nn

from fitdqn.nets.groups import tag
from fitdqn.ops.linear import linear
from fitdqn.ops.linear_relu import linear_relu


class ValueNet(nn.Module):
    """``state [B, S] -> V(s) [B]`` (fp32)."""

    def __init__(self, state_dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(state_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)
        tag(self, "iql")

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        hidden = linear_relu(state, self.fc1.weight, self.fc1.bias)  # [B, h]
        hidden = linear_relu(hidden, self.fc2.weight, self.fc2.bias)  # [B, h]
        return linear(hidden, self.fc3.weight, self.fc3.bias).squeeze(-1).float()  # [B]
