"""The replay's batch gather: a learner batch from sampled slots of the lockstep ring, HER 'future' relabelling and
the n-step return included: the torch maths (the one home of HER's and the n-step window's maths), and the same
maths as one PyTorch operator, ``fitdqn::replay_gather``, with a Triton kernel on CUDA
(:mod:`fitdqn.ops.replay_gather_triton`).

The ring (:class:`fitdqn.replay.storage.RingStorage`): step t of env e is slot ``(t * E + e) % C``, so the same
env's step t + k is ``k * E`` slots on; ``written`` (a 0-dim device counter) steps have been written, the ring holds
``S = C / E`` of them. For each sampled slot ``index [B]`` (step s, episode step p):

- **HER 'future'** (:func:`future_goals`): with probability ``relabel_probability`` (``k / (k + 1)``) the goal
  becomes the ``achieved`` of a step j drawn uniformly from ``[s, min(episode end, newest step written)]`` of the
  same episode. Episodes are ``episode_length`` steps, so the end is ``s + episode_length - 1 - p``. An episode cut
  short by a terminal step is detected (step j's ``episode_step`` is not ``p + (j - s)``) and that draw falls back
  to j = s, the transition's own achieved, which is still a same-episode future goal. ``uniform [B, 2]`` f64:
  column 0 picks j, column 1 is the relabel coin.
- **n-step return** (:func:`nstep_window`): ``R = sum_{k<m} gamma^k (reward_k + goal_reward_k)``; the window stops
  after the episode's last step (flags bit 1) or a terminal step (flags bit 0), so ``m <= n``;
  ``discount = gamma^m * (1 - terminal of the last step)``. The caller guarantees all n slots of the window are
  written (the samplers only pick such slots). ``gamma_powers [n + 1]`` f32 are ``gamma ** k`` rounded once.
- **the batch** (:func:`gather_reference`): ``bar [B]`` int64, ``agent [B, Fa]``, ``action [B, A]`` int64,
  ``reward [B]`` f32, ``discount [B]`` f32, ``next_bar [B]`` int64 (the window's last step's bar + 1) and
  ``next_agent [B, Fa]`` (the last step's), the goal column of both agent rows set to the (possibly relabelled)
  goal.

The goal bonus: :class:`GoalCrossing` (the env's, ``FuturesEnv.goal_reward``) or None; the operator takes it by
its ``bonus``. The torch maths (:func:`nstep_window`) takes any :data:`GoalReward` callable.

Why an operator: eagerly the gather is a few dozen small kernels (0.30 ms at batch 8192 on an H200); the Triton
kernel is one launch, a lane per sample looping over its window, reading each field in its own dtype. The memory
planner traces the training step on fake tensors, often fake *CPU* tensors standing in for CUDA: the fake kernel
allocates exactly the seven results, what the Triton path allocates (the torch maths makes ``[B, n]`` windows and
HER's scratch besides). The CPU kernel is the torch maths, as is the CUDA kernel where Triton is not installed.

Exactness: integers, rows, goals and discounts are the torch maths' exactly; the kernel's return adds the terms
``reward_k * gamma^k`` (each rounded as the torch maths' product: no fused multiply-add, ``enable_fp_fusion=False``)
from k = 0 up in fp32, where torch's ``sum`` over the window may add in another order (the CPU's does at n = 5):
the returns agree within fp32 rounding (an ulp or two), not always bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fitdqn.ops.kernels import triton_available, triton_module
from fitdqn.transitions import EPISODE_END, TERMINAL

GoalReward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (before, after, goal) -> bonus
Relabel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (index, goal, uniform) -> goal


@dataclass(frozen=True)
class GoalCrossing:
    """The goal bonus: ``bonus`` where the episode's cumulative reward crosses the goal upwards,
    ``achieved_before < goal <= achieved_after``, else 0 (a :data:`GoalReward`; the operator takes it by its
    ``bonus``)."""

    bonus: float

    def __call__(self, achieved_before: torch.Tensor, achieved_after: torch.Tensor,
                 goal: torch.Tensor) -> torch.Tensor:
        crossed = (achieved_before < goal) & (achieved_after >= goal)
        return crossed.to(achieved_after.dtype) * self.bonus


def window_offsets(n_step: int, num_envs: int, device: torch.device | str) -> torch.Tensor:
    """``[n]`` int64: slot offsets ``k * E`` of a window's steps, by device arithmetic: the torch maths makes them at
    each call, which a CUDA graph captures (the CUDA kernel where Triton is off), where a host list's copy would not
    be."""
    return torch.arange(n_step, dtype=torch.int64, device=device) * num_envs


def powers_of_gamma(n_step: int, gamma: float, device: torch.device | str) -> torch.Tensor:
    """``[n + 1]`` f32: ``gamma ** k`` in float64 on the host, rounded to f32 once. From a host list, not device
    arithmetic: on the 'meta' device of the planner's replay sizing a factory is free, while the first pow there
    imports torch's Python decompositions (about 1.5 s)."""
    return torch.tensor([float(gamma) ** k for k in range(n_step + 1)], dtype=torch.float32, device=device)


