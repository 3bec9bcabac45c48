"""Action selection: valid indices, epsilon = 1 uniform, epsilon = 0 greedy (C51 mean, IQN CVaR, mean - variance)."""

from __future__ import annotations

import torch
from learn_helpers import SMALL_NET, STATE_DIM, make_learner, small_config


def observations(envs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(envs, SMALL_NET.window, STATE_DIM, generator=torch.Generator().manual_seed(seed))


def test_actions_are_valid_int64():
    learner = make_learner()
    actions = learner.act(observations(100), torch.tensor(0.3))
    assert actions.shape == (100, 3) and actions.dtype == torch.int64
    assert torch.all((actions >= 0) & (actions < 5))


def test_epsilon_one_is_uniform_per_branch():
    learner = make_learner()
    envs = 6000
    actions = learner.act(observations(envs), torch.tensor(1.0), torch.Generator().manual_seed(0))
    for branch in range(3):
        counts = torch.bincount(actions[:, branch], minlength=5).float()
        expected, sigma = envs / 5, (envs * 0.2 * 0.8) ** 0.5
        assert torch.all((counts - expected).abs() < 5 * sigma), counts


def test_epsilon_zero_is_greedy_on_c51_mean():
    learner = make_learner()
    obs = observations(200)
    net = learner.online
    with torch.no_grad():
        expected = net.q_values(net.c51_logits(net.features(obs))).argmax(-1)
    assert torch.equal(learner.act(obs, torch.tensor(0.0)), expected)


def test_per_env_epsilon():
    learner = make_learner()
    obs = observations(400)
    epsilon = torch.cat([torch.zeros(200), torch.ones(200)])
    greedy = learner.act(obs, torch.tensor(0.0))
    mixed = learner.act(obs, epsilon, torch.Generator().manual_seed(1))
    assert torch.equal(mixed[:200], greedy[:200])
    assert not torch.equal(mixed[200:], greedy[200:])


def test_cvar_is_greedy_on_the_lower_tail_of_iqn():
    learner = make_learner(config=small_config(risk="cvar", cvar_alpha=0.25))
    obs = observations(50)
    got = learner.act(obs, torch.tensor(0.0), torch.Generator().manual_seed(3))
    again = learner.act(obs, torch.tensor(0.0), torch.Generator().manual_seed(3))
    assert torch.equal(got, again)
    generator = torch.Generator().manual_seed(3)
    taus = 0.25 * torch.rand(50, SMALL_NET.iqn_act_quantiles, generator=generator)
    net = learner.online
    with torch.no_grad():
        expected = net.quantiles(net.features(obs), taus).mean(dim=1).argmax(-1)
    assert torch.equal(got, expected)
    assert torch.all((got >= 0) & (got < 5))


def test_mean_variance_is_greedy_on_mean_minus_lambda_variance():
    obs = observations(300)
    neutral = make_learner()
    zero = make_learner(config=small_config(risk="mean_variance", risk_aversion=0.0))
    assert torch.equal(zero.act(obs, torch.tensor(0.0)), neutral.act(obs, torch.tensor(0.0)))  # lambda 0: the mean
    learner = make_learner(config=small_config(risk="mean_variance", risk_aversion=0.7))
    net = learner.online
    with torch.no_grad():  # by hand, in float64: E[Z] - 0.7 Var[Z] of each sub-action's C51 distribution
        probs = torch.softmax(net.c51_logits(net.features(obs)).double(), dim=-1)
        z = net.support.double()
        mean = (probs * z).sum(-1)
        score = mean - 0.7 * ((probs * (z - mean.unsqueeze(-1)) ** 2).sum(-1))
    got = learner.act(obs, torch.tensor(0.0))
    assert torch.equal(got, score.argmax(-1))
    assert not torch.equal(got, neutral.act(obs, torch.tensor(0.0)))  # the variance moved some choices
