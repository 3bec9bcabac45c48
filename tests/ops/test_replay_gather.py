"""``fitdqn::replay_gather``, the replay's batch gather as one operator: its Triton kernel (under Triton's interpreter,
and compiled on a GPU, in a CUDA graph too) gives the torch maths' batches; its CPU kernel, through the replay, is
the gather as it was before the operator, bit for bit; its fake kernel allocates what the real kernels return."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from replay_gather_interpreter import (
    CASES,
    GAMMA,
    INTEGERS,
    LENGTH,
    ROWS,
    filled,
    operator_inputs,
    sampleable,
    torch_maths_batch,
)
from support.replay_reference import buffer_options, gather_at_4a736f8
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpreter import run_under_interpreter

from fitdqn.device.graphs import capture_graph
from fitdqn.ops.replay_gather import GoalCrossing, powers_of_gamma, replay_gather

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
RETURN_TOLERANCE = 1e-6  # relative: fp32 sums of up to n terms in another order


# -------------------------------------------------------------------- Triton kernel under the interpreter

@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("replay_gather_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernel_under_the_interpreter_matches_the_torch_maths(interpreted, case):
    _, n_step, her, bonus, *_ = case
    result = interpreted[case[0]]
    assert result["keys"] and all(result["dtypes"].values()), result
    assert all(result["equal"][key] for key in (*INTEGERS, *ROWS, "discount", "index")), result
    assert result["reward_error"] <= RETURN_TOLERANCE and result["discount_error"] == 0.0, result
    # what the case exercises
    assert (result["relabelled"] > 0) == her and (result["bonus_paid"] > 0) == bonus, result
    if n_step > 1:
        assert result["cut_by_terminal"] > 0 and result["cut_by_episode_end"] > 0, result
    assert result["wrapped"] == ("not-wrapped" not in case[0]), result


# ----------------------------------------------------------------------------------------------- on the CPU

@pytest.mark.parametrize("bonus", [True, False], ids=["bonus", "no-bonus"])
@pytest.mark.parametrize("her", [True, False], ids=["her", "no-her"])
@pytest.mark.parametrize("n_step", [1, 3, 5])
def test_the_gather_is_the_one_before_the_operator_bit_for_bit(n_step, her, bonus):
    """Through a ReplayBuffer on the CPU (the operator's CPU kernel: the torch maths): the batches of commit
    4a736f8."""
    steps, written = 20, 53  # the ring has wrapped
    buffer = filled(n_step, her, bonus, 0.2, True, steps, written)
    index = sampleable(buffer, written, repeats=3)
    uniform = torch.rand(index.numel(), 3, generator=torch.Generator().manual_seed(n_step),
                         dtype=torch.float64)[:, 1:]
    batch = buffer.gather_with_uniforms(index, uniform)
    before = gather_at_4a736f8(buffer.storage, index, uniform, n_step=n_step, gamma=GAMMA, episode_length=LENGTH,
                               her_k=buffer_options()["her_k"] if her else None, goal_column=buffer.goal_column,
                               goal_reward=buffer.goal_reward)
    assert list(batch) == list(before)
    for key in before:
        assert batch[key].dtype == before[key].dtype and torch.equal(batch[key], before[key]), key


@pytest.mark.parametrize("batch_size", [0, 37])
def test_the_fake_kernel_allocates_what_the_real_kernel_returns(batch_size):
    """Shapes, dtypes and devices of the seven results, real (the CPU kernel) and fake (what the planner's trace of a
    CUDA target sees: the Triton path allocates these and nothing else)."""
    buffer = filled(3, True, True, 0.1, True, 12, 30)
    index = sampleable(buffer, 30, repeats=1)[:batch_size]
    uniform = torch.rand(batch_size, 3, dtype=torch.float64)[:, 1:]
    real = replay_gather(*operator_inputs(buffer, index, uniform))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                       for t in operator_inputs(buffer, index, uniform)]
        fake = replay_gather(*fake_inputs)
    assert len(fake) == len(real) == 7
    for a, b in zip(fake, real, strict=True):
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
    assert [t.dtype for t in real] == [torch.int64, torch.float32, torch.int64, torch.float32, torch.float32,
                                       torch.int64, torch.float32]


def test_bad_inputs_are_refused():
    buffer = filled(3, False, False, 0.1, True, 12, 30)
    index = sampleable(buffer, 30, repeats=1)
    inputs = list(operator_inputs(buffer, index, torch.rand(index.numel(), 2, dtype=torch.float64)))
    for position, bad in ((8, index.int()), (9, torch.rand(index.numel(), 3, dtype=torch.float64)),
                          (11, powers_of_gamma(4, 0.9, "cpu")), (16, 99)):
        wrong = [*inputs]
        wrong[position] = bad
        with pytest.raises(ValueError, match="replay_gather takes"):
            replay_gather(*wrong)


def test_goal_crossing_pays_the_bonus_only_upwards():
    before = torch.tensor([0.0, 0.5, 1.5, 1.0, 2.0])
    after = torch.tensor([1.0, 1.0, 0.5, 2.0, 1.0])
    assert GoalCrossing(0.25)(before, after, torch.ones(5)).tolist() == [0.25, 0.25, 0.0, 0.0, 0.0]


# --------------------------------------------------------------------------------------------------- on CUDA

def assert_same_batch(fused: dict, plain: dict) -> None:
    """Integers, rows and discounts exact; returns within fp32 rounding (another summation order)."""
    assert list(fused) == list(plain)
    for key in plain:
        assert fused[key].dtype == plain[key].dtype, key
        if key == "reward":
            torch.testing.assert_close(fused[key], plain[key], rtol=RETURN_TOLERANCE, atol=1e-7)
        else:
            assert torch.equal(fused[key], plain[key]), key


@cuda
@pytest.mark.parametrize(("n_step", "her", "bonus"), list(itertools.product([1, 3, 5], [True, False], [True, False])))
def test_the_cuda_operator_matches_the_torch_maths(n_step, her, bonus):
    """The replay's gather on CUDA (the Triton kernel where Triton is installed, else the torch maths) against the
    torch maths on the same ring."""
    buffer = filled(n_step, her, bonus, 0.2, False, 20, 53, device="cuda")
    index = sampleable(buffer, 53, repeats=5)
    uniform = torch.rand(index.numel(), 3, device="cuda", dtype=torch.float64)[:, 1:]
    assert_same_batch(buffer.gather_with_uniforms(index, uniform), torch_maths_batch(buffer, index, uniform))


@cuda
def test_the_cuda_operator_captures_in_a_cuda_graph():
    buffer = filled(3, True, True, 0.2, True, 20, 53, device="cuda")
    slots = sampleable(buffer, 53, repeats=1)
    generator = torch.Generator("cuda").manual_seed(0)
    index = slots[torch.randint(slots.numel(), (1000,), device="cuda", generator=generator)]  # static inputs
    uniform = torch.rand(1000, 3, device="cuda", dtype=torch.float64)[:, 1:]
    graph, batch = capture_graph(lambda: buffer.gather_with_uniforms(index, uniform), torch.device("cuda"),
                                 warmup=1)
    for _ in range(2):  # new inputs in place, then a replay
        index.copy_(slots[torch.randint(slots.numel(), (1000,), device="cuda", generator=generator)])
        uniform.copy_(torch.rand(1000, 2, device="cuda", dtype=torch.float64))
        graph.replay()
        assert_same_batch({key: value.clone() for key, value in batch.items()},
                          torch_maths_batch(buffer, index, uniform))