def future_goals(index: torch.Tensor, goal: torch.Tensor, uniform: torch.Tensor, *, achieved: torch.Tensor,
                 episode_step: torch.Tensor, written: torch.Tensor, num_envs: int, episode_length: int,
                 relabel_probability: float) -> torch.Tensor:
    """HER 'future' goals ``[B]`` for slots ``index [B]`` whose stored goal is ``goal [B]`` (module docstring);
    ``uniform [B, 2]`` f64 in [0, 1); ``achieved``, ``episode_step`` the ring's ``[C]`` fields, ``written`` its
    0-dim step counter."""
    capacity = achieved.shape[0]
    steps = capacity // num_envs
    newest = torch.remainder(written - 1, steps)  # 0-dim ring row of the newest step
    row = torch.div(index, num_envs, rounding_mode="floor")  # [B]
    ahead = torch.remainder(newest - row, steps)  # [B] steps written after s
    step_in_episode = episode_step[index].long()  # [B] p
    span = torch.minimum(episode_length - 1 - step_in_episode, ahead).clamp_(min=0)  # [B]
    offset = torch.minimum((uniform[:, 0] * (span + 1)).long(), span)  # [B] j - s
    future = torch.remainder(index + offset * num_envs, capacity)  # [B] slot of j
    same_episode = episode_step[future].long() == step_in_episode + offset  # [B]
    future_goal = torch.where(same_episode, achieved[future], achieved[index])  # [B]
    relabelled = uniform[:, 1] < relabel_probability  # [B]
    return torch.where(relabelled, future_goal, goal)


@dataclass
class NStep:
    """What the learner needs from a window: return, discount and the slot of its last step."""

    reward: torch.Tensor  # [B] f32
    discount: torch.Tensor  # [B] f32
    last: torch.Tensor  # [B] int64 slot of the window's last step (next obs comes from it)


def nstep_window(index: torch.Tensor, goal: torch.Tensor, *, reward: torch.Tensor, achieved: torch.Tensor,
                 flags: torch.Tensor, offsets: torch.Tensor, gamma_powers: torch.Tensor,
                 goal_reward: GoalReward | None) -> NStep:
    """Window returns for slots ``index [B]`` under goal ``goal [B]`` (module docstring); ``reward``, ``achieved``,
    ``flags`` the ring's ``[C]`` fields, ``offsets [n]`` from :func:`window_offsets`, ``gamma_powers [n + 1]``."""
    capacity, n_step = reward.shape[0], offsets.shape[0]
    slots = torch.remainder(index.unsqueeze(1) + offsets, capacity)  # [B, n]
    window_flags = flags[slots]  # [B, n] uint8
    ended = (window_flags & (TERMINAL | EPISODE_END)) != 0  # [B, n]
    alive = (ended.cumsum(1) - ended.long()) == 0  # [B, n] step k is inside the window
    rewards = reward[slots]  # [B, n] f32
    if goal_reward is not None:
        after = achieved[slots]  # [B, n]
        rewards = rewards + goal_reward(after - rewards, after, goal.unsqueeze(1).expand_as(after))
    ret = (rewards * gamma_powers[:n_step] * alive).sum(1)  # [B]
    length = alive.sum(1)  # [B] m in 1..n
    last = slots.gather(1, (length - 1).unsqueeze(1)).squeeze(1)  # [B]
    terminal = (flags[last] & TERMINAL).to(torch.float32)  # [B]
    discount = gamma_powers[length] * (1.0 - terminal)  # [B]
    return NStep(reward=ret.to(torch.float32), discount=discount, last=last)


