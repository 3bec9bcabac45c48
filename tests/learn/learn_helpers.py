"""Small configs and batches for the learner tests (full widths are not needed to test the maths)."""

from __future__ import annotations

import dataclasses

import torch

from fitdqn.config import Config, LearnConfig, NetConfig
from fitdqn.learn import Learner, random_batch

STATE_DIM = 10
SMALL_NET = NetConfig(window=4, trunk_hidden=32, d_model=16, attention_heads=4, stream_hidden=16, num_atoms=11,
                      iqn_embedding=8, iqn_quantiles=8, iqn_act_quantiles=4, iql_hidden=16)


def small_config(**learn) -> Config:
    return Config(net=SMALL_NET, learn=dataclasses.replace(LearnConfig(), **learn))


def make_learner(seed: int = 0, device: str = "cpu", config: Config | None = None) -> Learner:
    torch.manual_seed(seed)
    return Learner(config or small_config(), STATE_DIM, device)


def make_batch(batch_size: int = 32, seed: int = 0, device: str = "cpu", config: Config | None = None):
    return random_batch(config or small_config(), STATE_DIM, batch_size, device, seed=seed)
