"""Plain-Python references and a fake lockstep env for the replay tests (no torch tricks here)."""

from __future__ import annotations

import numpy as np
import torch

from fitdqn.config import Config
from fitdqn.memory.component import tensor_bytes
from fitdqn.ops.replay_gather import GoalCrossing
from fitdqn.replay.sum_tree import level_sizes
from fitdqn.transitions import FieldSpec

AGENT_DIM = 6
GOAL_COLUMN = 4


def buffer_options(**overrides) -> dict:
    """Every keyword a :class:`fitdqn.replay.ReplayBuffer` takes, from the config's defaults (on the CPU, the goal in
    ``GOAL_COLUMN``), with ``overrides``."""
    config = Config()
    r = config.replay
    options = dict(n_step=config.learn.n_step, gamma=config.learn.gamma, episode_length=config.market.episode_length,
                   goal_column=GOAL_COLUMN, prioritized=r.prioritized, alpha=r.alpha, priority_eps=r.priority_eps,
                   her=r.her, her_k=r.her_k, tree_fanout=r.tree_fanout, device="cpu")
    return {**options, **overrides}


def transition_spec() -> dict[str, FieldSpec]:
    return {
        "bar": FieldSpec((), torch.int32),
        "agent": FieldSpec((AGENT_DIM,), torch.float32),
        "action": FieldSpec((3,), torch.uint8),
        "reward": FieldSpec((), torch.float32),
        "achieved": FieldSpec((), torch.float32),
        "next_agent": FieldSpec((AGENT_DIM,), torch.float32),
        "episode_step": FieldSpec((), torch.int32),
        "flags": FieldSpec((), torch.uint8),
    }


GOAL_BONUS = 0.5
goal_reward = GoalCrossing(GOAL_BONUS)  # the replay's goal bonus in these tests (the env's kind)