def gather_reference(agent: torch.Tensor, next_agent: torch.Tensor, bar: torch.Tensor, action: torch.Tensor,
                     reward: torch.Tensor, achieved: torch.Tensor, flags: torch.Tensor, index: torch.Tensor,
                     uniform: torch.Tensor, offsets: torch.Tensor, gamma_powers: torch.Tensor, goal_column: int,
                     relabel: Relabel | None, goal_reward: GoalReward | None) -> tuple[torch.Tensor, ...]:
    """The batch in torch maths (module docstring): ``(bar, agent, action, reward, discount, next_bar,
    next_agent)``. ``relabel(index, goal, uniform) -> goal``: HER (:func:`future_goals` bound to the ring), or None
    for HER off; ``agent``, ``next_agent``, ``bar``, ``action``, ``reward``, ``achieved``, ``flags``: the ring's
    fields."""
    rows = agent[index]  # [B, Fa]
    goal = rows[:, goal_column]  # [B]
    if relabel is not None:
        goal = relabel(index, goal, uniform)
    window = nstep_window(index, goal, reward=reward, achieved=achieved, flags=flags, offsets=offsets,
                          gamma_powers=gamma_powers, goal_reward=goal_reward)
    next_rows = next_agent[window.last]  # [B, Fa]
    rows[:, goal_column] = goal
    next_rows[:, goal_column] = goal
    return (bar[index].long(), rows, action[index].long(), window.reward, window.discount,
            bar[window.last].long() + 1, next_rows)


def check_inputs(agent: torch.Tensor, next_agent: torch.Tensor, bar: torch.Tensor, action: torch.Tensor,
                 reward: torch.Tensor, achieved: torch.Tensor, episode_step: torch.Tensor, flags: torch.Tensor,
                 index: torch.Tensor, uniform: torch.Tensor, written: torch.Tensor, gamma_powers: torch.Tensor,
                 n_step: int, num_envs: int, goal_column: int) -> None:
    """The operator's inputs (:func:`replay_gather`), or a ValueError saying what they should be."""
    capacity = agent.shape[0] if agent.dim() == 2 else -1
    columns = [bar, reward, achieved, episode_step, flags]
    problems = [
        agent.dim() != 2, next_agent.dim() != 2 or next_agent.shape[0] != capacity,
        action.dim() != 2 or action.shape[0] != capacity, any(t.shape != (capacity,) for t in columns),
        index.dim() != 1 or index.dtype != torch.int64, uniform.shape != (index.shape[0], 2),
        uniform.dtype != torch.float64, gamma_powers.shape != (n_step + 1,), gamma_powers.dtype != torch.float32,
        written.shape != () or written.dtype != torch.int64, n_step < 1, num_envs < 1, capacity % num_envs != 0,
        not 0 <= goal_column < min(agent.shape[-1], next_agent.shape[-1]),
    ]
    if any(problems):
        raise ValueError(
            f"replay_gather takes fields agent, next_agent [C, Fa], action [C, A], bar, reward, achieved, "
            f"episode_step, flags [C] (C a multiple of num_envs {num_envs}), index [B] int64, uniform [B, 2] f64, "
            f"written 0-dim int64, gamma_powers [n_step + 1] f32 (n_step {n_step}) and a goal column of the agent "
            f"rows ({goal_column}); got agent {tuple(agent.shape)}, next_agent {tuple(next_agent.shape)}, action "
            f"{tuple(action.shape)}, columns {[tuple(t.shape) for t in columns]}, index {tuple(index.shape)} "
            f"{index.dtype}, uniform {tuple(uniform.shape)} {uniform.dtype}, written {tuple(written.shape)} "
            f"{written.dtype}, gamma_powers {tuple(gamma_powers.shape)} {gamma_powers.dtype}")


