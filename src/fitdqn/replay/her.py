"""HER 'future' relabelling at sample time, on the device.

With probability ``k / (k + 1)`` a sampled transition (step s of env e, episode step p) gets as goal the
``achieved`` of a step j drawn uniformly from ``[s, min(episode end, newest step written)]`` of the same
episode. Episodes are ``episode_length`` steps, so the end is ``s + episode_length - 1 - p``. An episode
cut short by a terminal step is detected (step j's ``episode_step`` is not ``p + (j - s)``) and that draw
falls back to j = s, the transition's own achieved, which is still a same-episode future goal.
"""

from __future__ import annotations

import torch

from fitdqn.replay.storage import RingStorage


class FutureGoals:
    """Relabelled goals for sampled slots (no host sync; the caller supplies the uniforms)."""

    def __init__(self, storage: RingStorage, episode_length: int, her_k: int):
        self.storage = storage
        self.episode_length = int(episode_length)
        self.relabel_probability = her_k / (her_k + 1.0)

    def __call__(self, index: torch.Tensor, goal: torch.Tensor,
                 uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(goal [B], relabelled [B] bool)`` for slots ``index [B]`` whose stored goal is ``goal``.

        ``uniform [B, 2]`` f64 in [0, 1): column 0 picks the future step, column 1 is the relabel coin.
        """
        s = self.storage
        newest = torch.remainder(s.written - 1, s.steps)  # 0-dim ring row of the newest step
        row = torch.div(index, s.num_envs, rounding_mode="floor")  # [B]
        ahead = torch.remainder(newest - row, s.steps)  # [B] steps written after s
        episode_step = s.fields["episode_step"][index].long()  # [B] p
        span = torch.minimum(self.episode_length - 1 - episode_step, ahead).clamp_(min=0)  # [B]
        offset = torch.minimum((uniform[:, 0] * (span + 1)).long(), span)  # [B] j - s
        future = torch.remainder(index + offset * s.num_envs, s.capacity)  # [B] slot of j
        same_episode = s.fields["episode_step"][future].long() == episode_step + offset  # [B]
        achieved = s.fields["achieved"]
        future_goal = torch.where(same_episode, achieved[future], achieved[index])  # [B]
        relabelled = uniform[:, 1] < self.relabel_probability  # [B]
        return torch.where(relabelled, future_goal, goal), relabelled
