"""The env settings the market, backtest and learning tests run at, given in full (the library has no defaults).

Window, episode length, contracts and branches are the config's; rewards are 'pnl' at a fixed scale of 1e-3, so
the tests' hand-worked currency figures stay readable; positions in whole contracts; one env, seed 0.
"""

from __future__ import annotations

from fitdqn.config import Config, with_overrides
from fitdqn.market.env import FuturesEnv

TEST_REWARD_SCALE = 1e-3

# the sizes a test may set, by their config keys
SIZE_KEYS = {"window": "net.window", "branches": "net.branches", "episode_length": "market.episode_length",
             "max_contracts": "market.max_contracts", "reward_scale": "market.reward_scale",
             "reward": "market.reward", "risk_penalty": "market.risk_penalty"}


def env_options(**overrides) -> dict:
    """Every keyword :class:`fitdqn.market.env.FuturesEnv`'s constructor needs beside the tensors and the bars,
    with ``overrides``."""
    config = Config()
    options = dict(num_envs=1, window=config.net.window, episode_length=config.market.episode_length,
                   max_contracts=config.market.max_contracts, reward_scale=TEST_REWARD_SCALE, reward="pnl",
                   risk_penalty=config.market.risk_penalty, target_volatility=0.0,
                   branches=config.net.branches, seed=0)
    return {**options, **overrides}


def env_config(target_volatility: float = 0.0, **sizes) -> Config:
    """A resolved config of the test settings with ``sizes`` (:data:`SIZE_KEYS`); ``target_volatility`` > 0 sizes
    positions by volatility at that target, 0 holds whole contracts."""
    values = {"market.reward": "pnl", "market.reward_scale": TEST_REWARD_SCALE,
              "market.position_sizing": "volatility" if target_volatility > 0 else "contracts",
              "market.target_volatility": target_volatility, **{SIZE_KEYS[k]: v for k, v in sizes.items()}}
    return with_overrides(Config(), values)


def market_env(market, split, *, num_envs: int = 1, seed: int = 0, sequential: bool = False,
               goal_unit: float | None = None, **sizes) -> FuturesEnv:
    """The library's env factory on ``market`` at the test settings with ``sizes`` (:func:`env_config`)."""
    return FuturesEnv.from_config(env_config(**sizes), split, market=market, num_envs=num_envs, seed=seed,
                                  sequential=sequential, goal_unit=goal_unit)