def gather_maths(agent: torch.Tensor, next_agent: torch.Tensor, bar: torch.Tensor, action: torch.Tensor,
                 reward: torch.Tensor, achieved: torch.Tensor, episode_step: torch.Tensor, flags: torch.Tensor,
                 index: torch.Tensor, uniform: torch.Tensor, written: torch.Tensor, gamma_powers: torch.Tensor,
                 n_step: int, num_envs: int, episode_length: int, relabel_probability: float | None,
                 goal_column: int, goal_bonus: float | None) -> tuple[torch.Tensor, ...]:
    """The operator's torch maths (:func:`replay_gather`'s arguments): its CPU kernel, and its CUDA kernel where
    Triton is not installed."""
    check_inputs(agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform, written,
                 gamma_powers, n_step, num_envs, goal_column)
    relabel = None if relabel_probability is None else functools.partial(
        future_goals, achieved=achieved, episode_step=episode_step, written=written, num_envs=num_envs,
        episode_length=episode_length, relabel_probability=relabel_probability)
    return gather_reference(agent, next_agent, bar, action, reward, achieved, flags, index, uniform,
                            window_offsets(n_step, num_envs, index.device), gamma_powers, goal_column, relabel,
                            None if goal_bonus is None else GoalCrossing(goal_bonus))


@torch.library.custom_op("fitdqn::replay_gather", mutates_args=())
def replay_gather(agent: torch.Tensor, next_agent: torch.Tensor, bar: torch.Tensor, action: torch.Tensor,
                  reward: torch.Tensor, achieved: torch.Tensor, episode_step: torch.Tensor, flags: torch.Tensor,
                  index: torch.Tensor, uniform: torch.Tensor, written: torch.Tensor, gamma_powers: torch.Tensor,
                  n_step: int, num_envs: int, episode_length: int, relabel_probability: float | None,
                  goal_column: int, goal_bonus: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor]:
    """``(bar [B] int64, agent [B, Fa], action [B, A] int64, reward [B] f32, discount [B] f32, next_bar [B] int64,
    next_agent [B, Fa])`` for slots ``index [B]`` of the ring's fields (module docstring); ``relabel_probability``
    None: HER off; ``goal_bonus`` None: no goal bonus, else :class:`GoalCrossing`'s. The default (CPU) kernel is
    the torch maths (:func:`gather_maths`)."""
    return gather_maths(agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform,
                        written, gamma_powers, n_step, num_envs, episode_length, relabel_probability, goal_column,
                        goal_bonus)


@replay_gather.register_kernel("cuda")
def _replay_gather_cuda(agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform,
                        written, gamma_powers, n_step, num_envs, episode_length, relabel_probability, goal_column,
                        goal_bonus):
    if not triton_available():  # a CUDA device without Triton: the torch maths
        return gather_maths(agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform,
                            written, gamma_powers, n_step, num_envs, episode_length, relabel_probability, goal_column,
                            goal_bonus)
    return triton_module("fitdqn.ops.replay_gather_triton").fused_gather(
        agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform, written, gamma_powers,
        n_step, num_envs, episode_length, relabel_probability, goal_column, goal_bonus)


@replay_gather.register_fake
def _replay_gather_fake(agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform,
                        written, gamma_powers, n_step, num_envs, episode_length, relabel_probability, goal_column,
                        goal_bonus):
    check_inputs(agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform, written,
                 gamma_powers, n_step, num_envs, goal_column)
    return empty_results(agent, next_agent, action, index.shape[0])


def empty_results(agent: torch.Tensor, next_agent: torch.Tensor, action: torch.Tensor, batch_size: int
                  ) -> tuple[torch.Tensor, ...]:
    """The operator's seven results, uninitialised, on the fields' device (what the fake kernel and the Triton
    launcher allocate)."""
    vector = (batch_size,)
    return (agent.new_empty(vector, dtype=torch.int64), agent.new_empty((batch_size, agent.shape[1])),
            agent.new_empty((batch_size, action.shape[1]), dtype=torch.int64),
            agent.new_empty(vector, dtype=torch.float32), agent.new_empty(vector, dtype=torch.float32),
            agent.new_empty(vector, dtype=torch.int64),
            next_agent.new_empty((batch_size, next_agent.shape[1])))
