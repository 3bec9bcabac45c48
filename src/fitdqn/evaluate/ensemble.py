"""A study's members as one policy: the ensemble a trader acts with.

The M members (a study's seeds, trained on one fold) see the same observation (the ensemble's own account: its
position, open P&L, time in trade, bracket, goal) and each picks its greedy action. The ensemble

* holds the **mean of the members' target positions**: branch 0 of its env has the levels ``k / M`` for
  ``k = -max M .. max M`` (every mean of M whole-contract levels, :func:`ensemble_levels`), scaled by the same
  volatility sizing as a member's;
* places the **bracket of the member whose target is closest to that mean** (its stop and take-profit, the
  lowest-numbered such member on a tie): a bracket one member chose, for the position nearest its own.

One account, one position, one bracket: what ``fitdqn act`` and ``fitdqn export`` give for a study, and what its
report's walk-forward book trades (each fold's ensemble built from the members trained on that fold). An ensemble
of one member is that member.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from fitdqn.evaluate.backtest import Backtest, Progress_, SplitSizes, evaluate_policy
from fitdqn.learn.learner import Learner
from fitdqn.market.loader import Market

BRACKET_RULE = "the bracket of the member whose target position is closest to the mean (the first on a tie)"


def ensemble_levels(levels: Sequence[float], members: int) -> list[float]:
    """Branch 0's contracts for an ensemble of ``members`` policies whose levels are the whole contracts
    ``levels``: every mean of ``members`` of them, ``k / members`` for ``k = -max x members .. max x members``."""
    if any(float(v) != round(float(v)) for v in levels):
        raise ValueError(f"an ensemble averages whole-contract levels, got {list(levels)}")
    top = round(max(abs(float(v)) for v in levels))
    return [k / members for k in range(-top * members, top * members + 1)]


def combine(actions: Tensor, levels: Tensor) -> Tensor:
    """The ensemble's action ``[E, 3]`` from its members' ``actions [M, E, 3]`` over the member ``levels [n]``:
    branch 0 the index of the members' mean level in :func:`ensemble_levels`, branches 1 and 2 the bracket of the
    member closest to that mean. No host sync."""
    M, E = actions.shape[0], actions.shape[1]
    level = levels[actions[..., 0]]  # [M, E] whole contracts
    total = level.sum(dim=0)  # [E] whole contracts: exact in float32
    closest = (level * M - total).abs().argmin(dim=0)  # [E] the first member closest to the mean (exact integers)
    bracket = actions[closest, torch.arange(E, device=actions.device), 1:]  # [E, 2]
    top = levels.abs().max().round().long()
    index = total.round().long() + top * M  # [E] index of total / M among -top .. top in steps of 1 / M
    return torch.cat([index.unsqueeze(1), bracket], dim=1)


class EnsemblePolicy:
    """``obs [E, W, S] -> actions [E, 3]`` of M members (their evaluated networks, greedy), combined by
    :func:`combine`; ``levels`` are a member's branch-0 contracts, ``grid`` the ensemble's."""

    def __init__(self, learners: Sequence[Learner], levels: Sequence[float]) -> None:
        if not learners:
            raise ValueError("an ensemble needs at least one member")
        self.learners = list(learners)
        device = self.learners[0].device
        self.levels = torch.tensor([float(v) for v in levels], device=device)  # [n]
        self.grid = ensemble_levels(levels, len(self.learners))
        self.zero = torch.zeros((), device=device)

    def member_actions(self, obs: Tensor) -> Tensor:
        """``[M, E, 3]`` each member's greedy action on ``obs``."""
        return torch.stack([learner.act(obs.to(learner.device), self.zero, network=learner.evaluated).to(
            self.levels.device) for learner in self.learners])

    def __call__(self, obs: Tensor) -> Tensor:
        return combine(self.member_actions(obs), self.levels)


def evaluate_ensemble(policy: EnsemblePolicy, market: Market, split: str, sizes: SplitSizes, *,
                      goal: float | None = None, progress: Progress_ = None) -> Backtest:
    """The ensemble's backtest over ``split`` (:func:`fitdqn.evaluate.backtest.evaluate_policy` on an env whose
    branch 0 holds the ensemble's levels; ``sizes`` are a member's)."""
    return evaluate_policy(policy, market, split, dataclasses.replace(sizes, levels=tuple(policy.grid)), goal=goal,
                           progress=progress)
