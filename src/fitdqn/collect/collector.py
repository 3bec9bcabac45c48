"""The experience collector: the policy acts on the vectorised env on the device and writes into replay.

One ``step`` = observe ``[E, W, S]`` -> ``Learner.act`` (epsilon-greedy, C51 or IQN-CVaR by config) ->
``FuturesEnv.step`` -> one lockstep row per env into the replay (n-step returns are built by the replay at
sample time, from the lockstep layout). All tensors, no host sync, no Python branch on a tensor value, so
on CUDA the whole step is captured once in a graph (:meth:`Collector.capture`) and replayed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fitdqn.config import LearnConfig
from fitdqn.device.graphs import capture_graph
from fitdqn.learn.learner import Learner
from fitdqn.market.env import FuturesEnv
from fitdqn.market.layout import state_shapes
from fitdqn.replay.buffer import ReplayBuffer
from fitdqn.transitions import EPISODE_END

COLLECT_STAT_KEYS = ("reward", "pnl", "cost", "episodes_done")


def epsilon_at(env_steps: Tensor, learn: LearnConfig, decay_steps: int) -> Tensor:
    """Linear decay from epsilon_start to epsilon_end over ``decay_steps`` env steps (a device tensor;
    ``decay_steps`` = ``learn.epsilon_decay_fraction`` of the run's env steps, :class:`fitdqn.learn.Schedule`)."""
    progress = (env_steps.to(torch.float32) / max(decay_steps, 1)).clamp(max=1.0)
    return learn.epsilon_start + (learn.epsilon_end - learn.epsilon_start) * progress


class Collector:
    """Runs ``learner.act`` on ``env`` and writes every step into ``replay``."""

    def __init__(self, env: FuturesEnv, learner: Learner, replay: ReplayBuffer, learn: LearnConfig,
                 epsilon_decay_steps: int, generator: torch.Generator | None = None) -> None:
        self.env, self.learner, self.replay, self.learn = env, learner, replay, learn
        self.epsilon_decay_steps = int(epsilon_decay_steps)
        self.device = env.device
        self.generator = generator
        self.fields = tuple(replay.storage.fields)
        self.env_steps = torch.zeros((), dtype=torch.int64, device=self.device)  # over all envs
        self.stats = {key: torch.zeros((), dtype=torch.float64, device=self.device) for key in COLLECT_STAT_KEYS}
        self.graph: torch.cuda.CUDAGraph | None = None

    def step(self) -> None:
        """One env step for every env. Eager; on CUDA prefer :meth:`run` after :meth:`capture`."""
        obs = self.env.observation()  # [E, W, S]
        action = self.learner.act(obs, epsilon_at(self.env_steps, self.learn, self.epsilon_decay_steps),
                                    self.generator)  # [E, 3]
        out = self.env.step(action)
        self.replay.write({name: out[name] for name in self.fields})
        self.env_steps.add_(self.env.num_envs)
        self.stats["reward"].add_(out["reward"].sum())
        self.stats["pnl"].add_(out["pnl"].sum())
        self.stats["cost"].add_(out["cost"].sum())
        self.stats["episodes_done"].add_((out["flags"] & EPISODE_END).ne(0).sum())

    def capture(self, stream: torch.cuda.Stream | None = None, warmup: int = 2) -> None:
        """Capture :meth:`step` in a CUDA graph (warm-up steps run eagerly on a side stream first).

        The warm-up steps are real steps: they write into the replay like any other.
        """
        self.graph, _ = capture_graph(self.step, self.device, stream, warmup,
                                      generators=(self.env.generator, self.generator))

    def run(self, steps: int) -> None:
        """``steps`` env steps: graph replays when captured, else eager steps."""
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()

    def take_stats(self) -> dict[str, float]:
        """Sums since the last call (host sync: reads the device counters), then resets them."""
        values = {key: float(value) for key, value in self.stats.items()}
        for value in self.stats.values():
            value.zero_()
        return values

    def state_dict(self) -> dict:
        return {"env_steps": self.env_steps.clone(), "env": self.env_state()}

    def env_state(self) -> dict[str, Tensor]:
        names = [*self.env_state_names(), "generator"]
        state = {name: getattr(self.env, name).clone() for name in names[:-1]}
        state["generator"] = self.env.generator.get_state()
        return state

    def env_state_names(self) -> list[str]:
        return list(state_shapes(self.env.num_envs))

    def load_state_dict(self, state: dict) -> None:
        self.env_steps.copy_(state["env_steps"])
        for name in self.env_state_names():
            getattr(self.env, name).copy_(state["env"][name])
        # a generator's state is a CPU byte tensor, whatever device the checkpoint was mapped to
        self.env.generator.set_state(state["env"]["generator"].cpu())
