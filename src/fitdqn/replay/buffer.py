"""The replay facade: ring storage + sampler + n-step + HER, all resident on the training device.

``write`` / ``sample`` / ``update_priorities`` make no host sync and branch only on configuration, so the
collector step and the learner update that call them can be captured in CUDA graphs.

Sampling is one ``torch.rand`` (from the caller's generator) followed by pure functions of those uniforms
and the buffer's tensors (:meth:`ReplayBuffer.batch_from_uniforms`): the prioritized draw and the priority update
are the operators of :mod:`fitdqn.ops.prioritized`, the gather (HER goals, n-step returns, the rows) the operator
``fitdqn::replay_gather`` (:mod:`fitdqn.ops.replay_gather`, the one home of that maths). Each operator picks its
kernel by device: the torch maths on the CPU, Triton on CUDA (the torch maths where Triton is missing), a fake
kernel in the planner's trace.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fitdqn.ops import replay_gather as gather_ops
from fitdqn.ops.replay_gather import GoalCrossing
from fitdqn.replay.sampler import PrioritizedSampler, UniformSampler, sampleable_steps
from fitdqn.replay.storage import RingStorage
from fitdqn.transitions import TransitionSpec

REQUIRED_FIELDS = ("bar", "agent", "action", "reward", "achieved", "next_agent", "episode_step", "flags")
REPLAY_BATCH_KEYS = ("bar", "agent", "action", "reward", "discount", "next_bar", "next_agent")  # the gather's, in order
Observe = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ReplayBuffer:
    """Lockstep transitions in, learner batches out (see docs/DESIGN.md, 'Replay -> learner')."""

    def __init__(
        self,
        spec: TransitionSpec,
        capacity: int,
        num_envs: int,
        *,
        n_step: int,
        gamma: float,
        episode_length: int,
        goal_column: int,
        prioritized: bool,
        alpha: float,
        priority_eps: float,
        her: bool,
        her_k: int,
        tree_fanout: int,
        device: torch.device | str,
        goal_reward: GoalCrossing | None = None,
        observe: Observe | None = None,
    ):
        missing = [name for name in REQUIRED_FIELDS if name not in spec]
        if missing:
            raise ValueError(f"transition spec lacks fields {missing} (docs/DESIGN.md, 'Transitions')")
        if goal_reward is not None and not isinstance(goal_reward, GoalCrossing):
            raise TypeError(f"the replay's goal reward is a GoalCrossing (the env's) or None, not {goal_reward!r}")
        if capacity // num_envs < n_step:
            raise ValueError(f"replay capacity {capacity} holds fewer than n_step={n_step} steps of "
                             f"{num_envs} envs")
        self.storage = RingStorage(spec, capacity, num_envs, device)
        self.device = self.storage.device
        self.capacity = self.storage.capacity
        self.num_envs = self.storage.num_envs
        self.n_step = int(n_step)
        self.episode_length = int(episode_length)
        self.goal_column = int(goal_column)
        self.goal_reward = goal_reward
        self.observe = observe
        self.prioritized = bool(prioritized)
        self.sampler: PrioritizedSampler | UniformSampler = (
            PrioritizedSampler(self.storage, n_step, alpha, priority_eps, tree_fanout) if prioritized
            else UniformSampler(self.storage, n_step)
        )
        self.gamma_powers = gather_ops.powers_of_gamma(self.n_step, gamma, self.device)  # [n + 1] f32, capturable
        self.relabel_probability = her_k / (her_k + 1.0) if her else None  # None: HER off

    @classmethod
    def from_config(cls, config, spec: TransitionSpec, capacity: int, *, goal_column: int,
                    device: torch.device | str, goal_reward: GoalCrossing | None = None,
                    observe: Observe | None = None, num_envs: int | None = None) -> ReplayBuffer:
        """Build from a :class:`fitdqn.config.Config` (``replay.*``, ``learn.n_step``, ``learn.gamma``,
        ``market.episode_length``, ``collect.num_envs``) and the planned capacity (see ``replay_component``);
        ``num_envs`` (None: ``collect.num_envs``) is for a buffer of another env count than the config's."""
        r = config.replay
        return cls(
            spec, capacity, config.collect.num_envs if num_envs is None else num_envs,
            n_step=config.learn.n_step, gamma=config.learn.gamma,
            episode_length=config.market.episode_length, goal_column=goal_column, goal_reward=goal_reward,
            prioritized=r.prioritized, alpha=r.alpha, priority_eps=r.priority_eps, her=r.her, her_k=r.her_k,
            tree_fanout=r.tree_fanout, observe=observe, device=device,
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor this buffer allocates (the planner counts their bytes)."""
        return [*self.storage.tensors(), *self.sampler.tensors(), self.gamma_powers]

    # ---- collector side ------------------------------------------------------------------------------
    def write(self, rows: dict[str, torch.Tensor]) -> None:
        """One lockstep step: ``rows[name]`` is ``[E, *shape]`` for every field of the spec."""
        step = self.storage.written.clone()  # 0-dim: the step being written
        self.storage.write(rows)
        self.sampler.on_write(step)

    def sampleable(self) -> torch.Tensor:
        """Transitions that can be sampled now (0-dim int64 device tensor; reading it is a host sync)."""
        return sampleable_steps(self.storage, self.n_step) * self.num_envs

    # ---- learner side --------------------------------------------------------------------------------
    def sample(self, batch_size: int, beta: float | torch.Tensor = 1.0,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """A batch of ``batch_size`` transitions: the keys of :meth:`gather`, plus ``weight``.

        ``beta`` may be a float or a 0-dim device tensor (use a tensor inside a CUDA graph, so it can
        change between replays). The buffer must hold sampleable transitions (the trainer waits for
        ``replay.min_fill``).
        """
        uniform = torch.rand(batch_size, 3, device=self.device, dtype=torch.float64,
                             generator=generator)  # [B, 3]: slot, HER future step, HER coin
        if not isinstance(beta, torch.Tensor):
            beta = torch.full((), beta, device=self.device, dtype=torch.float64)
        return self.observed(self.batch_from_uniforms(uniform, beta))

    def gather(self, index: torch.Tensor,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """n-step + HER batch for given slots ``index [B]``: bar, agent, action, reward, discount,
        next_bar, next_agent, index (and obs / next_obs when an ``observe`` callable was given)."""
        uniform = torch.rand(index.shape[0], 2, device=self.device, dtype=torch.float64,
                             generator=generator)  # [B, 2]: HER future step, HER coin
        return self.observed(self.gather_with_uniforms(index, uniform))

    def batch_from_uniforms(self, uniform: torch.Tensor, beta: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pure: ``uniform [B, 3]`` f64 -> batch with ``weight``; reads the buffer, writes nothing."""
        index, weight = self.sampler.draw(uniform[:, 0], beta)  # [B], [B]
        batch = self.gather_with_uniforms(index, uniform[:, 1:])
        batch["weight"] = weight
        return batch

    def gather_with_uniforms(self, index: torch.Tensor, uniform: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pure: the batch for slots ``index [B]``; ``uniform [B, 2]`` f64 drives HER. Keys :data:`REPLAY_BATCH_KEYS`
        (bar [B] int64, agent [B, Fa], action [B, 3] int64, reward [B] f32, discount [B] f32, next_bar [B] int64,
        next_agent [B, Fa]) and ``index``."""
        f = self.storage.fields
        bonus = None if self.goal_reward is None else self.goal_reward.bonus
        batch = gather_ops.replay_gather(
            f["agent"], f["next_agent"], f["bar"], f["action"], f["reward"], f["achieved"], f["episode_step"],
            f["flags"], index, uniform, self.storage.written, self.gamma_powers, self.n_step, self.num_envs,
            self.episode_length, self.relabel_probability, self.goal_column, bonus)
        return {**dict(zip(REPLAY_BATCH_KEYS, batch, strict=True)), "index": index}

    def observed(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Add ``obs`` / ``next_obs`` [B, W, S] through the ``observe`` callable, if one was given."""
        if self.observe is not None:
            batch["obs"] = self.observe(batch["bar"], batch["agent"])
            batch["next_obs"] = self.observe(batch["next_bar"], batch["next_agent"])
        return batch

    def update_priorities(self, index: torch.Tensor, priorities: torch.Tensor) -> None:
        """The learner's new priorities (|TD|, before ``** alpha``) for ``index``; a no-op if uniform."""
        self.sampler.update(index, priorities)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume exactly (tensors are the live ones: copy or save right away)."""
        return {
            "capacity": self.capacity,
            "num_envs": self.num_envs,
            "n_step": self.n_step,
            "prioritized": self.prioritized,
            "storage": self.storage.state_dict(),
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("capacity", "num_envs", "n_step", "prioritized"):
            if state[key] != getattr(self, key):
                raise ValueError(f"replay checkpoint has {key}={state[key]}, "
                                 f"this buffer {getattr(self, key)}")
        self.storage.load_state_dict(state["storage"])
        self.sampler.load_state_dict(state["sampler"])
