"""The weighted loss ``fitdqn::weighted_losses`` and its backward: the CPU kernels against the plain autograd
function (``tests/support/reference``, the oracle), the fake kernels (what the planner's trace sees) against the
real outputs and the Triton launchers', the Triton kernels under Triton's interpreter and on a GPU (in a CUDA graph
too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.reference import losses as reference
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpreter import run_under_interpreter
from weighted_losses_interpreter import CASES, ELEMENTWISE, RESULTS

from fitdqn.learn.losses import weighted_losses
from fitdqn.ops.weighted_losses import (
    loss_parts,
    programs,
    sample_block,
    weighted_losses_backward,
    weighted_losses_op,
)

EXPECTILE = 0.7
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# B, br, A: below and above one block (16 samples at br 3, A 51; 128 at A 7), a block exactly, one atom
SHAPES = [(64, 3, 11), (5, 3, 51), (37, 3, 51), (16, 3, 51), (70, 3, 7), (300, 3, 7), (3, 1, 1)]


def inputs(batch, branches, atoms, dtype=torch.float32, device="cpu", target_dtype=torch.float32, seed=0):
    """c51_target ``[B, br, A]`` (``target_dtype``), log_probs ``[B, br, A]`` (a leaf), iqn and v ``[B]`` in
    ``dtype`` (leaves), v_target and weight ``[B]`` (v_target - v of both signs, one weight exactly 0),
    loss_weights ``[3]``."""
    generator = torch.Generator().manual_seed(seed)
    c51_target = torch.softmax(torch.randn(batch, branches, atoms, generator=generator), -1).to(target_dtype)
    log_probs = torch.log_softmax(torch.randn(batch, branches, atoms, generator=generator), -1).to(target_dtype)
    iqn = torch.rand(batch, generator=generator).to(dtype)
    v = torch.randn(batch, generator=generator).to(dtype)
    v_target = torch.randn(batch, generator=generator).to(target_dtype)
    weight = (torch.rand(batch, generator=generator) + 0.1).to(target_dtype)
    weight[:1] = 0.0
    loss_weights = torch.tensor([1.0, 0.5, 2.0], dtype=target_dtype)
    tensors = (c51_target, log_probs, iqn, v, v_target, weight, loss_weights)
    return tuple(tensor.to(device) for tensor in tensors)


def losses_and_grads(fused, c51_target, log_probs, iqn, v, v_target, weight, loss_weights):
    """loss, means, priorities and the gradients of log_probs, iqn and v, from ``loss.backward()``."""
    leaves = [tensor.detach().requires_grad_() for tensor in (log_probs, iqn, v)]
    function = weighted_losses if fused else reference.weighted_losses  # the operators, or the plain oracle
    loss, means, priorities = function(c51_target, *leaves, v_target, weight, loss_weights, EXPECTILE)
    loss.backward()
    return [loss.detach(), means, priorities, *[leaf.grad for leaf in leaves]]


def assert_matches_the_torch_path(fused, torch_path, exact_priorities):
    """Gradients bit for bit (the same operations in the same order), the sums within fp32 summation order."""
    for key, got, expected in zip(RESULTS, fused, torch_path, strict=True):
        assert (got.shape, got.dtype) == (expected.shape, expected.dtype), key
        if key in ELEMENTWISE or (key == "priorities" and exact_priorities):
            assert torch.equal(got, expected), key
        else:
            torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-7, msg=key)


# ------------------------------------------------------------------------------- the operators on the CPU

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, branches, atoms", SHAPES)
def test_fused_path_on_the_cpu_equals_the_torch_path(batch, branches, atoms, dtype):
    tensors = inputs(batch, branches, atoms, dtype)
    fused, torch_path = losses_and_grads(True, *tensors), losses_and_grads(False, *tensors)
    assert_matches_the_torch_path(fused, torch_path, exact_priorities=True)  # the CPU kernel: torch's own sum
    loss, means, priorities = fused[:3]
    torch.testing.assert_close(loss, means @ tensors[-1])
    assert not means.requires_grad and not priorities.requires_grad
    assert fused[4].dtype == fused[5].dtype == dtype  # iqn's and v's gradients in their dtypes


def test_fused_path_under_autocast_runs_in_fp32():
    tensors = inputs(37, 3, 51, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = losses_and_grads(True, *tensors)
    assert_matches_the_torch_path(fused, losses_and_grads(False, *tensors), exact_priorities=True)


def test_partial_sums_are_each_programs_samples_in_its_first_row():
    batch, branches, atoms = 37, 3, 51
    c51_target, log_probs, iqn, v, v_target, weight, loss_weights = inputs(batch, branches, atoms)
    priorities, partial_sums = weighted_losses_op(c51_target, log_probs, iqn, v, v_target, weight, EXPECTILE)
    assert partial_sums.shape == (batch, 3)
    diff = v_target - v
    iql = torch.where(diff < 0, 1 - EXPECTILE, EXPECTILE) * diff * diff
    per_sample = torch.stack([priorities, iqn, iql], 1) * (weight / batch).unsqueeze(1)  # [B, 3]
    rows = sample_block(branches, atoms)
    assert (rows, programs(batch, branches, atoms)) == (16, 3)
    for program in range(3):
        block = slice(program * rows, (program + 1) * rows)
        torch.testing.assert_close(partial_sums[block][0], per_sample[block].sum(0))
        assert not partial_sums[block][1:].any()  # the program's other rows are zeros


def test_fused_gradients_pass_gradcheck_in_fp64():
    c51_target, log_probs, iqn, v, v_target, weight, loss_weights = inputs(
        19, 3, 5, torch.float64, target_dtype=torch.float64)
    v_target = v + torch.linspace(-1.0, 1.0, 19, dtype=torch.float64) + 0.025  # no difference near 0 (the kink)

    def loss(log_probs, iqn, v):
        return weighted_losses(c51_target, log_probs, iqn, v, v_target, weight, loss_weights, EXPECTILE).loss

    leaves = [tensor.requires_grad_() for tensor in (log_probs, iqn, v)]
    assert torch.autograd.gradcheck(loss, leaves)


def test_autograd_saves_only_tensors_that_exist_anyway():
    """The inputs (targets, v, v_target, weight, loss_weights), nothing the forward made: the slope is recomputed."""
    tensors = inputs(37, 3, 51)
    c51_target, log_probs, iqn, v, v_target, weight, loss_weights = tensors
    v = v.requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        weighted_losses(c51_target, log_probs.requires_grad_(), iqn, v, v_target, weight, loss_weights, EXPECTILE)
    assert sorted(saved) == sorted(tensor.untyped_storage().data_ptr()
                                   for tensor in (c51_target, v, v_target, weight, loss_weights))


def test_no_gradient_for_an_input_that_asks_for_none():
    c51_target, log_probs, iqn, v, v_target, weight, loss_weights = inputs(20, 3, 7)
    v = v.requires_grad_()
    loss = weighted_losses(c51_target, log_probs, iqn, v, v_target, weight, loss_weights, EXPECTILE).loss
    (grad_v,) = torch.autograd.grad(loss, [v])
    assert torch.equal(grad_v, losses_and_grads(False, c51_target, log_probs, iqn, v, v_target, weight,
                                                loss_weights)[-1])


def test_operators_reject_bad_shapes():
    c51_target, log_probs, iqn, v, v_target, weight, _ = inputs(6, 3, 7)
    with pytest.raises(ValueError, match="weighted_losses"):
        weighted_losses_op(c51_target, log_probs[:, :2], iqn, v, v_target, weight, EXPECTILE)
    with pytest.raises(ValueError, match="weighted_losses"):
        weighted_losses_op(c51_target, log_probs, iqn[:5], v, v_target, weight, EXPECTILE)
    with pytest.raises(ValueError, match="weighted_losses"):
        weighted_losses_op(c51_target[0], log_probs[0], iqn[:3], v[:3], v_target[:3], weight[:3], EXPECTILE)


def test_operators_pass_opcheck():
    for dtype in (torch.float32, torch.bfloat16):
        c51_target, log_probs, iqn, v, v_target, weight, loss_weights = inputs(37, 3, 51, dtype)
        torch.library.opcheck(torch.ops.fitdqn.weighted_losses.default,
                              (c51_target, log_probs, iqn, v, v_target, weight, EXPECTILE))
        torch.library.opcheck(torch.ops.fitdqn.weighted_losses_backward.default,
                              (torch.tensor(1.5), c51_target, v, v_target, weight, loss_weights, EXPECTILE, dtype))


# ---------------------------------------------------------------- the fake kernels: what the planner sees

def outputs(batch, branches, atoms, dtype, target_dtype, fake):
    """Shapes and dtypes of the forward op's and the backward op's outputs, on fake or real CPU tensors."""
    with FakeTensorMode() if fake else torch.no_grad():
        c51_target, log_probs, iqn, v, v_target, weight, loss_weights = inputs(
            batch, branches, atoms, dtype, target_dtype=target_dtype)
        forward = weighted_losses_op(c51_target, log_probs, iqn, v, v_target, weight, EXPECTILE)
        grad_loss = torch.ones((), dtype=target_dtype)
        backward = weighted_losses_backward(grad_loss, c51_target, v, v_target, weight, loss_weights, EXPECTILE,
                                            iqn.dtype)
    return [[(tuple(t.shape), t.dtype) for t in tensors] for tensors in (forward, backward)]


@pytest.mark.parametrize("dtype, target_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float64, torch.float64)])
@pytest.mark.parametrize("batch, branches, atoms", SHAPES + [(8192, 3, 51), (0, 3, 51)])
def test_fake_kernels_allocate_what_the_cpu_kernels_return(batch, branches, atoms, dtype, target_dtype):
    real = outputs(batch, branches, atoms, dtype, target_dtype, fake=False)
    assert outputs(batch, branches, atoms, dtype, target_dtype, fake=True) == real
    assert real == [[((batch,), target_dtype), ((batch, 3), target_dtype)],
                    [((batch, branches, atoms), target_dtype), ((batch,), dtype), ((batch,), dtype)]]


def test_programs_tile_about_4096_numbers():
    assert (sample_block(3, 51), sample_block(3, 7), sample_block(1, 1), sample_block(3, 4096)) == (16, 128, 4096, 1)
    assert (programs(8192, 3, 51), programs(16, 3, 51), programs(17, 3, 51), programs(0, 3, 51)) == (512, 1, 2, 0)


def test_the_cpu_maths_cut_the_partial_sums_by_programs():
    tensors = inputs(300, 3, 7)
    priorities, partial_sums = loss_parts(*tensors[:-1], EXPECTILE)
    assert partial_sums.shape == (300, 3)
    assert partial_sums.any(1).nonzero().flatten().tolist() == [0, 128, 256]  # 128 samples a program
    torch.testing.assert_close(partial_sums.sum(0), losses_and_grads(False, *tensors)[1], rtol=2e-6, atol=1e-7)


# -------------------------------------------------------------------- Triton kernels under the interpreter

@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("weighted_losses_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernels_under_the_interpreter_match_the_torch_path(interpreted, case):
    name, batch, branches, atoms, dtype_name, _ = case
    result = interpreted[name]
    assert all(result["equal"][key] for key in ELEMENTWISE), result["equal"]  # the gradients bit for bit
    for key in RESULTS:
        assert result["error"][key] <= 1e-6, key  # the sums: fp32 summation order
        got, expected = result["dtypes"][key]
        assert got == expected, key
    assert result["partial_sums_error"] <= 1e-6  # each program's sums, as the CPU kernel cuts them
    # the launchers allocate what the fake kernels (and the CPU kernels) do: one row of partial sums a sample
    dtype = getattr(torch, dtype_name)
    launched = [[(tuple(shape), getattr(torch, kind.removeprefix("torch."))) for shape, kind
                 in zip(result[op]["shapes"], result[op]["dtypes"], strict=True)] for op in ("forward", "backward")]
    assert launched == outputs(batch, branches, atoms, dtype, torch.float32, fake=True)
    assert launched[0][1][0] == (batch, 3)


def test_launch_geometry():
    triton_kernels = pytest.importorskip("fitdqn.ops.weighted_losses_triton")
    assert triton_kernels._blocks(3, 51) == dict(BLOCK_B=16, BLOCK_BR=4, BLOCK_A=64)
    assert triton_kernels._blocks(3, 7) == dict(BLOCK_B=128, BLOCK_BR=4, BLOCK_A=8)
    assert triton_kernels._scalars(8, 3, 0.7) == dict(inv_batch=0.125, neg_inv_branches=-1.0 / 3,
                                                      below=1.0 - 0.7, above=0.7)


def test_triton_launchers_handle_an_empty_batch_without_launching():
    triton_kernels = pytest.importorskip("fitdqn.ops.weighted_losses_triton")
    c51_target, log_probs, iqn, v, v_target, weight, loss_weights = inputs(0, 3, 51)
    priorities, partial_sums = triton_kernels.fused_weighted_losses(c51_target, log_probs, iqn, v, v_target, weight,
                                                                    EXPECTILE)
    grads = triton_kernels.fused_weighted_losses_grads(torch.ones(()), c51_target, v, v_target, weight, loss_weights,
                                                       EXPECTILE, iqn.dtype)
    assert priorities.shape == (0,) and partial_sums.shape == (0, 3)
    assert [grad.shape for grad in grads] == [(0, 3, 51), (0,), (0,)]


# ----------------------------------------------------------------------------------------------- on a GPU

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, branches, atoms", [(1, 3, 51), (37, 3, 51), (1000, 3, 7), (8192, 3, 51)])
def test_triton_kernels_on_cuda_match_the_torch_path(batch, branches, atoms, dtype):
    tensors = inputs(batch, branches, atoms, dtype, device="cuda")
    fused, torch_path = losses_and_grads(True, *tensors), losses_and_grads(False, *tensors)
    assert_matches_the_torch_path(fused, torch_path, exact_priorities=False)
    priorities, partial_sums = weighted_losses_op(*tensors[:-1], EXPECTILE)
    assert partial_sums.shape == (batch, 3)  # one row a sample: each program's sums in its first sample's row
    block = pytest.importorskip("fitdqn.ops.weighted_losses_triton")._blocks(branches, atoms)["BLOCK_B"]
    rows = partial_sums.cpu()
    assert not rows[[i for i in range(batch) if i % block]].any()
    torch.testing.assert_close(rows.sum(0), loss_parts(*[t.cpu() for t in tensors[:-1]], EXPECTILE)[1].sum(0),
                               rtol=2e-6, atol=1e-7)


@cuda
def test_triton_kernels_run_in_a_cuda_graph():
    """grad_loss and loss_weights are read on the device: a replay sees new values in the same memory."""
    tensors = inputs(8192, 3, 51, torch.bfloat16, device="cuda")
    c51_target, log_probs, iqn, v, v_target, weight, loss_weights = tensors
    leaves = [tensor.detach().requires_grad_() for tensor in (log_probs, iqn, v)]
    grad_loss = torch.ones((), device="cuda")

    def step():
        for leaf in leaves:
            leaf.grad = None
        loss, means, priorities = weighted_losses(c51_target, *leaves, v_target, weight, loss_weights, EXPECTILE)
        loss.backward(grad_loss)
        return [loss.detach(), means, priorities, *[leaf.grad for leaf in leaves]]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture_graph does
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    grad_loss.fill_(2.0)  # new values in the same memory: the replay must read them
    loss_weights.copy_(torch.tensor([1.0, 0.25, 3.0]))
    v_target.add_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    for leaf in leaves:
        leaf.grad = None
    expected = losses_and_grads(False, c51_target, *leaves, v_target, weight, loss_weights)
    expected[3:] = [grad * 2.0 for grad in expected[3:]]  # the gradient of 2 loss (exact: a power of two)
    assert_matches_the_torch_path(captured, expected, exact_priorities=False)


@cuda
def test_triton_operators_pass_opcheck_on_cuda():
    for dtype in (torch.float32, torch.bfloat16):
        c51_target, log_probs, iqn, v, v_target, weight, loss_weights = inputs(70, 3, 51, dtype, device="cuda")
        torch.library.opcheck(torch.ops.fitdqn.weighted_losses.default,
                              (c51_target, log_probs, iqn, v, v_target, weight, EXPECTILE),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.fitdqn.weighted_losses_backward.default,
                              (torch.ones((), device="cuda"), c51_target, v, v_target, weight, loss_weights,
                               EXPECTILE, dtype), test_utils=("test_schema", "test_faketensor"))
