"""The gymnasium adapters: registration, env checker, episodes, the native vector env."""

from __future__ import annotations

import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode

import fitdqn.market  # noqa: F401  (registers fitdqn/Futures-v0)
from fitdqn.config import Config, with_overrides
from fitdqn.gym_env import FuturesGymEnv, FuturesVectorEnv


@pytest.fixture(scope="module")
def market():
    from fitdqn.market.loader import load_market

    return load_market(Config().market, window=8)


def test_the_action_space_follows_the_branches():
    config = with_overrides(Config(), {"net.branches": (5, 1, 1)})
    env = gymnasium.make("fitdqn/Futures-v0", config=config)
    assert env.action_space == gymnasium.spaces.MultiDiscrete([5, 1, 1])
    env.close()


def test_registered_and_passes_the_env_checker():
    assert "fitdqn/Futures-v0" in gymnasium.registry
    env = gymnasium.make("fitdqn/Futures-v0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checker's warnings count as failures too
        check_env(env.unwrapped)
    assert env.action_space == gymnasium.spaces.MultiDiscrete([5, 5, 5])
    assert env.observation_space.shape == (8, 80) and env.observation_space.dtype == np.float32
    env.close()


def test_episode_through_gymnasium(market):
    env = gymnasium.make("fitdqn/Futures-v0", market=market, episode_length=10, window=4)
    obs, info = env.reset(seed=3)
    assert obs.shape == (4, 80) and env.observation_space.contains(obs)
    total, steps = 0.0, 0
    while True:
        obs, reward, terminated, truncated, info = env.step(np.array([3, 0, 0]))
        total += reward
        steps += 1
        assert env.observation_space.contains(obs) and not truncated
        if terminated:
            break
    assert steps == 10
    assert obs[-1, -1] == 0.0  # terminal observation: no episode left
    assert obs[-1, 72 + 6] == pytest.approx(total, rel=1e-5)  # achieved = episode reward
    again, _ = env.reset(seed=3)
    first, _ = gymnasium.make("fitdqn/Futures-v0", market=market, episode_length=10, window=4).reset(seed=3)
    np.testing.assert_array_equal(again, first)


def test_synthetic_data_and_bad_argument():
    env = FuturesGymEnv(data="synthetic", synthetic_bars=1200, episode_length=50)
    assert env.env.contract.name == "generic"
    with pytest.raises(TypeError, match="unknown argument"):
        FuturesGymEnv(lr=1.0)


def test_native_vector_env(market):
    envs = gymnasium.make_vec(
        "fitdqn/Futures-v0",
        num_envs=6,
        vectorization_mode="vector_entry_point",
        market=market,
        episode_length=5,
    )
    assert isinstance(envs.unwrapped, FuturesVectorEnv)
    assert envs.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (6, 8, 80) and envs.single_observation_space.shape == (8, 80)
    envs.action_space.seed(0)
    for _ in range(5):
        obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())
        assert rewards.shape == (6,) and not truncated.any()
    assert terminated.all() and infos["_final_obs"].all()
    assert infos["final_obs"][0].shape == (8, 80) and infos["final_obs"][0][-1, -1] == 0.0
    assert (obs[:, -1, -1] == 1.0).all()  # same-step autoreset: the new episodes' first observations
    envs.close()
