"""n-step returns built at sample time from the lockstep layout (step t + k of env e is k * E slots on).

``R = sum_{k<m} gamma^k (reward_k + goal_reward_k)``; the window stops after the episode's last step
(flags bit 1) or a terminal step (flags bit 0), so ``m <= n``; ``discount = gamma^m * (1 - terminal)``.
The caller guarantees all n slots of the window are written (the samplers only pick such slots).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fitdqn.replay.storage import RingStorage

TERMINAL = 1  # flags bit 0: no bootstrap
EPISODE_END = 2  # flags bit 1: last step of the episode

GoalReward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class NStep:
    """What the learner needs from a window: return, discount and the slot of its last step."""

    reward: torch.Tensor  # [B] f32
    discount: torch.Tensor  # [B] f32
    last: torch.Tensor  # [B] int64 slot of the window's last step (next obs comes from it)


class NStepReturns:
    """Builds :class:`NStep` for sampled slots; the constants live on the device (capturable)."""

    def __init__(self, storage: RingStorage, n_step: int, gamma: float):
        device = storage.device
        self.storage = storage
        self.n_step = int(n_step)
        self.gamma = float(gamma)
        # constants from host lists (gamma^k in float64, then float32), not device arithmetic: on the 'meta' device
        # of the planner's replay sizing a factory is free, while the first arange or pow there imports torch's
        # Python decompositions (about 1.5 s)
        self.offsets = torch.tensor([k * storage.num_envs for k in range(self.n_step)], dtype=torch.int64,
                                    device=device)  # [n]
        self.gamma_powers = torch.tensor([self.gamma ** k for k in range(self.n_step + 1)], dtype=torch.float32,
                                         device=device)  # [n + 1] (host floats rounded to f32 once)

    def tensors(self) -> list[torch.Tensor]:
        return [self.offsets, self.gamma_powers]

    def __call__(self, index: torch.Tensor, goal: torch.Tensor, goal_reward: GoalReward | None) -> NStep:
        """Window returns for slots ``index [B]`` under goal ``goal [B]`` (the relabelled one under HER)."""
        s = self.storage
        slots = torch.remainder(index.unsqueeze(1) + self.offsets, s.capacity)  # [B, n]
        flags = s.fields["flags"][slots]  # [B, n] uint8
        ended = (flags & (TERMINAL | EPISODE_END)) != 0  # [B, n]
        alive = (ended.cumsum(1) - ended.long()) == 0  # [B, n] step k is inside the window
        reward = s.fields["reward"][slots]  # [B, n] f32
        if goal_reward is not None:
            achieved = s.fields["achieved"][slots]  # [B, n]
            reward = reward + goal_reward(achieved - reward, achieved, goal.unsqueeze(1).expand_as(achieved))
        ret = (reward * self.gamma_powers[: self.n_step] * alive).sum(1)  # [B]
        length = alive.sum(1)  # [B] m in 1..n
        last = slots.gather(1, (length - 1).unsqueeze(1)).squeeze(1)  # [B]
        terminal = (s.fields["flags"][last] & TERMINAL).to(torch.float32)  # [B]
        discount = self.gamma_powers[length] * (1.0 - terminal)  # [B]
        return NStep(reward=ret.to(torch.float32), discount=discount, last=last)
