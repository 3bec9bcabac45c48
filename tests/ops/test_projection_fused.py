"""The C51 projection operator ``fitdqn::categorical_projection`` (landing positions and projection in one): its
Triton kernel (under Triton's interpreter, and compiled on a GPU), its CPU kernel and its fake kernel agree with the
torch path (``atom_positions`` and the dense projection) and the per-atom loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from projection_interpreter import CASES, HAT_CASES, hat_inputs, inputs, reference
from support.projection_reference import project_plain
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interpreter import run_under_interpreter

from fitdqn.learn.losses import categorical_projection
from fitdqn.ops.projection import atom_positions, project_dense, project_returns

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


@pytest.mark.parametrize("case", HAT_CASES, ids=[case[0] for case in HAT_CASES])
def test_triton_kernel_lands_each_atom_where_the_torch_maths_does(interpreted, case):
    """One-hot distributions: each output row is one atom's hat. Bit for bit the torch maths with the interpreter's
    rounding of the multiply-add (twice); within one fp32 ulp of a position (3.8e-6 near atom 50) of the torch
    path's fused ``addcmul``."""
    result = interpreted[case[0]]
    assert result["unfused"] == 0.0 and result["torch"] <= 4e-6, result


def test_triton_kernel_reads_strided_and_bf16_rewards_discounts_and_probs(interpreted):
    assert all(error < 1e-6 for error in interpreted["strided"].values()), interpreted["strided"]


# ----------------------------------------------------------------------------------------------- on the CPU

@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_fused_projection_on_cpu_is_the_dense_one_and_the_loop(case):
    probs, rewards, discounts, support = inputs(*case[1:])
    fused = categorical_projection(probs, rewards, discounts, support)
    dense = project_plain(probs, rewards, discounts, support)
    assert fused.shape == probs.shape and fused.dtype == torch.float32
    torch.testing.assert_close(fused, dense, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused.double(), reference(probs, rewards, discounts, support), atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-6, rtol=0)  # mass conserved


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_operator_on_cpu_is_the_dense_projection_at_atom_positions(case):
    """The operator called directly, rewards and discounts as given (``[B]`` or ``[B, br]``), is the dense hat at
    the positions of ``atom_positions`` bit for bit: the CPU kernel is those torch ops."""
    probs, rewards, discounts, support = inputs(*case[1:])
    atoms = probs.shape[-1]
    flat = probs.reshape(-1, atoms)
    got = project_returns(flat, rewards, discounts, support)
    expected = project_dense(probs, atom_positions(probs.dim(), rewards, discounts, support)).reshape(flat.shape)
    assert got.shape == flat.shape and got.dtype == torch.float32
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", HAT_CASES, ids=[case[0] for case in HAT_CASES])
def test_operator_on_cpu_lands_each_atom_as_the_loop(case):
    probs, rewards, discounts, support = hat_inputs(*case[1:])
    fused = categorical_projection(probs, rewards, discounts, support)
    torch.testing.assert_close(fused.double(), reference(probs, rewards, discounts, support), atol=1e-5, rtol=0)


def test_operator_takes_strided_rewards_and_discounts():
    """``[B, 1]`` expanded to ``[B, br]`` (stride 0) and a column of a wider tensor: read in place, as if
    contiguous."""
    probs, rewards, discounts, support = inputs(6, 3, 51, 10.0, True, False)
    wide = torch.stack([discounts, 1.0 - discounts], dim=1)  # [B, 2]
    flat = probs.reshape(18, 51)
    got = project_returns(flat, rewards[:, :1].expand(6, 3), wide[:, :1].expand(6, 3), support)
    expected = project_returns(flat, rewards[:, :1].repeat(1, 3), discounts.unsqueeze(1).repeat(1, 3), support)
    torch.testing.assert_close(got, expected, atol=1e-7, rtol=0)
    torch.testing.assert_close(project_returns(flat, rewards, wide[:, 0], support),
                               project_returns(flat, rewards, discounts, support), atol=0, rtol=0)


@pytest.mark.parametrize("shapes", [
    ((24, 51), (8,), (9,), (51,)),  # discounts of another batch
    ((24, 51), (8, 3), (8, 2), (51,)),  # branches disagree
    ((25, 51), (8,), (8,), (51,)),  # rows not B * br
    ((24, 51), (8, 3), (8,), (50,)),  # support of another size
    ((8, 3, 51), (8,), (8,), (51,)),  # probs not [R, A]
])
def test_operator_refuses_shapes_that_do_not_fit(shapes):
    probs, rewards, discounts, support = (torch.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match="categorical_projection takes"):
        project_returns(probs, rewards, discounts, support)
    with FakeTensorMode(), pytest.raises(ValueError, match="categorical_projection takes"):
        project_returns(*(torch.empty(shape) for shape in shapes))


