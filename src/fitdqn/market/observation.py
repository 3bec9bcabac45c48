"""The observation contract: ``[B, W, S]`` (float32, or the learner's autocast dtype for learner batches) from the
device-resident features and the agent state."""

from __future__ import annotations

import torch
from torch import Tensor


def build_observation(features: Tensor, bar: Tensor, agent: Tensor, window: int, dtype: torch.dtype | None = None
                      ) -> Tensor:
    """``[B, W, Fm + Fa]``: token k (0..W-1) is ``concat(features[bar - W + 1 + k], agent)``.

    ``features [T, Fm]``, ``bar [B]`` (any integer dtype; the last token is this bar; every ``bar >= W - 1``,
    which the env guarantees), ``agent [B, Fa]``. One gather, no Python loop, no host sync. ``dtype``: the tokens
    cast to it (the learner's autocast dtype: its networks read an observation only through linear layers, which
    autocast would cast to that dtype anyway; the same values, without a float32 copy held through the update).
    """
    offsets = torch.arange(1 - window, 1, device=bar.device)  # [W]
    index = bar.long()[:, None] + offsets  # [B, W]
    tokens = features[index]  # [B, W, Fm]
    if dtype is not None:
        tokens = tokens.to(dtype)
    agent_tokens = agent[:, None, :].to(tokens.dtype).expand(-1, window, -1)  # [B, W, Fa]
    return torch.cat([tokens, agent_tokens], dim=-1)  # [B, W, Fm + Fa]
