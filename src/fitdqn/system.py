"""The training system, assembled once: market tensors, env, replay, learner, collector and their two steps.

:func:`build_system` is the one place the parts are built and wired. The trainer calls it on the real device,
under its allocation ledger (each part measured in plan order); the planner (:mod:`fitdqn.plan.build`) calls it
inside the memory tracer's fake mode and traces the very :meth:`System.update_step` and
:meth:`System.collect_step` the trainer captures in CUDA graphs. Nothing here knows which of the two it serves.

Construction order: collector (market tensors + env state), replay, networks with their optimizers, each part
taking its collaborators at construction (the replay the env's goal bonus and the observation of its bars); the
budget subtracts the same fixed bytes in whatever order they are allocated. The batch was chosen before (the plan)
and is an argument.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor

from fitdqn.collect.collector import Collector
from fitdqn.config import Config
from fitdqn.learn.learner import Learner
from fitdqn.learn.precision import autocast_dtype
from fitdqn.market.contract import ContractSpec
from fitdqn.market.env import FuturesEnv
from fitdqn.market.layout import GOAL_COLUMN, NUM_FEATURES, WARMUP, market_tensor_shapes, transition_spec
from fitdqn.market.loader import Market
from fitdqn.market.observation import build_observation
from fitdqn.market.splits import split_bars
from fitdqn.memory.component import ComponentName
from fitdqn.nets.groups import parameter_groups
from fitdqn.replay.buffer import ReplayBuffer

UPDATE_STAT_KEYS = ("loss", "c51_loss", "iqn_loss", "iql_loss", "q_mean", "grad_norm")  # summed over an epoch's updates
SAMPLE_SEED_OFFSET = 1  # train.seed + 1: the replay's sampling generator
ACT_SEED_OFFSET = 2  # train.seed + 2: the collector's exploration generator

Measure = Callable[[str], AbstractContextManager[None]]  # phase name -> a context that measures its allocations


@contextlib.contextmanager
def _unmeasured(_phase: str) -> Iterator[None]:
    yield


@dataclass
class System:
    """Everything one run allocates on its device, and the two steps that run on it (each capturable: no host
    sync, no Python branch on a tensor value)."""

    config: Config
    market: Market  # its tensors on the device
    env: FuturesEnv
    replay: ReplayBuffer
    learner: Learner
    collector: Collector
    sample_generator: torch.Generator
    act_generator: torch.Generator
    beta: Tensor  # 0-dim: the importance-weight exponent, set between epochs
    stat_sums: dict[str, Tensor]  # 0-dim float64 each (UPDATE_STAT_KEYS)
    batch_size: int

    def update_step(self) -> None:
        """sample -> build observations -> update -> new priorities; the losses summed into ``stat_sums``."""
        batch = self.replay.sample(self.batch_size, self.beta, self.sample_generator)
        out = self.learner.update(batch)
        self.replay.update_priorities(batch["index"], out["priorities"])
        for key in UPDATE_STAT_KEYS:
            self.stat_sums[key].add_(out[key].double())

    def collect_step(self) -> None:
        """One env step of every env: observe -> act -> env step -> one replay row per env."""
        self.collector.step()

    def set_batch_size(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.learner.set_batch_size(batch_size)

    def memory_calls(self) -> dict[str, list[tuple[object, str]]]:
        """The replay's own work in the update step, for the tracer's attribution: drawing and gathering a
        batch (HER's relabelling included: it is inside the gather operator, which allocates only its results) and
        writing new priorities; building observations is not."""
        return {ComponentName.REPLAY: [(self.replay, "batch_from_uniforms"), (self.replay, "update_priorities")]}

    def memory_groups(self) -> dict[str, list[torch.nn.Module]]:
        """The modules of each memory group (online and target networks), for the tracer's attribution."""
        groups = {name: list(group.modules) for name, group in parameter_groups(self.learner).items()}
        for name, group in parameter_groups(self.learner.target).items():
            groups[name] = groups[name] + list(group.modules)
        return groups


def build_system(config: Config, market: Market, device: torch.device, *, capacity: int, batch_size: int,
                 epsilon_decay_steps: int, goal_unit: float | None = None, measure: Measure = _unmeasured) -> System:
    """The system of a resolved ``config`` on ``device``, built in the module docstring's order, each part under
    ``measure``.

    ``market``: bars and tensors (moved to ``device`` here if they are elsewhere); ``capacity``: the planned
    replay capacity; ``goal_unit``: HER's goal scale when it is known without reading the market's tensors
    (a stand-in market on fake tensors), else derived from the market's training split."""
    sample_generator = torch.Generator(device=device)
    sample_generator.manual_seed(config.train.seed + SAMPLE_SEED_OFFSET)
    act_generator = torch.Generator(device=device)
    act_generator.manual_seed(config.train.seed + ACT_SEED_OFFSET)
    with measure(ComponentName.COLLECTOR):
        market = market_on(market, device)
        env = FuturesEnv.from_config(config, "train", market=market, device=device, goal_unit=goal_unit)
    features, window = env.features, config.net.window  # [bars, F]: the env's features, which batches observe
    observed_dtype = autocast_dtype(config.learn.precision, device)  # learner batches: what autocast would cast to
    noise = config.learn.obs_noise
    noised = slice(None) if config.learn.obs_noise_on == "all" else slice(0, NUM_FEATURES)  # token columns

    def observe(bar: Tensor, agent: Tensor) -> Tensor:
        """A learner batch's observations ``[B, W, S]``; with ``learn.obs_noise`` fresh Gaussian noise of that
        standard deviation is added where they are built, in place (a regulariser against memorising the
        training bars; no noised copy is held beside them through the update), to the columns
        ``learn.obs_noise_on`` names."""
        tokens = build_observation(features, bar, agent, window, observed_dtype)  # [B, W, S]
        if noise > 0:
            part = tokens[..., noised]  # a view: the add lands in the tokens
            part.add_(noise * torch.randn_like(part))
        return tokens

    with measure(ComponentName.REPLAY):
        # the goal bonus comes with HER's goals only (replay.her); off, the reward is the P&L's
        replay = ReplayBuffer.from_config(config, transition_spec(), capacity, goal_column=GOAL_COLUMN,
                                          goal_reward=env.goal_reward if config.replay.her else None,
                                          observe=observe, device=device)
    with measure("networks"):
        learner = Learner(config, env.state_dim, device)
        learner.set_batch_size(batch_size)
    collector = Collector(env, learner, replay, config.learn, epsilon_decay_steps, act_generator)
    beta = torch.full((), config.replay.beta_start, device=device)
    stat_sums = {key: torch.zeros((), dtype=torch.float64, device=device) for key in UPDATE_STAT_KEYS}
    return System(config, market, env, replay, learner, collector, sample_generator, act_generator, beta,
                  stat_sums, batch_size)


def market_on(market: Market, device: torch.device) -> Market:
    """The same market with its tensors on ``device`` (loaded on the CPU before the plan existed)."""
    if market.features.device == torch.device(device):
        return market
    return dataclasses.replace(market, features=market.features.to(device), prices=market.prices.to(device),
                               atr=market.atr.to(device))


STAND_IN_CONTRACT = ContractSpec("stand-in", multiplier=1.0, tick_size=1.0, commission=0.0, slippage_ticks=0.0)


def stand_in_market(config: Config, num_bars: int) -> Market:
    """A market of ``num_bars`` zero bars with the config's splits, made on the current default device: what
    the planner builds the system on inside the tracer's fake mode (only shapes and dtypes count there). It has
    no bars table (``bars = None``): the planner imports no data pipeline (pandas)."""
    tensors = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in market_tensor_shapes(num_bars).items()}
    tensors["prices"] = tensors["prices"] + 1.0  # positive prices (stand-in values; nothing reads them)
    m = config.market
    return Market(name="stand-in", bars=None, contract=STAND_IN_CONTRACT,
                  splits=split_bars(num_bars, m.train_fraction, m.validation_fraction), warmup=WARMUP,
                  volume_features=True, **tensors)
