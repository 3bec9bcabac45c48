"""Triton kernel of the replay's batch gather (``fitdqn::replay_gather`` on CUDA; the maths and the reference are in
:mod:`fitdqn.ops.replay_gather`): one launch, a lane per sample.

Each lane reads its slot's goal (the agent row's goal column); under HER it draws the future step as the torch maths
does (the ring's newest row from the device counter ``written``, the span to the episode's end or the newest step,
``uniform``'s column 0 for the step, column 1 the coin, both float64, the relabel probability compared in float64)
and takes that step's ``achieved``, or its own where the episode was cut short. Then it walks its n-step window:
at step k (slot ``(index + k E) % C``) it reads the flags and the reward (and ``achieved`` for the goal bonus,
:class:`~fitdqn.ops.replay_gather.GoalCrossing`'s: ``bonus`` where ``achieved - reward < goal <= achieved``), adds
``reward_k * gamma^k`` to the return while the window is open, and closes it after a terminal or episode-end step;
the last open step gives the discount ``gamma^m (1 - terminal)``, the next bar and the next agent row. Rows are
``[BLOCK, width]`` tiles (the width padded to a power of two, masked), read in the field's dtype, the goal column
replaced; bars and actions widened to int64.

Every field is read in its own dtype (the ring's fields contiguous; ``index`` and ``uniform`` of any strides);
``gamma ** k`` comes from the same ``[n + 1]`` f32 tensor as the torch maths. The return's multiply and add are
kept apart (``enable_fp_fusion=False``), so each term rounds as the torch maths' product does, the terms added from
k = 0 up; integers, rows and goals are exact.

Launch shape: ``BLOCK`` samples a program, ``WARPS`` warps; grid ``[ceil(B / BLOCK)]``. Not tuned on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitdqn.ops.kernels import next_power_of_2, on_device
from fitdqn.ops.prioritized_triton import _as_f64, bits
from fitdqn.ops.replay_gather import check_inputs, empty_results
from fitdqn.transitions import EPISODE_END, TERMINAL

BLOCK = 128  # samples per program
WARPS = 4


@triton.jit
def _floor_mod(x, m):
    """``x mod m`` in ``[0, m)`` for any sign of ``x`` (``torch.remainder``; Triton's ``%`` keeps the sign of x)."""
    r = x % m
    return tl.where(r < 0, r + m, r)


@triton.jit
def _rows(field_ptr, slot, valid, WIDTH: tl.constexpr, WIDTH_BLOCK: tl.constexpr):
    """The rows ``[BLOCK, WIDTH_BLOCK]`` of a contiguous ``[C, WIDTH]`` field at ``slot [BLOCK]``, their columns and
    mask."""
    columns = tl.arange(0, WIDTH_BLOCK)
    mask = valid[:, None] & (columns < WIDTH)[None, :]
    rows = tl.load(field_ptr + slot[:, None] * WIDTH + columns[None, :], mask=mask, other=0)
    return rows, columns, mask


@triton.jit
def _future_goal(goal, index, valid, uniform_ptr, lanes, uniform_row_stride, uniform_column_stride, achieved_ptr,
                 episode_step_ptr, written_ptr, steps, num_envs, capacity, episode_length, relabel_bits):
    """HER 'future' (:func:`fitdqn.ops.replay_gather.future_goals`): the goal ``[BLOCK]`` after the coin."""
    u_step = tl.load(uniform_ptr + lanes * uniform_row_stride, mask=valid, other=0.0)  # [BLOCK] f64
    u_coin = tl.load(uniform_ptr + lanes * uniform_row_stride + uniform_column_stride, mask=valid, other=1.0)
    newest = _floor_mod(tl.load(written_ptr) - 1, steps)  # ring row of the newest step
    ahead = _floor_mod(newest - index // num_envs, steps)  # [BLOCK] steps written after s
    step_in_episode = tl.load(episode_step_ptr + index, mask=valid, other=0).to(tl.int64)  # [BLOCK] p
    span = tl.maximum(tl.minimum(episode_length - 1 - step_in_episode, ahead), 0)
    offset = tl.minimum((u_step * (span + 1).to(tl.float64)).to(tl.int64), span)  # [BLOCK] j - s
    future = (index + offset * num_envs) % capacity  # [BLOCK] slot of j (non-negative: no floor needed)
    same_episode = tl.load(episode_step_ptr + future, mask=valid, other=0).to(tl.int64) == step_in_episode + offset
    future_goal = tl.where(same_episode, tl.load(achieved_ptr + future, mask=valid, other=0.0),
                           tl.load(achieved_ptr + index, mask=valid, other=0.0))
    return tl.where(u_coin < _as_f64(relabel_bits), future_goal.to(goal.dtype), goal)


@triton.jit
def _gather_kernel(
    agent_ptr, next_agent_ptr, bar_ptr, action_ptr, reward_ptr, achieved_ptr, episode_step_ptr, flags_ptr,
    index_ptr, uniform_ptr, written_ptr, gamma_ptr,
    bar_out, agent_out, action_out, reward_out, discount_out, next_bar_out, next_agent_out,
    batch, capacity, steps, num_envs, episode_length, goal_column, relabel_bits, bonus, index_stride,
    uniform_row_stride, uniform_column_stride,
    FA: tl.constexpr, FA_BLOCK: tl.constexpr, NEXT_FA: tl.constexpr, NEXT_FA_BLOCK: tl.constexpr,
    ACTIONS: tl.constexpr, ACTIONS_BLOCK: tl.constexpr, N_STEP: tl.constexpr, HER: tl.constexpr,
    BONUS: tl.constexpr, TERMINAL_BIT: tl.constexpr, ENDED_BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    lanes = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] samples
    valid = lanes < batch
    index = tl.load(index_ptr + lanes * index_stride, mask=valid, other=0)  # [BLOCK] int64 slots
    goal = tl.load(agent_ptr + index * FA + goal_column, mask=valid, other=0.0)  # [BLOCK] the stored goal
    if HER:
        goal = _future_goal(goal, index, valid, uniform_ptr, lanes, uniform_row_stride, uniform_column_stride,
                            achieved_ptr, episode_step_ptr, written_ptr, steps, num_envs, capacity, episode_length,
                            relabel_bits)

    # the n-step window: step k is in it while no step before it ended the episode or was terminal
    ret = tl.zeros((BLOCK,), tl.float32)
    length = tl.zeros((BLOCK,), tl.int32)
    last = index
    alive = valid
    for k in tl.static_range(N_STEP):
        slot = (index + k * num_envs) % capacity  # [BLOCK]
        flag = tl.load(flags_ptr + slot, mask=valid, other=0).to(tl.int32)
        reward = tl.load(reward_ptr + slot, mask=valid, other=0.0)
        if BONUS:
            after = tl.load(achieved_ptr + slot, mask=valid, other=0.0)
            crossed = (after - reward < goal) & (after >= goal)
            reward = reward + tl.where(crossed, bonus, 0.0)
        ret += tl.where(alive, reward * tl.load(gamma_ptr + k), 0.0)
        length += alive.to(tl.int32)
        last = tl.where(alive, slot, last)
        alive = alive & ((flag & ENDED_BITS) == 0)
    terminal = (tl.load(flags_ptr + last, mask=valid, other=0).to(tl.int32) & TERMINAL_BIT) != 0
    discount = tl.load(gamma_ptr + length, mask=valid, other=0.0) * (1.0 - terminal.to(tl.float32))
    tl.store(reward_out + lanes, ret, mask=valid)
    tl.store(discount_out + lanes, discount, mask=valid)

    tl.store(bar_out + lanes, tl.load(bar_ptr + index, mask=valid, other=0).to(tl.int64), mask=valid)
    next_bar = tl.load(bar_ptr + last, mask=valid, other=0).to(tl.int64) + 1
    tl.store(next_bar_out + lanes, next_bar, mask=valid)
    actions, columns, mask = _rows(action_ptr, index, valid, ACTIONS, ACTIONS_BLOCK)
    tl.store(action_out + lanes[:, None] * ACTIONS + columns[None, :], actions.to(tl.int64), mask=mask)
    rows, columns, mask = _rows(agent_ptr, index, valid, FA, FA_BLOCK)
    rows = tl.where(columns[None, :] == goal_column, goal[:, None].to(rows.dtype), rows)
    tl.store(agent_out + lanes[:, None] * FA + columns[None, :], rows, mask=mask)
    rows, columns, mask = _rows(next_agent_ptr, last, valid, NEXT_FA, NEXT_FA_BLOCK)
    rows = tl.where(columns[None, :] == goal_column, goal[:, None].to(rows.dtype), rows)
    tl.store(next_agent_out + lanes[:, None] * NEXT_FA + columns[None, :], rows, mask=mask)


def fused_gather(agent: torch.Tensor, next_agent: torch.Tensor, bar: torch.Tensor, action: torch.Tensor,
                 reward: torch.Tensor, achieved: torch.Tensor, episode_step: torch.Tensor, flags: torch.Tensor,
                 index: torch.Tensor, uniform: torch.Tensor, written: torch.Tensor, gamma_powers: torch.Tensor,
                 n_step: int, num_envs: int, episode_length: int, relabel_probability: float | None,
                 goal_column: int, goal_bonus: float | None) -> tuple[torch.Tensor, ...]:
    """The operator's seven results (:func:`fitdqn.ops.replay_gather.replay_gather`); ``index`` and ``uniform`` of
    any strides, the ring's fields contiguous (as :class:`~fitdqn.replay.storage.RingStorage` makes them; any other
    is copied)."""
    check_inputs(agent, next_agent, bar, action, reward, achieved, episode_step, flags, index, uniform, written,
                 gamma_powers, n_step, num_envs, goal_column)
    batch = index.shape[0]
    results = empty_results(agent, next_agent, action, batch)
    if batch == 0:
        return results
    capacity = agent.shape[0]
    fields = [t.contiguous() for t in (agent, next_agent, bar, action, reward, achieved, episode_step, flags)]
    with on_device(index):
        _gather_kernel[(triton.cdiv(batch, BLOCK),)](
            *fields, index, uniform, written, gamma_powers.contiguous(), *results,
            batch, capacity, capacity // num_envs, num_envs, episode_length, goal_column,
            bits(0.0 if relabel_probability is None else relabel_probability),
            0.0 if goal_bonus is None else goal_bonus,
            index.stride(0), uniform.stride(0), uniform.stride(1),
            FA=agent.shape[1], FA_BLOCK=next_power_of_2(agent.shape[1]), NEXT_FA=next_agent.shape[1],
            NEXT_FA_BLOCK=next_power_of_2(next_agent.shape[1]), ACTIONS=action.shape[1],
            ACTIONS_BLOCK=next_power_of_2(action.shape[1]), N_STEP=n_step, HER=relabel_probability is not None,
            BONUS=goal_bonus is not None, TERMINAL_BIT=TERMINAL, ENDED_BITS=TERMINAL | EPISODE_END, BLOCK=BLOCK,
            num_warps=WARPS, enable_fp_fusion=False)
    return results
