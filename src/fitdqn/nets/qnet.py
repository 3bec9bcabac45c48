"""The Q network: per-token trunk -> last-token attention -> {branching dueling C51, IQN} on one trunk.

Composition only: each part is its own module and the Q network wires them. The learner holds two of these
(online and target) plus a :class:`~fitdqn.nets.iql.ValueNet`.
"""

from __future__ import annotations

import torch
from torch import nn

from fitdqn.config import NetConfig
from fitdqn.nets.attention import LastTokenAttention
from fitdqn.nets.c51 import BranchingDuelingC51
from fitdqn.nets.iqn import IQNHead
from fitdqn.nets.trunk import TokenMLP
from fitdqn.ops.c51_means import q_means


class QNetwork(nn.Module):
    """Features, C51 logits/Q values and IQN quantiles for ``obs [B, W, S]``.

    Every part calls the operators of :mod:`fitdqn.ops` (Triton on CUDA, the plain maths on the CPU: each
    operator chooses for itself).
    """

    def __init__(self, net: NetConfig, state_dim: int) -> None:
        super().__init__()
        self.branches = tuple(net.branches)
        self.max_n = max(self.branches)
        self.uniform = all(n == self.max_n for n in self.branches)
        self.tokens = TokenMLP(state_dim, net.trunk_hidden, net.d_model)
        self.attention = LastTokenAttention(net.d_model, net.attention_heads)
        self.c51 = BranchingDuelingC51(net.d_model, net.stream_hidden, self.branches, net.num_atoms)
        self.iqn = IQNHead(net.d_model, net.iqn_embedding, sum(self.branches))
        support = torch.linspace(net.v_min, net.v_max, net.num_atoms)
        self.register_buffer("support", support, persistent=False)  # [atoms]
        valid = torch.zeros(len(self.branches), self.max_n, dtype=torch.bool)
        pad_index = torch.zeros(len(self.branches), self.max_n, dtype=torch.long)
        offset = 0
        for branch, n in enumerate(self.branches):
            valid[branch, :n] = True
            pad_index[branch, :n] = torch.arange(offset, offset + n)
            offset += n
        self.register_buffer("valid_actions", valid, persistent=False)  # [branches, max_n]
        self.register_buffer("pad_index", pad_index.flatten(), persistent=False)  # [branches * max_n]
        self.register_buffer("branch_sizes", torch.tensor(self.branches, dtype=torch.float32),
                             persistent=False)  # [branches]

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs [B, W, S] -> [B, d_model]``: the last token after attention over the window."""
        return self.attention(self.tokens(obs))

    def c51_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, d] -> [B, branches, max_n, atoms]`` logits (dtype of the current autocast)."""
        return self.c51(features)

    def q_values(self, logits: torch.Tensor) -> torch.Tensor:
        """C51 means ``[..., atoms] -> [...]`` on the support, in fp32 (:func:`fitdqn.ops.c51_means.q_means`)."""
        return q_means(logits, self.support)

    def mean_minus_variance(self, logits: torch.Tensor, risk_aversion: float) -> torch.Tensor:
        """C51 mean - ``risk_aversion`` x C51 variance ``[..., atoms] -> [...]`` on the support, in fp32."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [..., atoms]
        mean = (probs * self.support).sum(-1)  # [...]
        return mean - risk_aversion * ((probs * self.support.square()).sum(-1) - mean.square())

    def quantiles(self, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        """``features [B, d]``, ``taus [B, N] -> [B, N, branches, max_n]`` IQN quantile values (fp32)."""
        values = self.iqn(features, taus)  # [B, N, sum(branches)]
        if not self.uniform:
            values = values[..., self.pad_index]  # [B, N, branches * max_n]
        return values.view(*values.shape[:-1], len(self.branches), self.max_n)

    def greedy(self, q: torch.Tensor) -> torch.Tensor:
        """``q [B, branches, max_n] -> [B, branches]`` int64 argmax over valid sub-actions."""
        if not self.uniform:
            q = q.masked_fill(~self.valid_actions, float("-inf"))
        return q.argmax(dim=-1)
