"""Action selection: greedy on C51 means (risk-neutral), IQN CVaR or C51 mean - lambda variance (risk-averse),
epsilon-greedy per branch.

All tensor ops: epsilon is a device tensor, exploration is a per-env, per-branch coin flip, so a collector
step that calls this can be captured in a CUDA graph. A custom ``generator`` must be registered with the
graph by the caller if it captures this.
"""

from __future__ import annotations

import torch

from fitdqn.nets.qnet import QNetwork


@torch.no_grad()
def select_actions(
    net: QNetwork,
    obs: torch.Tensor,
    epsilon: torch.Tensor,
    risk: str,
    cvar_alpha: float,
    risk_aversion: float,
    quantiles: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``obs [E, W, S]``, ``epsilon`` float tensor (0-dim or ``[E]``) -> actions ``[E, branches]`` int64."""
    envs = obs.shape[0]
    branches = len(net.branches)
    features = net.features(obs)  # [E, d]
    if risk == "neutral":
        q = net.q_values(net.c51_logits(features))  # [E, branches, max_n]
    elif risk == "cvar":
        # CVaR_alpha = mean of the quantile function over levels in [0, alpha]: sample K levels there.
        taus = cvar_alpha * torch.rand(envs, quantiles, device=obs.device, generator=generator)  # [E, K]
        q = net.quantiles(features, taus).mean(dim=1)  # [E, branches, max_n]
    elif risk == "mean_variance":
        # mean - lambda variance of each sub-action's C51 distribution: the score is quadratic in the position
        # (its variance grows with its square), so the best position grows with the expected return
        q = net.mean_minus_variance(net.c51_logits(features), risk_aversion)  # [E, branches, max_n]
    else:
        raise ValueError(f"learn.risk must be 'neutral', 'cvar' or 'mean_variance', got {risk!r}")
    greedy = net.greedy(q)  # [E, branches]
    coins = torch.rand(envs, branches, device=obs.device, generator=generator)  # [E, branches]
    uniform = torch.rand(envs, branches, device=obs.device, generator=generator)  # [E, branches]
    random = (uniform * net.branch_sizes).long().clamp_(max=net.branch_sizes.long() - 1)  # [E, branches]
    epsilon = epsilon.reshape(-1, 1) if epsilon.dim() else epsilon  # [E, 1] or []
    return torch.where(coins < epsilon, random, greedy)
