"""The trainer's assembly (``fitdqn.system``): where the learner's batches get their observation noise."""

import pytest
import torch

from fitdqn.config import Config, for_device, with_overrides
from fitdqn.market.layout import NUM_AGENT_FIELDS, NUM_FEATURES
from fitdqn.market.observation import build_observation
from fitdqn.plan.build import stand_in_system


def small_system(obs_noise: float, noise_on: str = "all"):
    config = for_device(with_overrides(Config(), {"learn.obs_noise": obs_noise, "learn.obs_noise_on": noise_on,
                                                  "collect.num_envs": 4}), "cpu")
    return stand_in_system(config, num_bars=2000, capacity=4 * 64, batch_size=16, device=torch.device("cpu"))


@pytest.mark.parametrize("obs_noise", [0.0, 0.3])
def test_learner_batches_carry_the_noise_drawn_where_their_observations_are_built(obs_noise):
    """learn.obs_noise: a learner batch's observations are the built ones plus std x N(0, 1) drawn in their dtype
    from the default generator, made in place (no noised copy beside them); none at 0."""
    system = small_system(obs_noise)
    window = system.config.net.window
    bar = torch.tensor([window, 100, 1250, 1999])
    agent = torch.randn(4, NUM_AGENT_FIELDS)
    torch.manual_seed(7)
    got = system.replay.observe(bar, agent)
    torch.manual_seed(7)
    built = build_observation(system.env.features, bar, agent, window)  # [B, W, S]
    expected = built + obs_noise * torch.randn_like(built) if obs_noise else built
    assert torch.equal(got, expected)
    torch.manual_seed(7)
    batch = system.replay.sample(16, system.beta, system.sample_generator)
    features = batch["obs"][..., :NUM_FEATURES]  # the stand-in market's features are all zero
    assert (features.std() > 0.2) == (obs_noise > 0)


def test_the_noise_on_the_market_features_only_leaves_the_agent_state_exact():
    system = small_system(0.3, "market")
    window = system.config.net.window
    bar, agent = torch.tensor([window, 1999]), torch.randn(2, NUM_AGENT_FIELDS)
    torch.manual_seed(7)
    got = system.replay.observe(bar, agent)
    torch.manual_seed(7)
    built = build_observation(system.env.features, bar, agent, window)  # [B, W, S]
    noise = 0.3 * torch.randn_like(built[..., :NUM_FEATURES])  # [B, W, Fm], drawn for those columns only
    assert torch.equal(got[..., NUM_FEATURES:], built[..., NUM_FEATURES:])
    assert torch.equal(got[..., :NUM_FEATURES], built[..., :NUM_FEATURES] + noise)


def test_the_update_draws_no_noise_itself():
    """The learner's update is the same at any learn.obs_noise: the noise belongs to the sampled batch."""
    source = small_system(0.0)
    batch = source.replay.sample(16, source.beta, torch.Generator().manual_seed(1))
    outs = []
    for obs_noise in (0.0, 0.3):
        torch.manual_seed(0)  # the same initial weights
        system = small_system(obs_noise)
        torch.manual_seed(3)
        outs.append(system.learner.update({key: value.clone() for key, value in batch.items()}))
    for key in outs[0]:
        assert torch.equal(outs[0][key], outs[1][key]), key


@pytest.mark.parametrize("her", [False, True])
def test_the_goal_bonus_comes_with_her_only(her):
    """replay.her: with HER the replay adds the env's goal bonus to the sampled rewards; without it (the default) the
    rewards are the stored ones, the P&L the env wrote, whatever goal the agent row holds."""
    config = for_device(with_overrides(Config(), {"replay.her": her, "collect.num_envs": 4}), "cpu")
    system = stand_in_system(config, num_bars=2000, capacity=4 * 64, batch_size=16, device=torch.device("cpu"))
    assert (system.replay.goal_reward is not None) == her
    if her:
        before, after, goal = torch.tensor([0.0, 0.0]), torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.0])
        assert torch.equal(system.replay.goal_reward(before, after, goal), torch.tensor([system.env.goal_bonus, 0.0]))
