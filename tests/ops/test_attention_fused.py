"""The fused attention operator ``fitdqn::last_token_attention``: its CPU kernels, its fake kernels (what the
planner's trace sees), its Triton kernels under Triton's interpreter, and on a GPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from attention_interpreter import CASES, MODULE_CASES, MODULE_RESULTS, RESULTS
from storage_log import StorageLog
from support.reference.nets import attention as reference_attention
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpreter import run_under_interpreter

from fitdqn.memory.cuda_autocast import CudaAutocastOnCpu
from fitdqn.memory.trace import measure_step_memory, trace_step_memory
from fitdqn.nets.attention import LastTokenAttention
from fitdqn.ops.attention import attention_core, last_token_attention

D_MODEL, HEADS, WINDOW = 256, 4, 8
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(1, 8, 16, 4), (5, 1, 16, 2), (1, 1, 8, 1), (7, 3, 24, 3), (4, 8, 64, 4), (3, 13, 32, 2)]  # B, W, d, H


def core_and_grads(core, q, kv, heads, upstream):
    """Output and gradients (q, kv) of ``(core(q, kv, heads) * upstream).sum()``."""
    q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
    out = core(q, kv, heads)
    return [out.detach(), *torch.autograd.grad((out * upstream).sum(), [q, kv])]


def module_and_grads(module: LastTokenAttention, tokens, upstream, reference: bool = False):
    """Output and gradients (tokens, then every parameter) of ``(module(tokens) * upstream).sum()``."""
    tokens = tokens.detach().requires_grad_()
    out = reference_attention(module, tokens) if reference else module(tokens)
    return [out.detach(), *torch.autograd.grad((out * upstream).sum(), [tokens, *module.parameters()])]


# ------------------------------------------------------------------------------- the operator on the CPU

@pytest.mark.parametrize("batch, window, d_model, heads", SHAPES)
def test_operator_on_the_cpu_matches_the_reference(batch, window, d_model, heads):
    torch.manual_seed(0)
    with torch.device("cpu"):
        q, kv = torch.randn(batch, d_model).double(), torch.randn(batch, window, 2 * d_model).double()
        upstream = torch.randn(batch, d_model).double()
    fused = core_and_grads(last_token_attention, q, kv, heads, upstream)  # closed-form backward
    reference = core_and_grads(attention_core, q, kv, heads, upstream)  # autograd through the elementwise maths
    for name, got, expected in zip(RESULTS, fused, reference, strict=True):
        assert got.dtype == torch.float64 and got.shape == expected.shape, name
        torch.testing.assert_close(got, expected, msg=name)


def test_operator_on_the_cpu_takes_strided_inputs_and_keeps_dtypes():
    torch.manual_seed(0)
    q = torch.randn(6, 2 * 32)[:, ::2]  # [6, 32], column stride 2
    kv = torch.randn(6, 5, 2 * 64 + 8)[:, :, 4:4 + 64]  # [6, 5, 64], row stride 72
    upstream = torch.randn(6, 32)
    strided = core_and_grads(last_token_attention, q, kv, 4, upstream)
    dense = core_and_grads(last_token_attention, q.contiguous(), kv.contiguous(), 4, upstream)
    for name, got, expected in zip(RESULTS, strided, dense, strict=True):
        torch.testing.assert_close(got, expected, msg=name)
    q16, kv16 = q.bfloat16(), kv.double()  # mixed: the output takes kv's dtype, each gradient its input's
    out = last_token_attention(q16, kv16, 4)
    grad_q, grad_kv = torch.ops.fitdqn.last_token_attention_backward(upstream.double(), q16, kv16, 4)
    assert (out.dtype, grad_q.dtype, grad_kv.dtype) == (torch.float64, torch.bfloat16, torch.float64)


@pytest.mark.parametrize("batch, window, d_model, heads", [(5, 8, 16, 4), (1, 1, 8, 2), (3, 6, 24, 3)])
def test_fused_module_on_the_cpu_matches_the_reference(batch, window, d_model, heads):
    torch.manual_seed(0)
    module = LastTokenAttention(d_model, heads).double()
    tokens = torch.randn(batch, window, d_model, dtype=torch.float64)
    upstream = torch.randn(batch, d_model, dtype=torch.float64)
    fused = module_and_grads(module, tokens, upstream)
    reference = module_and_grads(module, tokens, upstream, reference=True)
    for name, got, expected in zip(MODULE_RESULTS, fused, reference, strict=True):
        # the reference's scores are fp32 whatever the inputs, the operator's fp64 here
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_operator_rejects_bad_shapes():
    q, kv = torch.randn(2, 16), torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="divisible"):
        last_token_attention(q, kv, 3)
    with pytest.raises(ValueError, match="kv"):
        last_token_attention(q, kv[:, :, :30], 4)
    with pytest.raises(ValueError, match="kv"):
        last_token_attention(q[:1], kv, 4)


def test_operators_pass_opcheck():
    torch.manual_seed(0)
    q, kv = torch.randn(5, 16, requires_grad=True), torch.randn(5, 3, 32, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.fitdqn.last_token_attention.default, (q, kv, 4), test_utils=checks)
    torch.library.opcheck(torch.ops.fitdqn.last_token_attention_backward.default,
                          (torch.randn(5, 16), q.detach(), kv.detach(), 4), test_utils=checks)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the op sees under autocast: bf16 projections
        torch.library.opcheck(torch.ops.fitdqn.last_token_attention.default, (q.bfloat16(), kv.bfloat16(), 2),
                              test_utils=checks)


# ---------------------------------------------------------------- the fake kernels: what the planner sees

def fake_step(fused: bool, batch: int):
    """Forward + backward of the full-size block on fake CPU tensors under bf16 autocast with CUDA's rules, as
    the planner traces a CUDA target: the forward's and the backward's storage logs, and the shapes and dtypes
    autograd saved for backward."""
    forward, backward, saved = StorageLog(), StorageLog(), []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with FakeTensorMode():
        module = LastTokenAttention(D_MODEL, HEADS)
        tokens = torch.randn(batch, WINDOW, D_MODEL, requires_grad=True)
        upstream = torch.randn(batch, D_MODEL)
        with CudaAutocastOnCpu(), torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), forward:
                out = module(tokens) if fused else reference_attention(module, tokens)
        with backward:
            (out * upstream).sum().backward()
    return forward, backward, saved


def test_fake_kernels_allocate_what_the_triton_kernels_return():
    batch = 1024
    forward, backward, _ = fake_step(True, batch)
    ops = {op: [(shape, dtype) for name, shape, dtype, _ in log.outputs if name == op]
           for op, log in (("fitdqn.last_token_attention.default", forward),
                           ("fitdqn.last_token_attention_backward.default", backward))}
    assert ops["fitdqn.last_token_attention.default"] == [((batch, D_MODEL), torch.bfloat16)]
    assert ops["fitdqn.last_token_attention_backward.default"] == [
        ((batch, D_MODEL), torch.bfloat16), ((batch, WINDOW, 2 * D_MODEL), torch.bfloat16)]


def test_fused_block_saves_and_allocates_less_than_the_elementwise_one():
    batch = 1024
    fused_forward, fused_backward, fused_saved = fake_step(True, batch)
    forward, backward, saved = fake_step(False, batch)
    # saved for backward: the core's inputs only, not the fp32 softmax [B, W, H] and its bf16 copy [B, W, H, 1]
    weights = [((batch, WINDOW, HEADS), torch.float32), ((batch, WINDOW, HEADS, 1), torch.bfloat16)]
    assert [entry for entry in saved if entry[0] in ((batch, WINDOW, HEADS), (batch, WINDOW, HEADS, 1))] == weights
    assert not [entry for entry in fused_saved if entry[0][:3] == (batch, WINDOW, HEADS)]  # nor k, v views
    assert ((batch, D_MODEL), torch.bfloat16) in fused_saved  # q
    assert ((batch, WINDOW, 2 * D_MODEL), torch.bfloat16) in fused_saved  # kv
    # no zero-filled select gradients of kv (that of tokens[:, -1] stays), no [B, W, d] products
    kv_shape = (batch, WINDOW, 2, HEADS, D_MODEL // HEADS)
    kv_selects = lambda log: [entry for entry in log.outputs  # noqa: E731
                              if "select_backward" in entry[0] and entry[1] == kv_shape]
    assert len(kv_selects(backward)) == 2 and not kv_selects(fused_backward)
    assert not [entry for entry in fused_forward.outputs if entry[0] == "aten.mul.Tensor"]
    total = lambda log: sum(nbytes for *_, nbytes in log.outputs)  # noqa: E731
    core = batch * WINDOW * D_MODEL * 2  # one [B, W, d] bf16
    assert total(forward) - total(fused_forward) >= 2 * core  # the two [B, W, d] products
    assert total(backward) - total(fused_backward) >= 8 * core


# ------------------------------------------------------------------------------ the Triton launch geometry

def test_launch_geometry():
    triton_kernels = pytest.importorskip("fitdqn.ops.attention_triton")
    blocks = triton_kernels._blocks
    assert blocks(256, 4, 8, 8, backward=False) == dict(HEADS=4, HEAD_DIM=64, BLOCK_B=8, BLOCK_H=4, BLOCK_DH=64,
                                                         PADDED=False)
    assert blocks(48, 4, 5, 4, backward=True) == dict(HEADS=4, HEAD_DIM=12, BLOCK_B=4, BLOCK_H=4, BLOCK_DH=16,
                                                       PADDED=True)
    assert blocks(24, 3, 8, 8, backward=False)["PADDED"]  # 3 heads padded to 4
    assert blocks(1024, 8, 8, 8, backward=False)["BLOCK_B"] == triton_kernels.TILE_ELEMENTS // 1024  # wide d
    assert blocks(256, 4, 1000, 8, backward=True)["BLOCK_B"] == 1  # long window: the score tiles set S
    assert blocks(256, 4, 1000, 8, backward=False)["BLOCK_B"] == 8  # the forward keeps no scores
    assert blocks(96, 1, 8, 6, backward=False)["BLOCK_B"] == 4  # a power of two


@pytest.mark.parametrize("batch, window", [(0, 8), (3, 0), (0, 0)])
def test_triton_launchers_handle_empty_inputs_without_launching(batch, window):
    triton_kernels = pytest.importorskip("fitdqn.ops.attention_triton")
    q, kv, grad_out = torch.randn(batch, 16), torch.randn(batch, window, 32), torch.randn(batch, 16)
    out = triton_kernels.fused_attention(q, kv, 4)
    grad_q, grad_kv = triton_kernels.fused_attention_grads(grad_out, q, kv, 4)
    torch.testing.assert_close(out, attention_core(q, kv, 4))  # zeros: a sum over no tokens
    assert not out.any() and not grad_q.any() and grad_kv.shape == kv.shape


# -------------------------------------------------------------------- Triton kernels under the interpreter

TOLERANCES = {"float32": 5e-6, "bfloat16": 8e-3, "float16": 1e-3}  # max error / max |reference|, fp64 reference
MODULE_TOLERANCES = {"float32": 5e-6, "bfloat16": 2e-2}  # against the fp64 module reference


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("attention_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernels_under_the_interpreter_match_the_reference(interpreted, case):
    name, batch, window, d_model, _, dtype, _ = case
    result = interpreted[name]
    assert result["shapes"] == [[batch, d_model], [batch, d_model], [batch, window, 2 * d_model]]
    assert result["dtypes"] == [f"torch.{dtype}"] * 3
    for key in RESULTS:
        assert result["fused"][key] <= TOLERANCES[dtype], (key, result["fused"][key])


@pytest.mark.parametrize("case", MODULE_CASES, ids=[case[0] for case in MODULE_CASES])
def test_fused_module_under_the_interpreter_matches_the_reference(interpreted, case):
    name, *_, dtype = case
    result = interpreted[name]
    for key in MODULE_RESULTS:
        fused, today = result["fused"][key], result["today"][key]
        assert fused <= MODULE_TOLERANCES[dtype], (key, fused, today)
        assert fused <= 1.5 * today + 1e-4, (key, fused, today)  # no worse than the elementwise path


# ----------------------------------------------------------------------------------------------- on a GPU

@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, window, d_model, heads", [(1, 8, 256, 4), (37, 8, 256, 4), (1000, 1, 256, 4),
                                                           (333, 5, 48, 4), (64, 9, 24, 3), (8192, 8, 256, 4)])
def test_triton_operator_on_cuda_matches_the_reference(batch, window, d_model, heads, dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        q, kv = torch.randn(batch, d_model).to(dtype), (torch.randn(batch, window, 2 * d_model) * 2).to(dtype)
        upstream = torch.randn(batch, d_model)
    fused = core_and_grads(last_token_attention, q, kv, heads, upstream.to(dtype))
    reference = core_and_grads(attention_core, q.double(), kv.double(), heads, upstream.to(dtype).double())
    limit = 5e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of each result
    for name, got, expected in zip(RESULTS, fused, reference, strict=True):
        assert got.dtype == dtype and got.shape == expected.shape, name
        scale = expected.abs().max().clamp_min(1e-30)
        assert ((got.double() - expected).abs().max() / scale).item() <= limit, name


@cuda
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 37, 8192])
def test_fused_module_on_cuda_matches_the_elementwise_module(batch, precision):
    torch.manual_seed(0)
    with torch.device("cuda"):
        module = LastTokenAttention(D_MODEL, HEADS)
        # as the network hands them over: the trunk's tokens in the autocast dtype, and an upstream gradient that
        # the features' dtype holds exactly (the fused block's features are bf16 under autocast)
        tokens = torch.randn(batch, WINDOW, D_MODEL).to(precision)
        upstream = torch.randn(batch, D_MODEL).to(precision).float()
    with torch.autocast("cuda", dtype=precision, enabled=precision != torch.float32):
        fused = module_and_grads(module, tokens, upstream)
        today = module_and_grads(module, tokens, upstream, reference=True)
    today[0] = today[0].to(fused[0].dtype)  # the features as the heads read them: they cast the fp32 ones to bf16
    oracle = module_and_grads(copy.deepcopy(module).double(), tokens.double(), upstream.double(), reference=True)
    # errors as norms, relative; in bf16 both paths share the projections' roundings, and the fused core is the
    # more precise one (fp32 products, unrounded weights): "no worse than today" up to bf16 noise
    limit, slack = (1e-5, 1e-6) if precision == torch.float32 else (2e-2, 1e-3)
    for name, got, now, expected in zip(MODULE_RESULTS, fused, today, oracle, strict=True):
        scale = expected.norm().clamp_min(1e-30)
        error, today_error = (got.double() - expected).norm() / scale, (now.double() - expected).norm() / scale
        assert error <= limit, (name, error, today_error)
        assert error <= 1.5 * today_error + slack, (name, error, today_error)  # no worse than today


@cuda
def test_fused_kernels_pass_opcheck_on_cuda():
    torch.manual_seed(0)
    with torch.device("cuda"):
        q, kv, grad_out = torch.randn(70, D_MODEL), torch.randn(70, WINDOW, 2 * D_MODEL), torch.randn(70, D_MODEL)
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.fitdqn.last_token_attention.default, (q.to(dtype), kv.to(dtype), HEADS),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.fitdqn.last_token_attention_backward.default,
                              (grad_out.to(dtype), q.to(dtype), kv.to(dtype), HEADS),
                              test_utils=("test_schema", "test_faketensor"))


@cuda
@pytest.mark.parametrize("batch", [1024, 8192])
def test_fused_block_on_cuda_allocates_what_the_trace_counts(batch):
    def make_step(batch_size: int, device: torch.device):
        with device:
            module = LastTokenAttention(D_MODEL, HEADS)
            tokens = torch.randn(batch_size, WINDOW, D_MODEL, requires_grad=True)
            upstream = torch.randn(batch_size, D_MODEL)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = module(tokens)
            (out * upstream).sum().backward()

        return step

    traced = trace_step_memory(make_step, batch, "cuda")
    measured = measure_step_memory(make_step, batch, "cuda")
    slack = (1 << 20) * (traced.large_blocks_at_peak + 1)  # a large block may be rounded up by 1 MiB
    assert abs(measured - traced.step_bytes) <= slack, (measured, traced.step_bytes)
