"""The replay gather's Triton kernel on the CPU, under Triton's interpreter: run as a script by
``test_replay_gather.py`` (``python replay_gather_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON line.

In this process the Triton launcher is registered as the *CPU* kernel of ``fitdqn::replay_gather``, so a
:class:`~fitdqn.replay.ReplayBuffer` gathers through the operator and the kernel end to end on CPU tensors; the torch
maths on the same ring (:func:`torch_maths_batch`) is the oracle. Each case fills a ring from
:class:`support.replay_reference.FakeEnv` (episodes of ``LENGTH`` steps, some cut short by terminal steps) and gathers
every sampleable slot several times, with strided uniforms.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton_interpreter import interpreted_main  # next to this script
from triton_interpreter import relative_error as error

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package

NUM_ENVS = 8
LENGTH = 7  # episode steps
GAMMA = 0.9
BONUS = 0.5
# (name, n_step, HER, goal bonus, terminal probability, terminal also ends the episode (flags bit 1), ring steps,
#  steps written): the ring has wrapped where written > ring steps
CASES = [
    ("n1-her-bonus-wrapped", 1, True, True, 0.1, True, 12, 41),
    ("n3-her-bonus-wrapped", 3, True, True, 0.15, True, 20, 53),
    ("n3-her-terminal-only-wrapped", 3, True, False, 0.2, False, 20, 47),
    ("n3-bonus-no-her", 3, False, True, 0.2, True, 20, 33),
    ("n5-her-bonus-terminal-only-wrapped", 5, True, True, 0.2, False, 16, 61),
    ("n5-no-her-no-bonus-not-wrapped", 5, False, False, 0.1, True, 24, 19),
]
INTEGERS = ("bar", "action", "next_bar")
ROWS = ("agent", "next_agent")


def filled(n_step: int, her: bool, bonus: bool, terminal: float, terminal_sets_end: bool, steps: int, written: int,
           device: str = "cpu", seed: int = 0):
    """A buffer of ``steps`` ring steps after ``written`` FakeEnv steps."""
    from support.replay_reference import FakeEnv, buffer_options, transition_spec

    from fitdqn.ops.replay_gather import GoalCrossing
    from fitdqn.replay import ReplayBuffer

    env = FakeEnv(NUM_ENVS, LENGTH, terminal, terminal_sets_end=terminal_sets_end, seed=seed)
    buffer = ReplayBuffer(transition_spec(), steps * NUM_ENVS, NUM_ENVS, **buffer_options(
        n_step=n_step, gamma=GAMMA, episode_length=LENGTH, her=her, device=device),
        goal_reward=GoalCrossing(BONUS) if bonus else None)
    for _ in range(written):
        buffer.write({name: row.to(device) for name, row in env.step().items()})
    return buffer


def operator_inputs(buffer, index: torch.Tensor, uniform: torch.Tensor) -> tuple:
    """The arguments of ``fitdqn::replay_gather`` for slots ``index [B]`` of ``buffer``'s ring."""
    f = buffer.storage.fields
    bonus = None if buffer.goal_reward is None else buffer.goal_reward.bonus
    return (f["agent"], f["next_agent"], f["bar"], f["action"], f["reward"], f["achieved"], f["episode_step"],
            f["flags"], index, uniform, buffer.storage.written, buffer.gamma_powers, buffer.n_step, buffer.num_envs,
            buffer.episode_length, buffer.relabel_probability, buffer.goal_column, bonus)


def torch_maths_batch(buffer, index: torch.Tensor, uniform: torch.Tensor) -> dict:
    """The batch :meth:`~fitdqn.replay.ReplayBuffer.gather_with_uniforms` returns, by the operator's torch maths
    (its CPU kernel) called directly, on any device."""
    from fitdqn.ops.replay_gather import gather_maths
    from fitdqn.replay.buffer import REPLAY_BATCH_KEYS

    batch = gather_maths(*operator_inputs(buffer, index, uniform))
    return {**dict(zip(REPLAY_BATCH_KEYS, batch, strict=True)), "index": index}


def sampleable(buffer, written: int, repeats: int) -> torch.Tensor:
    """``[repeats * N]`` int64: every sampleable slot (steps max(0, T - S) .. T - n), ``repeats`` times."""
    steps, num_envs = buffer.storage.steps, buffer.num_envs
    slots = [(s % steps) * num_envs + e for s in range(max(0, written - steps), written - buffer.n_step + 1)
             for e in range(num_envs)]
    return torch.tensor(slots * repeats, dtype=torch.int64, device=buffer.device)


def compared(fused: dict, plain: dict) -> dict:
    """Which keys are equal, bit for bit, and the returns' and discounts' relative errors."""
    return {"keys": sorted(fused) == sorted(plain),
            "dtypes": {key: str(fused[key].dtype) == str(plain[key].dtype) for key in plain},
            "equal": {key: bool(torch.equal(fused[key], plain[key])) for key in plain},
            "reward_error": error(fused["reward"], plain["reward"]),
            "discount_error": error(fused["discount"], plain["discount"])}


def coverage(buffer, batch: dict, index: torch.Tensor) -> dict:
    """How many samples of the torch maths' batch were relabelled, were paid a goal bonus, and were cut short by a
    terminal step or an episode's end: what a case exercises."""
    from fitdqn.ops.replay_gather import nstep_window, window_offsets

    fields, column = buffer.storage.fields, buffer.goal_column
    goal = batch["agent"][:, column]  # [B] the goal used

    def window(goal_reward):
        offsets = window_offsets(buffer.n_step, buffer.num_envs, index.device)
        return nstep_window(index, goal, reward=fields["reward"], achieved=fields["achieved"], flags=fields["flags"],
                            offsets=offsets, gamma_powers=buffer.gamma_powers, goal_reward=goal_reward)

    last = window(None).last  # [B] the window's last slot
    cut = last != torch.remainder(index + (buffer.n_step - 1) * buffer.num_envs, buffer.capacity)  # [B] m < n
    terminal = batch["discount"] == 0
    return {"relabelled": int((goal != fields["agent"][index, column]).sum()),
            "bonus_paid": int((window(buffer.goal_reward).reward != window(None).reward).sum()),
            "cut_by_terminal": int((cut & terminal).sum()), "cut_by_episode_end": int((cut & ~terminal).sum()),
            "samples": int(index.numel())}


def run_case(name, n_step, her, bonus, terminal, terminal_sets_end, steps, written):
    buffer = filled(n_step, her, bonus, terminal, terminal_sets_end, steps, written)
    generator = torch.Generator().manual_seed(n_step + steps)
    index = sampleable(buffer, written, repeats=4)
    uniform = torch.rand(index.numel(), 3, generator=generator, dtype=torch.float64)[:, 1:]  # strided, as sampled
    fused = buffer.gather_with_uniforms(index, uniform)  # the operator: the Triton kernel registered for the CPU
    plain = torch_maths_batch(buffer, index, uniform)  # the same ring through the torch maths
    return {**compared(fused, plain), **coverage(buffer, plain, index), "wrapped": written > steps}


def use_triton_on_cpu() -> None:
    from fitdqn.ops import replay_gather, replay_gather_triton

    replay_gather.replay_gather.register_kernel("cpu", replay_gather_triton.fused_gather)


def run_cases() -> dict:
    return {case[0]: run_case(*case) for case in CASES}


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.replay_gather_triton", run_cases, use_triton_on_cpu, bf16=False)
