"""Target-network updates as tensor ops: soft (Polyak every update) or hard (copy every period updates).

The hard copy is a lerp whose weight is ``(step % period == 0)`` as a device tensor, so there is no Python
branch on a tensor and the same code runs inside a CUDA graph. ``lerp`` is exact at weight 1 (PyTorch
computes ``end - (end - start) * (1 - w)`` for w >= 0.5), so a hard update is a bitwise copy.
"""

from __future__ import annotations

import torch


def target_weight(step: torch.Tensor, mode: str, tau: float, period: int) -> torch.Tensor | float:
    """The lerp weight of this update. ``step`` is the device counter *after* this update (1, 2, ...)."""
    if mode == "soft":
        return tau
    if mode == "hard":
        return (step % period == 0).float()  # [] 1.0 on copy steps, else 0.0
    raise ValueError(f"learn.target_update must be 'soft' or 'hard', got {mode!r}")


@torch.no_grad()
def update_target(target: list[torch.Tensor], online: list[torch.Tensor], weight: torch.Tensor | float) -> None:
    """``target <- target + weight * (online - target)`` for every pair, in place."""
    if isinstance(weight, torch.Tensor):
        torch._foreach_lerp_(target, online, [weight] * len(target))
    else:
        torch._foreach_lerp_(target, online, weight)
