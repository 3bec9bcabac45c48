"""The fused residual add + LayerNorm ``fitdqn::residual_layer_norm``: its CPU kernels against ``F.layer_norm`` of the
sum, its fake kernels (what the planner's trace sees) against the real outputs and the Triton launchers', its
Triton kernels under Triton's interpreter, on a GPU, and in ``LastTokenAttention``."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attention_interpreter import MODULE_RESULTS
from residual_norm_interpreter import CASES, MODULE_CASES, RESULTS
from storage_log import StorageLog
from support.reference.nets import attention as reference_attention
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpreter import run_under_interpreter

from fitdqn.memory.cuda_autocast import CudaAutocastOnCpu
from fitdqn.nets.attention import LastTokenAttention
from fitdqn.ops.residual_norm import programs, residual_layer_norm, residual_layer_norm_op, row_block

EPS = 1e-5
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(1, 8), (5, 64), (70, 64), (7, 48), (37, 256), (3, 3)]  # B, d: below and above a block, padded widths


def inputs(batch, d_model, dtype, strided=False, device="cpu"):
    """x ``[B, d]``, residual ``[B, d]`` (a row view of ``[B, 3, d]`` if asked), weight, bias ``[d]``, upstream."""
    torch.manual_seed(0)
    x = torch.randn(batch, d_model, dtype=torch.float64).to(device, dtype)
    residual = (torch.randn(batch, 3, d_model, dtype=torch.float64) * 2 + 1).to(device, dtype)
    residual = residual[:, 1] if strided else residual[:, 1].contiguous()
    weight = 1 + 0.5 * torch.randn(d_model, dtype=torch.float64).to(device, dtype)
    bias = 0.5 * torch.randn(d_model, dtype=torch.float64).to(device, dtype)
    return x, residual, weight, bias, torch.randn(batch, d_model, dtype=torch.float64).to(device, dtype)


def value_and_grads(norm, x, residual, weight, bias, upstream):
    """Output and gradients (x, residual, weight, bias) of ``(norm(x, residual, weight, bias) * upstream).sum()``."""
    leaves = [t.detach().requires_grad_() for t in (x, residual, weight, bias)]
    out = norm(*leaves)
    return [out.detach(), *torch.autograd.grad((out * upstream).sum(), leaves)]


def fused(x, residual, weight, bias):
    return residual_layer_norm(x, residual, weight, bias, EPS)


def unfused(x, residual, weight, bias):
    return F.layer_norm(x + residual, x.shape[1:], weight, bias, EPS)


NAMES = ("out", "grad_x", "grad_residual", "grad_weight", "grad_bias")


# ------------------------------------------------------------------------------- the operator on the CPU

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch, d_model", SHAPES)
def test_operator_on_the_cpu_matches_layer_norm_of_the_sum(batch, d_model, dtype):
    tensors = inputs(batch, d_model, dtype)
    got = value_and_grads(fused, *tensors)
    expected = value_and_grads(unfused, *tensors)
    for name, value, reference in zip(NAMES, got, expected, strict=True):
        assert value.dtype == dtype and value.shape == reference.shape, name
        torch.testing.assert_close(value, reference, msg=name)


def test_operator_passes_gradcheck_in_fp64():
    x, residual, weight, bias, _ = inputs(20, 256, torch.float64, strided=True)  # two programs' partial sums
    leaves = [t.detach().requires_grad_() for t in (x, residual, weight, bias)]
    assert torch.autograd.gradcheck(fused, leaves, fast_mode=True)  # a random projection of the Jacobian
    small = [t.detach().requires_grad_() for t in inputs(3, 8, torch.float64, strided=True)[:4]]
    assert torch.autograd.gradcheck(fused, small)  # every entry


def test_operator_takes_a_strided_residual():
    strided = inputs(9, 32, torch.float32, strided=True)
    assert not strided[1].is_contiguous() and strided[1].stride(0) == 3 * 32
    dense = (strided[0], strided[1].contiguous(), *strided[2:])
    for name, got, expected in zip(NAMES, value_and_grads(fused, *strided), value_and_grads(fused, *dense),
                                   strict=True):
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("batch, d_model", [(5, 64), (37, 256), (9, 48)])
def test_bf16_sum_is_the_bf16_add_and_out_is_one_rounding(batch, d_model):
    x, residual, weight, bias, upstream = inputs(batch, d_model, torch.bfloat16)
    weight, bias = weight.float(), bias.float()  # the parameters stay fp32 under autocast
    out, total, mean, rstd = residual_layer_norm_op(x, residual, weight, bias, EPS)
    assert torch.equal(total, x + residual)  # bit for bit the add the unfused block made
    assert (out.dtype, total.dtype, mean.dtype, rstd.dtype) == (torch.bfloat16,) * 2 + (torch.float32,) * 2
    exact = F.layer_norm(total.double(), (d_model,), weight.double(), bias.double(), EPS)  # from the same sum
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # within one bf16 rounding
    variance, expected_mean = torch.var_mean(total.double(), dim=-1, correction=0)
    torch.testing.assert_close(mean.double(), expected_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(variance + EPS), rtol=1e-6, atol=0)
    # gradients: from the bf16 upstream, in fp32, against the fp64 LayerNorm of the same sum
    grads = value_and_grads(fused, x, residual, weight, bias, upstream)[1:]
    total64 = total.double().requires_grad_()
    weight64, bias64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    out64 = F.layer_norm(total64, (d_model,), weight64, bias64, EPS)
    expected = torch.autograd.grad((out64 * upstream.double()).sum(), [total64, weight64, bias64])
    assert [grad.dtype for grad in grads] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    for name, got, reference in zip(NAMES[1:], grads, (expected[0], *expected), strict=True):
        scale = reference.abs().max()
        limit = 8e-3 if got.dtype == torch.bfloat16 else 1e-5  # bf16: one rounding at the store
        assert ((got.double() - reference).abs().max() / scale).item() <= limit, name


def test_only_out_is_differentiable():
    x, residual, weight, bias, _ = inputs(4, 16, torch.float32)
    out, total, mean, rstd = residual_layer_norm_op(x.requires_grad_(), residual, weight, bias, EPS)
    assert out.requires_grad and not (total.requires_grad or mean.requires_grad or rstd.requires_grad)
    out.sum().backward()  # the other outputs' gradients are not materialised as zeros (materialize_grads off)
    assert x.grad is not None


def test_empty_batch():
    x, residual, weight, bias, upstream = inputs(0, 16, torch.float32)
    out, *grads = value_and_grads(fused, x, residual, weight, bias, upstream)
    assert out.shape == (0, 16) and not grads[2].any() and not grads[3].any()


def test_operator_rejects_bad_shapes():
    x, residual, weight, bias, _ = inputs(3, 8, torch.float32)
    with pytest.raises(ValueError, match="residual_layer_norm"):
        fused(x, residual[:, :4], weight, bias)
    with pytest.raises(ValueError, match="residual_layer_norm"):
        fused(x, residual, weight[:4], bias)
    with pytest.raises(ValueError, match="residual_layer_norm"):
        fused(x.unsqueeze(0), residual.unsqueeze(0), weight, bias)


def test_operators_pass_opcheck():
    x, residual, weight, bias, upstream = inputs(70, 48, torch.float32, strided=True)
    args = [t.detach().requires_grad_() for t in (x, residual, weight, bias)]
    torch.library.opcheck(torch.ops.fitdqn.residual_layer_norm.default, (*args, EPS))
    _, total, mean, rstd = residual_layer_norm_op(x, residual, weight, bias, EPS)
    torch.library.opcheck(torch.ops.fitdqn.residual_layer_norm_backward.default,
                          (upstream, total, mean, rstd, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the op sees under autocast: bf16 x and residual
        torch.library.opcheck(torch.ops.fitdqn.residual_layer_norm.default,
                              (x.bfloat16(), residual.bfloat16(), weight, bias, EPS),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


# ---------------------------------------------------------------- the fake kernels: what the planner sees

def fake_outputs(batch, d_model, dtype):
    """Shapes and dtypes of the forward op's and the backward op's outputs on fake tensors."""
    with FakeTensorMode():
        x, residual = torch.empty(batch, d_model, dtype=dtype), torch.empty(batch, 3, d_model, dtype=dtype)[:, 1]
        weight, bias = torch.empty(d_model), torch.empty(d_model)
        forward = residual_layer_norm_op(x, residual, weight, bias, EPS)
        backward = torch.ops.fitdqn.residual_layer_norm_backward(x, *forward[1:], weight)
    return [[(tuple(t.shape), t.dtype) for t in outputs] for outputs in (forward, backward)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("batch, d_model", SHAPES + [(8192, 256), (0, 64)])
def test_fake_kernels_allocate_what_the_cpu_kernels_return(batch, d_model, dtype):
    x, residual, weight, bias, upstream = inputs(batch, d_model, dtype, strided=True)
    forward = residual_layer_norm_op(x, residual, weight.float(), bias.float(), EPS)
    backward = torch.ops.fitdqn.residual_layer_norm_backward(upstream, *forward[1:], weight.float())
    real = [[(tuple(t.shape), t.dtype) for t in outputs] for outputs in (forward, backward)]
    assert fake_outputs(batch, d_model, dtype) == real
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert real[1][1] == ((programs(batch, d_model), 2, d_model), acc)  # the partial sums: one row a program


def test_programs_tile_about_4096_numbers():
    assert (row_block(64), row_block(256), row_block(48), row_block(4096), row_block(8192)) == (64, 16, 64, 1, 1)
    assert (programs(8192, 256), programs(8192, 64), programs(1, 256), programs(17, 256), programs(0, 256)) == \
        (512, 128, 1, 2, 0)


def fake_block(fused_block: bool, batch: int, d_model: int = 256, heads: int = 4, window: int = 8):
    """Forward + backward of the attention block on fake CPU tensors under bf16 autocast with CUDA's rules, as the
    planner traces a CUDA target: the forward's and the backward's storage logs, and what autograd saved."""
    forward, backward, saved = StorageLog(), StorageLog(), []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with FakeTensorMode():
        module = LastTokenAttention(d_model, heads)
        tokens = torch.randn(batch, window, d_model, dtype=torch.bfloat16, requires_grad=True)  # the trunk's
        upstream = torch.randn(batch, d_model)
        with CudaAutocastOnCpu(), torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), forward:
                out = module(tokens) if fused_block else reference_attention(module, tokens)
        with backward:
            (out * upstream).sum().backward()
    return forward, backward, saved, out.dtype


def test_fused_block_traces_the_operator_outputs_and_saves_no_fp32_features():
    batch, d_model = 1024, 256
    forward, backward, saved, out_dtype = fake_block(True, batch)
    ops = {op: [(shape, dtype) for name, shape, dtype, _ in log.outputs if name == op]
           for op, log in (("fitdqn.residual_layer_norm.default", forward),
                           ("fitdqn.residual_layer_norm_backward.default", backward))}
    assert ops["fitdqn.residual_layer_norm.default"] == [
        ((batch, d_model), torch.bfloat16), ((batch, d_model), torch.bfloat16), ((batch,), torch.float32),
        ((batch,), torch.float32)]
    assert ops["fitdqn.residual_layer_norm_backward.default"] == [
        ((batch, d_model), torch.bfloat16), ((programs(batch, d_model), 2, d_model), torch.float32)]
    assert out_dtype == torch.bfloat16  # the features, as the heads read them
    assert ((batch, d_model), torch.float32) not in saved  # not the fp32 LayerNorm input
    assert ((batch, d_model), torch.bfloat16) in saved and ((batch,), torch.float32) in saved  # total, mean, rstd
    assert not [entry for entry in forward.outputs + backward.outputs if "layer_norm" in entry[0]
                and "fitdqn" not in entry[0]]  # no ATen LayerNorm either way
    _, _, unfused_saved, unfused_dtype = fake_block(False, batch)
    assert unfused_dtype == torch.float32 and ((batch, d_model), torch.float32) in unfused_saved


# ------------------------------------------------------------------------------------------------ the module

@pytest.mark.parametrize("batch, window, d_model, heads", [(5, 8, 16, 4), (70, 3, 64, 4), (3, 6, 24, 3)])
def test_fused_module_matches_the_reference_with_nn_layer_norm(batch, window, d_model, heads):
    torch.manual_seed(0)
    module = LastTokenAttention(d_model, heads).double()
    with torch.no_grad():  # a weight and bias that are not 1 and 0
        module.norm.weight.normal_(1, 0.5)
        module.norm.bias.normal_(0, 0.5)
    tokens = torch.randn(batch, window, d_model, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(batch, d_model, dtype=torch.float64)
    results = []
    for forward in (module, functools.partial(reference_attention, module)):
        out = forward(tokens)
        results.append([out.detach(), *torch.autograd.grad((out * upstream).sum(), [tokens, *module.parameters()])])
    for index, (got, expected) in enumerate(zip(*results, strict=True)):
        # the reference's attention scores are fp32 whatever the inputs, the operators' fp64 here
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=str(index))


def test_fused_module_under_bf16_autocast_rounds_the_reference_features():
    torch.manual_seed(0)
    module = LastTokenAttention(64, 4)
    tokens = torch.randn(9, 8, 64).bfloat16()  # as the trunk hands them over under autocast
    with CudaAutocastOnCpu(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, reference = module(tokens), reference_attention(module, tokens)  # CUDA autocast's fp32 LayerNorm
    assert (out.dtype, reference.dtype) == (torch.bfloat16, torch.float32)
    assert ((out.double() - reference.double()).abs() <= reference.double().abs() * 2**-8 + 1e-5).all()


# -------------------------------------------------------------------- Triton kernels under the interpreter

TOLERANCES = {"float32": 5e-6, "bfloat16": 8e-3, "float16": 1e-3}  # max error / max |reference|, fp64 reference
STATISTICS_TOLERANCE = 5e-6  # mean, rstd and the weight and bias gradients: fp32 sums of exactly loaded numbers
MODULE_TOLERANCES = {"float32": 5e-6, "bfloat16": 2e-2}  # against the fp64 module reference


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("residual_norm_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernels_under_the_interpreter_match_the_reference(interpreted, case):
    name, batch, d_model, dtype_name, _ = case
    result = interpreted[name]
    assert result["total_equals_add"]  # the sum rounded to x's dtype, bit for bit the add of the two
    for key in RESULTS:
        exact = key in ("mean", "rstd", "grad_weight", "grad_bias")
        assert result["fused"][key] <= (STATISTICS_TOLERANCE if exact else TOLERANCES[dtype_name]), key
    dtype = getattr(torch, dtype_name)
    assert result["grad_dtypes"] == [str(dtype)] * 2 + ["torch.float32"] * 2
    # the launchers allocate what the fake kernels (and the CPU kernels) do, P included
    launched = [[(tuple(shape), getattr(torch, kind.removeprefix("torch."))) for shape, kind
                 in zip(result[op]["shapes"], result[op]["dtypes"], strict=True)] for op in ("forward", "backward")]
    assert launched == fake_outputs(batch, d_model, dtype)
    assert launched[1][1][0] == (programs(batch, d_model), 2, d_model)


@pytest.mark.parametrize("case", MODULE_CASES, ids=[case[0] for case in MODULE_CASES])
def test_fused_module_under_the_interpreter_matches_the_reference(interpreted, case):
    name, *_, dtype = case
    result = interpreted[name]
    for key in MODULE_RESULTS:
        got, today = result["fused"][key], result["today"][key]
        assert got <= MODULE_TOLERANCES[dtype], (key, got, today)
        assert got <= 1.5 * today + 1e-4, (key, got, today)  # no worse than the elementwise path


def test_launch_geometry():
    triton_kernels = pytest.importorskip("fitdqn.ops.residual_norm_triton")
    blocks = triton_kernels._blocks
    assert blocks(256) == dict(BLOCK_M=16, BLOCK_D=256, PADDED=False)
    assert blocks(64) == dict(BLOCK_M=64, BLOCK_D=64, PADDED=False)
    assert blocks(48) == dict(BLOCK_M=64, BLOCK_D=64, PADDED=True)


def test_triton_launchers_handle_an_empty_batch_without_launching():
    triton_kernels = pytest.importorskip("fitdqn.ops.residual_norm_triton")
    x, weight = torch.empty(0, 64), torch.ones(64)
    out, total, mean, rstd = triton_kernels.fused_residual_norm(x, x, weight, weight, EPS)
    grad_total, partial_sums = triton_kernels.fused_residual_norm_grads(x, total, mean, rstd, weight)
    assert out.shape == total.shape == grad_total.shape == (0, 64) and partial_sums.shape == (0, 2, 64)


# ----------------------------------------------------------------------------------------------- on a GPU

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, d_model, strided", [(1, 256, False), (37, 256, True), (1000, 64, False),
                                                     (333, 48, True), (8192, 256, True)])
def test_triton_operator_on_cuda_matches_the_reference(batch, d_model, strided, dtype):
    x, residual, weight, bias, upstream = inputs(batch, d_model, dtype, strided, device="cuda")
    assert residual.is_contiguous() != strided
    weight, bias = weight.float(), bias.float()
    out, total, mean, rstd = residual_layer_norm_op(x, residual, weight, bias, EPS)
    assert torch.equal(total, x + residual)
    got = value_and_grads(fused, x, residual, weight, bias, upstream)
    # the fp64 LayerNorm of the rounded sum (its "residual" zero: x's and the residual's gradients are the sum's)
    expected = value_and_grads(unfused, total.double(), torch.zeros_like(total, dtype=torch.float64),
                               weight.double(), bias.double(), upstream.double())
    for name, value, reference in zip(NAMES, got, expected, strict=True):
        limit = 8e-3 if value.dtype == torch.bfloat16 else 5e-6
        assert value.shape == reference.shape, name
        scale = reference.abs().max().clamp_min(1e-30)
        assert ((value.double() - reference).abs().max() / scale).item() <= limit, name


@cuda
def test_triton_operators_pass_opcheck_on_cuda():
    for dtype in (torch.float32, torch.bfloat16):
        x, residual, weight, bias, upstream = inputs(70, 256, dtype, strided=True, device="cuda")
        weight, bias = weight.float(), bias.float()
        torch.library.opcheck(torch.ops.fitdqn.residual_layer_norm.default, (x, residual, weight, bias, EPS),
                              test_utils=("test_schema", "test_faketensor"))
        _, total, mean, rstd = residual_layer_norm_op(x, residual, weight, bias, EPS)
        torch.library.opcheck(torch.ops.fitdqn.residual_layer_norm_backward.default,
                              (upstream, total, mean, rstd, weight), test_utils=("test_schema", "test_faketensor"))


# the fused module on a GPU against the elementwise one and the fp64 oracle, through both operators:
# test_attention_fused.test_fused_module_on_cuda_matches_the_elementwise_module