def crossing_bonus(before: torch.Tensor, after: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
    """``GOAL_BONUS`` where the cumulative reward crosses the goal upwards (``before < goal <= after``), else 0."""
    return GOAL_BONUS * ((before < goal) & (after >= goal)).float()


class FakeEnv:
    """E episodes stepped in lockstep; episodes last `length` steps unless a terminal step cuts them short.

    Keeps every row ever written (by absolute step) plus an episode id per row, for the references.
    """

    def __init__(self, num_envs: int, length: int, terminal_probability: float = 0.0,
                 terminal_sets_end: bool = True, seed: int = 0):
        self.num_envs, self.length = num_envs, length
        self.terminal_probability = terminal_probability
        self.terminal_sets_end = terminal_sets_end
        self.rng = np.random.default_rng(seed)
        self.episode_step = np.zeros(num_envs, dtype=np.int64)
        self.achieved = np.zeros(num_envs, dtype=np.float32)
        self.goal = self.rng.normal(size=num_envs).astype(np.float32)
        self.episode_id = np.arange(num_envs)
        self.next_episode = num_envs
        self.log: list[dict[str, np.ndarray]] = []

    def step(self) -> dict[str, torch.Tensor]:
        E, rng = self.num_envs, self.rng
        reward = rng.normal(scale=0.5, size=E).astype(np.float32)
        achieved = (self.achieved + reward).astype(np.float32)
        reward = (achieved - self.achieved).astype(np.float32)  # so achieved - reward is exact-ish
        terminal = rng.random(E) < self.terminal_probability
        last = self.episode_step == self.length - 1
        ends = last | (terminal & self.terminal_sets_end)
        flags = terminal.astype(np.uint8) | (ends.astype(np.uint8) << 1)
        agent = rng.normal(size=(E, AGENT_DIM)).astype(np.float32)
        agent[:, GOAL_COLUMN] = self.goal
        next_agent = rng.normal(size=(E, AGENT_DIM)).astype(np.float32)
        next_agent[:, GOAL_COLUMN] = self.goal
        rows = {
            "bar": rng.integers(10, 1000, size=E).astype(np.int32),
            "agent": agent,
            "action": rng.integers(0, 5, size=(E, 3)).astype(np.uint8),
            "reward": reward,
            "achieved": achieved,
            "next_agent": next_agent,
            "episode_step": self.episode_step.astype(np.int32),
            "flags": flags,
        }
        self.log.append({**{k: v.copy() for k, v in rows.items()}, "episode_id": self.episode_id.copy()})
        done = last | terminal
        self.achieved = np.where(done, 0.0, achieved).astype(np.float32)
        self.episode_step = np.where(done, 0, self.episode_step + 1)
        fresh = np.cumsum(done) - 1 + self.next_episode
        self.episode_id = np.where(done, fresh, self.episode_id)
        self.next_episode += int(done.sum())
        self.goal = np.where(done, rng.normal(size=E), self.goal).astype(np.float32)
        return {k: torch.from_numpy(v) for k, v in rows.items()}


def absolute_step(slot: int, num_envs: int, steps: int, written: int) -> tuple[int, int]:
    """(absolute step, env) stored in ``slot`` when ``written`` steps have been written."""
    row, env = divmod(slot, num_envs)
    return written - 1 - ((written - 1 - row) % steps), env


def nstep_reference(log, step: int, env: int, n: int, gamma: float, goal: float, with_goal_reward: bool):
    """(return, discount, last absolute step) by a plain loop over the logged rows."""
    total, last = 0.0, step
    for k in range(n):
        row = log[step + k]
        reward = torch.tensor(row["reward"][env])
        if with_goal_reward:
            achieved = torch.tensor(row["achieved"][env])
            goal_tensor = torch.tensor(goal, dtype=torch.float32)
            reward = reward + crossing_bonus(achieved - reward, achieved, goal_tensor)
        total += gamma**k * float(reward)
        last = step + k
        if row["flags"][env] & 3:
            break
    terminal = bool(log[last]["flags"][env] & 1)
    discount = 0.0 if terminal else gamma ** (last - step + 1)
    return total, discount, last


def tree_reference_find(leaves: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """Index i with prefix(i) <= mass < prefix(i + 1) by cumsum + searchsorted."""
    return np.searchsorted(np.cumsum(leaves), mass, side="right")


def gather_at_4a736f8(storage, index: torch.Tensor, uniform: torch.Tensor, *, n_step: int, gamma: float,
                      episode_length: int, her_k: int | None, goal_column: int, goal_reward) -> dict[str, torch.Tensor]:
    """The replay's gather as commit 4a736f8 wrote it, op for op (``ReplayBuffer.gather_with_uniforms`` over
    ``replay/her.py``'s ``FutureGoals`` and ``replay/nstep.py``'s ``NStepReturns``; ``her_k`` None: HER off): the
    frozen reference its successors must equal bit for bit on the CPU."""
    s, fields = storage, storage.fields
    offsets = torch.tensor([k * s.num_envs for k in range(n_step)], dtype=torch.int64)  # [n]
    gamma_powers = torch.tensor([gamma ** k for k in range(n_step + 1)], dtype=torch.float32)  # [n + 1]
    agent = fields["agent"][index]  # [B, Fa]
    goal = agent[:, goal_column]  # [B]
    if her_k is not None:  # FutureGoals.__call__
        newest = torch.remainder(s.written - 1, s.steps)
        row = torch.div(index, s.num_envs, rounding_mode="floor")
        ahead = torch.remainder(newest - row, s.steps)
        episode_step = fields["episode_step"][index].long()
        span = torch.minimum(episode_length - 1 - episode_step, ahead).clamp_(min=0)
        offset = torch.minimum((uniform[:, 0] * (span + 1)).long(), span)
        future = torch.remainder(index + offset * s.num_envs, s.capacity)
        same_episode = fields["episode_step"][future].long() == episode_step + offset
        achieved = fields["achieved"]
        future_goal = torch.where(same_episode, achieved[future], achieved[index])
        relabelled = uniform[:, 1] < her_k / (her_k + 1.0)
        goal = torch.where(relabelled, future_goal, goal)
    # NStepReturns.__call__
    slots = torch.remainder(index.unsqueeze(1) + offsets, s.capacity)  # [B, n]
    flags = fields["flags"][slots]
    ended = (flags & 3) != 0
    alive = (ended.cumsum(1) - ended.long()) == 0
    reward = fields["reward"][slots]
    if goal_reward is not None:
        achieved = fields["achieved"][slots]
        reward = reward + goal_reward(achieved - reward, achieved, goal.unsqueeze(1).expand_as(achieved))
    ret = (reward * gamma_powers[:n_step] * alive).sum(1)
    length = alive.sum(1)
    last = slots.gather(1, (length - 1).unsqueeze(1)).squeeze(1)
    terminal = (fields["flags"][last] & 1).to(torch.float32)
    discount = gamma_powers[length] * (1.0 - terminal)
    next_agent = fields["next_agent"][last]
    agent[:, goal_column] = goal
    next_agent[:, goal_column] = goal
    return {"bar": fields["bar"][index].long(), "agent": agent, "action": fields["action"][index].long(),
            "reward": ret.to(torch.float32), "discount": discount, "next_bar": fields["bar"][last].long() + 1,
            "next_agent": next_agent, "index": index}


def check_rows(spec: dict[str, FieldSpec], rows: dict[str, torch.Tensor], num_rows: int) -> None:
    """Raise ValueError if ``rows`` does not hold exactly the spec's fields as ``[num_rows, *shape]``.

    Shape/dtype checks only (metadata, no host sync).
    """
    missing = sorted(set(spec) - set(rows))
    extra = sorted(set(rows) - set(spec))
    if missing or extra:
        raise ValueError(f"transition fields: missing {missing}, unexpected {extra}")
    for name, field in spec.items():
        tensor = rows[name]
        if tuple(tensor.shape) != field.batched(num_rows):
            raise ValueError(
                f"field '{name}': shape {tuple(tensor.shape)}, expected {field.batched(num_rows)}")
        if tensor.dtype != field.dtype:
            raise ValueError(f"field '{name}': dtype {tensor.dtype}, expected {field.dtype}")


def update_max(tree, index: torch.Tensor, values: torch.Tensor) -> None:
    """Set ``tree``'s leaves ``index [M]`` to ``values [M]``; for a duplicated index the largest value wins."""
    tree.leaves.scatter_reduce_(0, index, values.to(tree.leaves.dtype), reduce="amax", include_self=False)
    tree.propagate(index)


def sum_tree_bytes(num_leaves: int, fanout: int) -> int:
    """Bytes of a :class:`SumTree`'s levels (the same sizes it allocates)."""
    return sum(tensor_bytes((size,), torch.float64) for size in level_sizes(num_leaves, fanout))
