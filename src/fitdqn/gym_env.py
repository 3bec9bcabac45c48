"""Gymnasium adapters over :class:`fitdqn.market.env.FuturesEnv` (registered as ``fitdqn/Futures-v0``).

* :class:`FuturesGymEnv` -- one episode, ``gymnasium.make("fitdqn/Futures-v0", data="sp500")``; numpy in and
  out, passes ``gymnasium.utils.env_checker.check_env``. The episode ends (``terminated``) after
  ``episode_length`` steps; the observation returned then is the terminal one; call ``reset()`` next.
* :class:`FuturesVectorEnv` -- the native batched env as a ``gymnasium.vector.VectorEnv``,
  ``gymnasium.make_vec("fitdqn/Futures-v0", num_envs=1024, vectorization_mode="vector_entry_point")``: one
  FuturesEnv with E episodes (on ``device``, numpy at the boundary), same-step autoreset: when an episode
  ends its new first observation is returned and the terminal one is in ``infos["final_obs"]``.

Action: ``MultiDiscrete([5, 5, 5])`` (target position, stop, take-profit; see ``fitdqn.market.env``).
Observation: ``Box [W, S] float32`` (W = ``window`` bars, S = 72 features + 8 agent-state columns).
Keyword arguments (all optional): ``data``, ``contract``, ``split``, ``window``, ``episode_length``,
``max_contracts``, ``reward_scale``, ``synthetic_bars``, ``synthetic_signal``, ``train_fraction``,
``validation_fraction``, ``config`` (a :class:`fitdqn.config.Config` they override; its defaults when not
given), ``market`` (a loaded :class:`fitdqn.market.loader.Market` to share), ``device`` (not given: the market's,
the CPU for a market loaded here), ``seed`` (not given: ``train.seed``). ``num_envs`` of the vector env is
``gymnasium.make_vec``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gymnasium
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from fitdqn.config import Config
from fitdqn.market.env import FuturesEnv
from fitdqn.market.features import CLIP
from fitdqn.market.layout import AGENT_FIELDS, NUM_BRANCHES, NUM_FEATURES
from fitdqn.market.loader import Market, load_market
from fitdqn.market.observation import build_observation
from fitdqn.resolve import resolve_for_market
from fitdqn.transitions import EPISODE_END, TERMINAL

_MARKET_KEYS = (
    "data",
    "contract",
    "episode_length",
    "max_contracts",
    "reward_scale",
    "synthetic_bars",
    "synthetic_signal",
    "train_fraction",
    "validation_fraction",
)


def _build_env(num_envs: int, *, config: Config | None, market: Market | None, split: str, window: int | None,
               device, seed: int | None, overrides: dict[str, Any]) -> FuturesEnv:
    unknown = sorted(set(overrides) - set(_MARKET_KEYS))
    if unknown:
        raise TypeError(f"unknown argument(s) {unknown}; accepted: {', '.join(_MARKET_KEYS)}, split, window, "
                        "config, market, device, seed")
    config = config or Config()
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        config = dataclasses.replace(config, market=dataclasses.replace(config.market, **given))
    if window is not None:
        config = dataclasses.replace(config, net=dataclasses.replace(config.net, window=int(window)))
    if market is None:
        market = load_market(config.market, window=config.net.window, device=device)
    config, _ = resolve_for_market(config, market)  # the values left to the data, as a run resolves them
    return FuturesEnv.from_config(config, split, market=market, num_envs=num_envs, seed=seed)


def _spaces(window: int, branches: tuple[int, ...]) -> tuple[spaces.Box, spaces.MultiDiscrete]:
    """Observation and action spaces; ``branches``: (target positions, stop choices, take-profit choices)."""
    big = float(np.finfo(np.float32).max)
    bounds = {
        "position": (-1.0, 1.0),
        "time_in_trade": (0.0, 1.0),
        "stop_distance": (0.0, 1.0),
        "take_profit_distance": (0.0, 1.0),
        "episode_left": (0.0, 1.0),
    }  # unrealised_pnl, goal, achieved: unbounded
    low = [-CLIP] * NUM_FEATURES + [bounds.get(f, (-big, big))[0] for f in AGENT_FIELDS]
    high = [CLIP] * NUM_FEATURES + [bounds.get(f, (-big, big))[1] for f in AGENT_FIELDS]
    low_w = np.tile(np.asarray(low, dtype=np.float32), (window, 1))
    high_w = np.tile(np.asarray(high, dtype=np.float32), (window, 1))
    observation = spaces.Box(low=low_w, high=high_w, dtype=np.float32)
    action = spaces.MultiDiscrete(list(branches))
    return observation, action


class FuturesGymEnv(gymnasium.Env):
    """One futures-trading episode at a time through the gymnasium API (a FuturesEnv with E = 1)."""

    metadata = {"render_modes": []}

    def __init__(self, *, config: Config | None = None, market: Market | None = None, split: str = "train",
                 window: int | None = None, device=None, seed: int | None = None, render_mode: str | None = None,
                 **overrides: Any) -> None:
        self.env = _build_env(1, config=config, market=market, split=split, window=window, device=device, seed=seed,
                              overrides=overrides)
        self.render_mode = render_mode
        self.observation_space, self.action_space = _spaces(self.env.window, self.env.branches)

    def _obs(self, bar: torch.Tensor, agent: torch.Tensor) -> np.ndarray:
        obs = build_observation(self.env.features, bar, agent, self.env.window)[0]  # [W, S]
        return obs.cpu().numpy().astype(np.float32, copy=True)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is not None:
            self.env.reset(seed=seed)
        else:
            self.env.reset()
        return self._obs(self.env.bar, self.env.agent), {"bar": int(self.env.bar[0])}

    def step(self, action):
        act = torch.as_tensor(
            np.asarray(action, dtype=np.int64).reshape(1, NUM_BRANCHES), device=self.env.device
        )
        out = self.env.step(act)
        flags = int(out["flags"][0])  # host sync
        if flags & EPISODE_END:  # the env has already started a new episode inside; show the terminal observation
            obs = self._obs(out["bar"].long() + 1, out["next_agent"])
        else:
            obs = self._obs(out["current_bar"], out["current_agent"])
        info = {
            "bar": int(out["bar"][0]),
            "pnl": float(out["pnl"][0]),
            "cost": float(out["cost"][0]),
            "position": float(out["position"][0]),
            "exit": int(out["exit"][0]),
        }
        return obs, float(out["reward"][0]), bool(flags & TERMINAL), False, info


class FuturesVectorEnv(VectorEnv):
    """E futures episodes as one native batched FuturesEnv behind the gymnasium VectorEnv API (same-step
    autoreset; numpy at the boundary, so each step copies observations to the host)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP, "render_modes": []}

    def __init__(self, num_envs: int, *, config: Config | None = None, market: Market | None = None,
                 split: str = "train", window: int | None = None, device=None, seed: int | None = None,
                 render_mode: str | None = None, **overrides: Any) -> None:
        self.env = _build_env(num_envs, config=config, market=market, split=split, window=window, device=device,
                              seed=seed, overrides=overrides)
        self.num_envs = int(num_envs)
        self.render_mode = render_mode
        single_obs, single_action = _spaces(self.env.window, self.env.branches)
        self.single_observation_space = single_obs
        self.single_action_space = single_action
        self.observation_space = batch_space(single_obs, self.num_envs)
        self.action_space = batch_space(single_action, self.num_envs)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        obs = self.env.reset(seed=seed)
        return obs.cpu().numpy(), {}

    def step(self, actions):
        act = torch.as_tensor(np.asarray(actions, dtype=np.int64), device=self.env.device)
        act = act.reshape(self.num_envs, NUM_BRANCHES)
        out = self.env.step(act)
        # host sync: everything below crosses to numpy
        obs = self.env.observation().cpu().numpy()
        flags = out["flags"].cpu().numpy()
        ended = (flags & EPISODE_END) != 0
        terminal_obs = (
            build_observation(self.env.features, out["bar"].long() + 1, out["next_agent"], self.env.window)
            .cpu()
            .numpy()
        )
        final_obs = np.empty(self.num_envs, dtype=object)
        for e in np.flatnonzero(ended):
            final_obs[e] = terminal_obs[e]
        infos = {
            "pnl": out["pnl"].cpu().numpy(),
            "position": out["position"].cpu().numpy(),
            "final_obs": final_obs,
            "_final_obs": ended,
        }
        rewards = out["reward"].cpu().numpy()
        return obs, rewards, (flags & TERMINAL) != 0, np.zeros(self.num_envs, dtype=bool), infos
