"""Synthetic learner batches with the exact keys, shapes and dtypes of docs/DESIGN.md (tests, benchmarks,
memory calibration)."""

from __future__ import annotations

import torch

from fitdqn.config import Config


def random_batch(
    config: Config, state_dim: int, batch_size: int, device: torch.device | str, seed: int,
    obs_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A random batch: standard-normal observations, valid actions, rewards N(0, 1), 10 % terminal;
    ``obs`` and ``next_obs`` in ``obs_dtype`` (the replay builds them in the learner's autocast dtype)."""
    generator = torch.Generator().manual_seed(seed)  # on the host: the same batch on every device
    window, branches = config.net.window, config.net.branches
    obs = torch.randn(batch_size, window, state_dim, generator=generator)  # [B, W, S]
    next_obs = torch.randn(batch_size, window, state_dim, generator=generator)  # [B, W, S]
    sizes = torch.tensor(branches, dtype=torch.float32)
    action = (torch.rand(batch_size, len(branches), generator=generator) * sizes).long()  # [B, br]
    reward = torch.randn(batch_size, generator=generator)  # [B]
    terminal = (torch.rand(batch_size, generator=generator) < 0.1).float()  # [B]
    discount = config.learn.gamma ** config.learn.n_step * (1.0 - terminal)  # [B]
    weight = torch.rand(batch_size, generator=generator) * 0.9 + 0.1  # [B]
    weight = weight / weight.max()
    batch = {"obs": obs, "action": action, "reward": reward, "discount": discount, "next_obs": next_obs,
             "weight": weight}
    batch["obs"], batch["next_obs"] = obs.to(obs_dtype), next_obs.to(obs_dtype)  # rounded on the host
    return {key: value.to(device) for key, value in batch.items()}
