"""Prioritized replay's operators ``fitdqn::prioritized_draw`` / ``prioritized_update``: the Triton kernels (under
Triton's interpreter, and compiled on a GPU) pick the CPU reference's leaves and write its tree; the CPU kernel is
the torch maths; the fake kernels allocate what the Triton path allocates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prioritized_interpreter import CASES
from support.replay_reference import FakeEnv, buffer_options, goal_reward, transition_spec
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpreter import run_under_interpreter

from fitdqn.device.graphs import capture_graph
from fitdqn.ops import prioritized
from fitdqn.replay import ReplayBuffer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -------------------------------------------------------------------- Triton kernels under the interpreter

@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("prioritized_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernels_under_the_interpreter_match_the_reference(interpreted, case):
    result = interpreted[case[0]]
    assert result["same_index"] and not result["zero_leaf_drawn"] and result["lowest_is_min"], result
    assert result["weight_dtype"] == "torch.float32" and result["weight_error"] < 1e-6, result
    assert result["leaf_error"] < 1e-14 and result["node_error"] < 1e-13 and result["max_error"] < 1e-14, result


# ----------------------------------------------------------------------------------------------- on the CPU

def filled(device: str = "cpu", seed: int = 3) -> ReplayBuffer:
    env = FakeEnv(64, 12, 0.05, seed=seed)
    buffer = ReplayBuffer(transition_spec(), 64 * 30, 64, **buffer_options(
        n_step=3, gamma=0.95, episode_length=12, device=device), goal_reward=goal_reward)
    for _ in range(45):
        buffer.write({k: v.to(device) for k, v in env.step().items()})
    return buffer


def test_the_replay_on_the_cpu_draws_and_updates_by_the_torch_maths():
    """The operators' CPU kernels are the torch maths: the replay's draws and its tree after updates are those of
    :func:`prioritized.draw_reference` and :func:`prioritized.update_reference` on a copy of its tree."""
    buffer = filled()
    sampler = buffer.sampler
    levels, max_priority = [level.clone() for level in sampler.tree.levels], sampler.max_priority.clone()
    s = buffer.storage
    beta = torch.tensor(0.6, dtype=torch.float64)
    for round_ in range(3):
        uniform = torch.rand(512, dtype=torch.float64, generator=torch.Generator().manual_seed(round_))
        index, weight = sampler.draw(uniform, beta)
        expected = prioritized.draw_reference(levels, uniform, s.written, beta, sampler.tree.fanout,
                                              sampler.tree.num_leaves, s.steps, buffer.n_step, s.num_envs)
        assert torch.equal(index, expected[0]) and torch.equal(weight, expected[1])
        priorities = torch.rand(512, generator=torch.Generator().manual_seed(10 + round_)) * (round_ + 1)
        sampler.update(index, priorities)
        prioritized.update_reference(levels, max_priority, index, priorities, sampler.alpha, sampler.eps,
                                     sampler.tree.fanout)
    for x, y in zip(sampler.tree.levels, levels, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(sampler.max_priority, max_priority)


def test_fake_kernels_allocate_the_results_only():
    """Under fake tensors the draw makes its two results ([B] int64, [B] f32), the update nothing: what the Triton
    path allocates (the planner's trace of a CUDA target sees these, not the torch maths' [B, fanout] rows)."""
    with FakeTensorMode():
        levels = [torch.zeros(64, dtype=torch.float64), torch.zeros(64 * 64, dtype=torch.float64)]
        uniform = torch.zeros(1000, 3, dtype=torch.float64)[:, 0]
        index, weight = prioritized.prioritized_draw(
            levels, uniform, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.float64),
            torch.zeros((), dtype=torch.int64), 64, 4000, 100, 3, 40)
        assert (index.shape, index.dtype, weight.shape, weight.dtype) == ((1000,), torch.int64, (1000,),
                                                                          torch.float32)
        assert prioritized.prioritized_update(levels, torch.zeros((), dtype=torch.float64), index,
                                              torch.zeros(1000), 0.6, 1e-3, 64) is None


# --------------------------------------------------------------------------------------------------- on CUDA

@cuda
def test_draw_and_update_on_cuda_match_the_cpu():
    """The same rows in a CUDA replay (the Triton kernels where Triton is installed) and a CPU one (the torch
    maths): the same leaves drawn, the same weights and tree within float rounding."""
    fused, plain = filled(device="cuda"), filled()
    beta = torch.tensor(0.6, dtype=torch.float64)
    for round_ in range(3):
        uniform = torch.rand(2048, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(round_))
        a, b = fused.batch_from_uniforms(uniform.cuda(), beta.cuda()), plain.batch_from_uniforms(uniform, beta)
        assert torch.equal(a["index"].cpu(), b["index"])
        torch.testing.assert_close(a["weight"].cpu(), b["weight"], rtol=1e-6, atol=0)
        priorities = b["reward"].abs() * (round_ + 1)
        fused.update_priorities(a["index"], priorities.cuda())
        plain.update_priorities(b["index"], priorities)
    for x, y in zip(fused.sampler.tree.levels, plain.sampler.tree.levels, strict=True):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-13, atol=0)
    torch.testing.assert_close(fused.sampler.max_priority.cpu(), plain.sampler.max_priority, rtol=1e-14, atol=0)


@cuda
def test_sampling_captures_in_a_cuda_graph():
    buffer = filled(device="cuda")
    beta = torch.tensor(0.5, device="cuda", dtype=torch.float64)

    def step():
        batch = buffer.sample(256, beta)
        buffer.update_priorities(batch["index"], batch["reward"].abs())
        return batch

    graph, batch = capture_graph(step, torch.device("cuda"), warmup=1)  # as the trainer captures its step
    graph.replay()
    index, weight = batch["index"].clone(), batch["weight"].clone()
    assert weight.max().item() == 1.0 and (weight > 0).all()
    leaves = buffer.sampler.tree.leaves
    assert (leaves[index] > 0).all()
    assert float(buffer.sampler.tree.total()) == pytest.approx(float(leaves.sum()), rel=1e-12)
