"""The observation contract: ``[B, W, S]`` float32 from the device-resident features and the agent state."""

from __future__ import annotations

import torch
from torch import Tensor


def build_observation(features: Tensor, bar: Tensor, agent: Tensor, window: int) -> Tensor:
    """``[B, W, Fm + Fa]``: token k (0..W-1) is ``concat(features[bar - W + 1 + k], agent)``.

    ``features [T, Fm]``, ``bar [B]`` (any integer dtype; the last token is this bar; every ``bar >= W - 1``,
    which the env guarantees), ``agent [B, Fa]``. One gather, no Python loop, no host sync.
    """
    offsets = torch.arange(1 - window, 1, device=bar.device)  # [W]
    index = bar.long()[:, None] + offsets  # [B, W]
    tokens = features[index]  # [B, W, Fm]
    agent_tokens = agent[:, None, :].to(tokens.dtype).expand(-1, window, -1)  # [B, W, Fa]
    return torch.cat([tokens, agent_tokens], dim=-1)  # [B, W, Fm + Fa]
