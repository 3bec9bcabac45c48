"""The env settings the market, backtest and learning tests run at, given in full (the library has no defaults).

Window, episode length, contracts and branches are the config's; rewards are 'pnl' at a fixed scale of 1e-3, so
the tests' hand-worked currency figures stay readable; one env, seed 0.
"""

from __future__ import annotations

from fitdqn.config import Config

TEST_REWARD_SCALE = 1e-3


def env_options(**overrides) -> dict:
    """Every keyword :meth:`fitdqn.market.env.FuturesEnv.from_market` needs, with ``overrides``."""
    config = Config()
    options = dict(num_envs=1, window=config.net.window, episode_length=config.market.episode_length,
                   max_contracts=config.market.max_contracts, reward_scale=TEST_REWARD_SCALE, reward="pnl",
                   risk_penalty=config.market.risk_penalty, target_volatility=config.market.target_volatility,
                   branches=config.net.branches, seed=0)
    return {**options, **overrides}
