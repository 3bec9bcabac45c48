"""The ensemble policy: the mean of its members' target positions, the bracket of the member closest to it, on one
account; an ensemble of copies of one member is that member."""

import dataclasses

import numpy as np
import pytest
import torch
from support.small_run import SMALL_RUN

from fitdqn.config import Config, with_overrides
from fitdqn.evaluate.backtest import SplitSizes, evaluate_policy
from fitdqn.evaluate.baselines import greedy_policy
from fitdqn.evaluate.ensemble import EnsemblePolicy, combine, ensemble_levels, evaluate_ensemble
from fitdqn.learn.learner import Learner
from fitdqn.market.env import position_levels, position_size
from fitdqn.market.layout import STATE_DIM
from fitdqn.market.loader import load_market
from fitdqn.resolve import resolve_for_market


def test_levels_are_every_mean_of_the_members_levels():
    assert ensemble_levels([-2.0, -1.0, 0.0, 1.0, 2.0], 1) == [-2.0, -1.0, 0.0, 1.0, 2.0]
    grid = ensemble_levels([-2.0, -1.0, 0.0, 1.0, 2.0], 3)
    assert len(grid) == 13 and grid[0] == -2.0 and grid[-1] == 2.0 and grid[7] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="whole-contract"):
        ensemble_levels([-0.5, 0.0, 0.5], 2)


def test_combine_takes_the_mean_position_and_the_closest_members_bracket():
    levels = torch.tensor(position_levels(5, 2))  # -2 .. 2
    actions = torch.tensor([[[4, 1, 2], [0, 3, 3]],  # member 0: +2 and -2
                            [[2, 2, 0], [0, 4, 4]],  # member 1: 0 and -2
                            [[3, 4, 1], [3, 0, 1]]])  # member 2: +1 and +1   -> [M = 3, E = 2, 3]
    got = combine(actions, levels)
    grid = ensemble_levels(levels.tolist(), 3)
    assert grid[int(got[0, 0])] == pytest.approx(1.0) and grid[int(got[1, 0])] == pytest.approx(-1.0)
    assert got[0, 1:].tolist() == [4, 1]  # mean +1: member 2 (+1) is closest
    assert got[1, 1:].tolist() == [3, 3]  # mean -1: members 0 and 1 (-2) tie at 1 from it, the first places it


@pytest.fixture(scope="module")
def setup():
    config = with_overrides(Config(), {**SMALL_RUN, "market.synthetic_bars": 3000})
    market = load_market(config.market, window=config.net.window)
    config, _ = resolve_for_market(config, market)
    learners = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        learners.append(Learner(config, STATE_DIM, "cpu"))
    return config, market, learners


def test_an_ensemble_of_copies_of_one_member_is_that_member(setup):
    config, market, learners = setup
    sizes = SplitSizes.of_config(config, market)
    levels = position_levels(config.net.branches[0], config.market.max_contracts)
    alone = evaluate_policy(greedy_policy(learners[0]), market, "test", sizes)
    twice = evaluate_ensemble(EnsemblePolicy([learners[0], learners[0]], levels), market, "test", sizes)
    np.testing.assert_array_equal(twice.target, alone.target)
    np.testing.assert_allclose(twice.pnl, alone.pnl, rtol=1e-6, atol=1e-6)


def test_the_ensemble_holds_the_mean_of_its_members_targets(setup):
    config, market, learners = setup
    sizes = SplitSizes.of_config(config, market)
    levels = position_levels(config.net.branches[0], config.market.max_contracts)
    seen = []

    class Recording(EnsemblePolicy):
        def member_actions(self, obs):
            actions = super().member_actions(obs)  # [M, E, 3]
            seen.append(actions)
            return actions

    policy = Recording(learners, levels)
    backtest = evaluate_ensemble(policy, market, "test", dataclasses.replace(sizes, segments=1))
    assert backtest.segments == 1  # one env stepping the split bar by bar: the steps in order
    actions = torch.cat(seen, dim=1)  # [M, steps, 3]
    mean = torch.tensor(levels)[actions[..., 0]].mean(dim=0).double()  # [steps]
    bars = torch.as_tensor(backtest.decision_bar)
    size = position_size(market.atr[bars], market.prices[bars, 3], market.contract.tick_size,
                         config.market.target_volatility).double()
    np.testing.assert_allclose(backtest.target, (mean * size).numpy(), rtol=1e-5, atol=1e-6)
    members = [evaluate_policy(greedy_policy(learner), market, "test", sizes) for learner in learners]
    assert not np.array_equal(members[0].target, members[1].target)  # two different members, one account
