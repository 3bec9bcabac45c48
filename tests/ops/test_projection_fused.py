"""The C51 projection operator ``fitdqn::categorical_projection``: its Triton kernel (under Triton's interpreter,
and compiled on a GPU), its CPU kernel and its fake kernel agree with the dense projection and the per-atom loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from projection_interpreter import CASES, inputs, reference
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpreter import run_under_interpreter

from fitdqn.learn.losses import categorical_projection
from fitdqn.ops.projection import project_positions

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -------------------------------------------------------------------- Triton kernel under the interpreter

@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("projection_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernel_under_the_interpreter_matches_the_reference(interpreted, case):
    name, batch, branches, atoms, *_ = case
    result = interpreted[name]
    assert result["shape"] == ([batch, branches, atoms] if branches else [batch, atoms])
    assert result["dtype"] == "torch.float32"
    assert result["loop"] < 1e-5 and result["dense"] < 1e-6 and result["mass"] < 1e-6, result


# ----------------------------------------------------------------------------------------------- on the CPU

@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_fused_projection_on_cpu_is_the_dense_one_and_the_loop(case):
    probs, rewards, discounts, support = inputs(*case[1:])
    fused = categorical_projection(probs, rewards, discounts, support, fused=True)
    dense = categorical_projection(probs, rewards, discounts, support)
    assert fused.shape == probs.shape and fused.dtype == torch.float32
    torch.testing.assert_close(fused, dense, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused.double(), reference(probs, rewards, discounts, support), atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-6, rtol=0)  # mass conserved


def test_shared_and_per_branch_hats_agree():
    """Rewards ``[B]`` take the shared-hat path (one ``[A, A]`` per sample); the same rewards spelled ``[B, br]``
    take the per-branch one."""
    probs, rewards, discounts, support = inputs(*CASES[0][1:])
    shared = categorical_projection(probs, rewards, discounts, support)
    per_branch = categorical_projection(probs, rewards.unsqueeze(-1).expand(probs.shape[:-1]), discounts, support)
    torch.testing.assert_close(shared, per_branch, atol=1e-7, rtol=0)


def test_projection_under_autocast_and_with_gradients_around():
    probs, rewards, discounts, support = inputs(*CASES[0][1:])
    expected = categorical_projection(probs, rewards, discounts, support)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = categorical_projection(probs.requires_grad_(), rewards, discounts, support, fused=True)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_fake_kernel_allocates_only_the_result():
    with FakeTensorMode():
        probs, positions = torch.empty(24, 51), torch.empty(24, 51)
        out = project_positions(probs, positions)
        assert out.shape == (24, 51) and out.dtype == torch.float32
        projected = categorical_projection(torch.empty(8, 3, 51), torch.empty(8), torch.empty(8),
                                           torch.empty(51), fused=True)
        assert projected.shape == (8, 3, 51) and projected.dtype == torch.float32


# ----------------------------------------------------------------------------------------------- on a GPU

def update_sized(device):
    """Batch 8192, 3 branches, 51 atoms, as in the update; per-sample or per-branch rewards."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8192, 3, 51, generator=generator) * 2, dim=-1)
    rewards = torch.randn(8192, generator=generator) * 5
    rewards[:64] *= 10  # far beyond the support
    discounts = torch.full((8192,), 0.99**3)
    discounts[64:128] = 0.0  # terminal
    support = torch.linspace(-10.0, 10.0, 51)
    return [value.to(device) for value in (probs, rewards, discounts, support)]


@cuda
@pytest.mark.parametrize("branch_rewards", [False, True])
def test_triton_kernel_on_cuda_matches_the_torch_path(branch_rewards):
    probs, rewards, discounts, support = update_sized("cuda")
    if branch_rewards:
        rewards = rewards.unsqueeze(-1) + torch.linspace(-1.0, 1.0, 3, device="cuda")  # [B, br]
    fused = categorical_projection(probs, rewards, discounts, support, fused=True).cpu()
    dense = categorical_projection(*[value.cpu() for value in (probs, rewards, discounts, support)])  # no TF32
    # the landing positions are computed on each device: near atom 50 one fp32 ulp is 3.8e-6 of an atom, and
    # moves that much mass between two neighbours (measured on an H200: up to 4.0e-6)
    torch.testing.assert_close(fused, dense, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.sum(-1), torch.ones(fused.shape[:-1]), atol=1e-5, rtol=0)


@cuda
def test_triton_kernel_runs_in_a_cuda_graph():
    probs, rewards, discounts, support = update_sized("cuda")
    expected = categorical_projection(probs, rewards, discounts, support, fused=True)  # also compiles the kernel
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture_graph does
        categorical_projection(probs, rewards, discounts, support, fused=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = categorical_projection(probs, rewards, discounts, support, fused=True)
    rewards.mul_(0.5)  # new inputs in the same memory: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, categorical_projection(probs, rewards, discounts, support, fused=True))
    assert not torch.equal(captured, expected)