def test_shared_and_per_branch_hats_agree():
    """Rewards ``[B]`` take the shared-hat path (one ``[A, A]`` per sample); the same rewards spelled ``[B, br]``
    take the per-branch one."""
    probs, rewards, discounts, support = inputs(*CASES[0][1:])
    shared = categorical_projection(probs, rewards, discounts, support)
    per_branch = categorical_projection(probs, rewards.unsqueeze(-1).expand(probs.shape[:-1]), discounts, support)
    torch.testing.assert_close(shared, per_branch, atol=1e-7, rtol=0)


def test_projection_under_autocast_and_with_gradients_around():
    probs, rewards, discounts, support = inputs(*CASES[0][1:])
    expected = project_plain(probs, rewards, discounts, support)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = categorical_projection(probs.requires_grad_(), rewards, discounts, support)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_fake_kernel_allocates_only_the_result():
    with FakeTensorMode():
        for rewards, discounts in [((8,), (8,)), ((8, 3), (8,)), ((8, 3), (8, 3))]:
            out = project_returns(torch.empty(24, 51), torch.empty(rewards), torch.empty(discounts), torch.empty(51))
            assert out.shape == (24, 51) and out.dtype == torch.float32
        out = project_returns(torch.empty(24, 51, dtype=torch.bfloat16), torch.empty(8), torch.empty(8),
                              torch.empty(51))
        assert out.shape == (24, 51) and out.dtype == torch.float32
        projected = categorical_projection(torch.empty(8, 3, 51), torch.empty(8), torch.empty(8),
                                           torch.empty(51))
        assert projected.shape == (8, 3, 51) and projected.dtype == torch.float32


def test_fused_path_is_one_operator_and_views():
    """The fused projection dispatches the operator and views, nothing that runs a kernel (no cast, no copy, none
    of the positions' ten ops): on CUDA, one launch. Rewards per sample and per branch."""
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    probs, rewards, discounts, support = inputs(*CASES[0][1:])
    for by_row in (rewards, rewards.unsqueeze(-1).expand(probs.shape[:-1]).contiguous()):
        seen.clear()
        with Ops():
            categorical_projection(probs, by_row, discounts, support)
        assert [func for func in seen if not func.is_view] == [torch.ops.fitdqn.categorical_projection.default], seen


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
    fused = categorical_projection(probs, rewards, discounts, support).cpu()
    dense = project_plain(*[value.cpu() for value in (probs, rewards, discounts, support)])  # no TF32
    # the landing positions: the kernel's against the CPU torch path's; near atom 50 one fp32 ulp is 3.8e-6 of an
    # atom and moves that much mass between two neighbours (measured on an H200 when ATen's CUDA ops computed the
    # kernel's positions: up to 4.0e-6)
    torch.testing.assert_close(fused, dense, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.sum(-1), torch.ones(fused.shape[:-1]), atol=1e-5, rtol=0)


@cuda
@pytest.mark.parametrize("case", HAT_CASES, ids=[case[0] for case in HAT_CASES])
def test_triton_kernel_on_cuda_lands_each_atom_where_the_cpu_torch_path_does(case):
    """One-hot distributions, each output row one atom's hat: the kernel rounds the positions as ATen's CPU ops do
    (IEEE division, ``addcmul`` one fused multiply-add), so up to one fp32 ulp of a position (3.8e-6 near atom 50)
    where the CPU's ``addcmul`` has no FMA."""
    probs, rewards, discounts, support = hat_inputs(*case[1:])
    fused = categorical_projection(*[value.cuda() for value in (probs, rewards, discounts, support)])
    expected = project_plain(probs, rewards, discounts, support)
    torch.testing.assert_close(fused.cpu(), expected, atol=4e-6, rtol=0)


@cuda
def test_triton_kernel_runs_in_a_cuda_graph():
    probs, rewards, discounts, support = update_sized("cuda")
    expected = categorical_projection(probs, rewards, discounts, support)  # also compiles the kernel
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture_graph does
        categorical_projection(probs, rewards, discounts, support)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = categorical_projection(probs, rewards, discounts, support)
    rewards.mul_(0.5)  # new inputs in the same memory: the replay must see them
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, categorical_projection(probs, rewards, discounts, support))
    assert not torch.equal(captured, expected)
