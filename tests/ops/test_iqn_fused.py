"""The IQN operator ``fitdqn::iqn_quantile_head``: its CPU kernel, its fake kernels (what the planner's trace sees),
where its Triton kernels run, its Triton kernels under Triton's interpreter, and on a GPU, each against the plain
autograd head (``tests/support/reference``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from iqn_interpreter import CASES, FEATURE_CASES, RESULTS
from storage_log import StorageLog
from support.reference.nets import iqn_head
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interpreter import run_under_interpreter

from fitdqn.config import Config, ConfigError, with_overrides
from fitdqn.memory.trace import measure_step_memory, trace_step_memory
from fitdqn.nets.iqn import IQNHead
from fitdqn.ops import kernels
from fitdqn.ops.iqn import CHUNK, tile_geometry

D_MODEL, EMBEDDING, OUTPUTS = 256, 64, 15
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def head_and_grads(head: IQNHead, features, taus, upstream, reference: bool = False):
    """Output and gradients (features, embed w/b, out w/b) of ``(head(...) * upstream).sum()``."""
    features = features.detach().requires_grad_()
    out = iqn_head(head, features, taus) if reference else head(features, taus)
    return [out.detach(), *torch.autograd.grad((out * upstream).sum(), [features, *head.parameters()])]


# ------------------------------------------------------------------------------- the operator on the CPU

@pytest.mark.parametrize("batch, quantiles", [(1, 64), (5, 32), (3, 100), (19, 8)])
def test_operator_on_the_cpu_matches_the_reference(batch, quantiles):
    torch.manual_seed(0)
    head = IQNHead(16, 8, OUTPUTS).double()
    features, taus = torch.randn(batch, 16, dtype=torch.float64), torch.rand(batch, quantiles, dtype=torch.float64)
    upstream = torch.randn(batch, quantiles, OUTPUTS, dtype=torch.float64)
    fused = head_and_grads(head, features, taus, upstream)
    reference = head_and_grads(head, features, taus, upstream, reference=True)
    for name, got, expected in zip(RESULTS, fused, reference, strict=True):
        torch.testing.assert_close(got, expected, msg=name)


def test_operators_pass_opcheck():
    torch.manual_seed(0)
    head = IQNHead(16, 8, OUTPUTS)
    features, taus = torch.randn(5, 16, requires_grad=True), torch.rand(5, 12)
    params = (head.frequencies, head.embed.weight, head.embed.bias, head.out.weight, head.out.bias)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.fitdqn.iqn_quantile_head.default, (features, taus, *params, torch.float32),
                          test_utils=checks)
    grad_out = torch.randn(5, 12, OUTPUTS)
    torch.library.opcheck(torch.ops.fitdqn.iqn_quantile_head_backward.default,
                          (grad_out, features.detach(), taus, *params[:4], torch.float32), test_utils=checks)


# ---------------------------------------------------------------- the fake kernels: what the planner sees

def fake_step_log(batch: int, quantiles: int) -> StorageLog:
    """Forward + backward of the full-size head on fake CPU tensors under bf16 autocast, as the planner
    traces a CUDA target."""
    log = StorageLog()
    with FakeTensorMode():
        head = IQNHead(D_MODEL, EMBEDDING, OUTPUTS)
        features = torch.randn(batch, D_MODEL, requires_grad=True)
        taus, upstream = torch.rand(batch, quantiles), torch.randn(batch, quantiles, OUTPUTS)
        with log:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = head(features, taus)
            (out * upstream).sum().backward()
    return log


def test_fake_kernels_allocate_what_the_triton_kernels_return():
    batch, quantiles = 4096, 64
    programs = tile_geometry(batch, quantiles).programs
    log = fake_step_log(batch, quantiles)
    ops = {op: [(shape, dtype) for name, shape, dtype, _ in log.outputs if name == op]
           for op in ("fitdqn.iqn_quantile_head.default", "fitdqn.iqn_quantile_head_backward.default")}
    assert ops["fitdqn.iqn_quantile_head.default"] == [((batch, quantiles, OUTPUTS), torch.float32)]
    assert ops["fitdqn.iqn_quantile_head_backward.default"] == [
        ((batch, D_MODEL), torch.float32), ((programs, D_MODEL, EMBEDDING), torch.float32),
        ((programs, OUTPUTS, D_MODEL), torch.float32), ((programs, OUTPUTS), torch.float32)]
    assert programs == 128


@pytest.mark.parametrize("features_dtype", [torch.bfloat16, torch.float32])
def test_grad_features_come_back_in_the_features_dtype(features_dtype):
    """bf16 features (the fused attention's under autocast): the backward op itself returns their gradient in bf16,
    on the CPU and in the fake kernel (the Triton launcher: ``iqn_interpreter.FEATURE_CASES``)."""
    torch.manual_seed(0)
    head = IQNHead(16, 8, OUTPUTS)
    features, taus, upstream = torch.randn(5, 16).to(features_dtype), torch.rand(5, 12), torch.randn(5, 12, OUTPUTS)
    args = (features, taus, head.frequencies, head.embed.weight, head.embed.bias, head.out.weight, torch.bfloat16)
    real = torch.ops.fitdqn.iqn_quantile_head_backward(upstream, *args)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.fitdqn.iqn_quantile_head_backward(upstream, *args)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    assert real[0].dtype == features_dtype and real[1].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grad = head_and_grads(head, features, taus, upstream)[1]
    assert grad.dtype == features_dtype


def test_nothing_batch_by_quantiles_by_width_is_allocated():
    batch, quantiles = 4096, 64
    output_bytes = batch * quantiles * OUTPUTS * 4  # [B, N, O] fp32: the largest thing the head makes
    assert max(nbytes for *_, nbytes in fake_step_log(batch, quantiles).outputs) == output_bytes
    # the CPU kernels' [B, chunk, d] transients are theirs alone: a CUDA card runs the Triton kernels
    assert CHUNK * D_MODEL * 2 > OUTPUTS * 4


# ------------------------------------------------------------------------------ where the Triton kernels run

def test_triton_runs_where_it_is_installed_and_not_switched_off(monkeypatch):
    monkeypatch.setattr(kernels, "_triton_installed", lambda: True)
    bf16, fp64 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)
    monkeypatch.delenv(kernels.TRITON_SWITCH, raising=False)
    assert kernels.runs_triton(bf16) and not kernels.runs_triton(fp64)  # fp64: the CPU maths on the GPU
    assert not kernels.runs_triton(bf16, dtypes=(torch.float64,))
    monkeypatch.setenv(kernels.TRITON_SWITCH, "0")  # the debugging switch: the CPU maths everywhere
    assert not kernels.triton_available() and not kernels.runs_triton(bf16)
    monkeypatch.setenv(kernels.TRITON_SWITCH, "1")
    assert kernels.runs_triton(bf16)
    monkeypatch.setattr(kernels, "_triton_installed", lambda: False)  # no triton package: the CPU maths
    assert not kernels.runs_triton(bf16)


def test_the_kernel_knobs_are_gone_with_one_error_each():
    for key in ("net.kernels", "net.iqn_chunk", "net.iqn_kernel"):
        with pytest.raises(ConfigError, match=f"config key '{key}' was removed: .*delete it from the config"):
            with_overrides(Config(), {key: "torch" if key != "net.iqn_chunk" else 8})


# -------------------------------------------------------------------- Triton kernels under the interpreter

TOLERANCES = {  # max |fused - reference| / max |reference| against the fp32 reference, per result
    "float32": dict.fromkeys(RESULTS, 5e-6),
    # bf16 / fp16 inputs: the embedding gradient sums bf16 cosines over few rows, with ReLU flips; the
    # chunked path's errors are the same there (and larger elsewhere)
    "bfloat16": {**dict.fromkeys(RESULTS, 1.5e-2), "grad_embed_w": 0.15, "grad_embed_b": 0.15, "grad_out_b": 1e-5},
    "float16": {**dict.fromkeys(RESULTS, 3e-3), "grad_embed_w": 0.1, "grad_embed_b": 0.1, "grad_out_b": 1e-5},
}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("iqn_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernels_under_the_interpreter_match_the_reference(interpreted, case):
    name, batch, quantiles, _, _, _, dtype, _ = case
    result = interpreted[name]
    assert result["shapes"][0] == [batch, quantiles, OUTPUTS] and result["dtypes"][0] == "torch.float32"
    for key, tolerance in TOLERANCES[dtype].items():
        fused, chunked = result["fused"][key], result["chunked"][key]
        assert fused <= tolerance, (key, fused, chunked)
        assert fused <= 1.25 * chunked + 1e-6 or dtype == "float32", (key, fused, chunked)  # no worse than today


@pytest.mark.parametrize("case", FEATURE_CASES, ids=[case[0] for case in FEATURE_CASES])
def test_triton_kernels_under_the_interpreter_take_bf16_features(interpreted, case):
    result = interpreted[case[0]]
    # the backward op writes the gradient in the features' dtype itself (no fp32 [B, d] and no cast kernel after)
    assert result["op_grad_features_dtype"] == result["grad_features_dtype"] == "torch.bfloat16"
    for key, tolerance in TOLERANCES["bfloat16"].items():
        fused, chunked = result["fused"][key], result["chunked"][key]
        assert fused <= tolerance, (key, fused, chunked)
        assert fused <= 1.25 * chunked + 1e-6, (key, fused, chunked)  # no worse than today


# ----------------------------------------------------------------------------------------------- on a GPU

@cuda
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, quantiles", [(1, 64), (37, 32), (1000, 100), (8192, 64), (4096, 32)])
def test_fused_head_on_cuda_matches_the_chunked_head_and_the_reference(batch, quantiles, precision):
    torch.manual_seed(0)
    device = torch.device("cuda")
    with device:
        head = IQNHead(D_MODEL, EMBEDDING, OUTPUTS)
        features, taus = torch.randn(batch, D_MODEL), torch.rand(batch, quantiles)
        upstream = torch.randn(batch, quantiles, OUTPUTS)
    with torch.autocast("cuda", dtype=precision, enabled=precision != torch.float32):
        fused = head_and_grads(head, features, taus, upstream)
        with pytest.MonkeyPatch.context() as patch:  # the CPU kernels' chunked maths on the GPU
            patch.setenv(kernels.TRITON_SWITCH, "0")
            chunked = head_and_grads(head, features, taus, upstream)
    reference = head_and_grads(head, features, taus, upstream, reference=True)  # fp32
    # errors as norms, relative: over up to 134M pre-activations a few ReLUs flip between any two fp32 paths
    # (other summation orders, cosine implementations), each moving one row of a weight gradient. In bf16 the
    # embedding gradient of a small batch is that coarse for the chunked head too (0.036 at B = 37, N = 32 on an
    # H200, both heads): the absolute bound is loose there and "no worse than today" is the real check. In fp32
    # the chunked head runs the reference's own kernels (cuBLAS, torch.cos) and agrees to 5e-7; the fused kernel
    # sums in another order, and the ReLUs of pre-activations within ~1e-6 of zero flip: 2-3e-4 on the embedding
    # gradient at B >= 1000 on an H200, so fp32 is held to an absolute bound only
    limit = 1e-3 if precision == torch.float32 else 0.1
    for key, got, today, expected in zip(RESULTS, fused, chunked, reference, strict=True):
        scale = expected.norm()
        error, today_error = (got - expected).norm() / scale, (today - expected).norm() / scale
        assert error <= limit, (key, error, today_error)
        if precision != torch.float32:
            assert error <= 1.25 * today_error + 1e-5, (key, error, today_error)  # no worse than today


@cuda
def test_fused_kernels_pass_opcheck_on_cuda():
    torch.manual_seed(0)
    with torch.device("cuda"):
        head = IQNHead(D_MODEL, EMBEDDING, OUTPUTS)
        features, taus, grad_out = torch.randn(70, D_MODEL), torch.rand(70, 32), torch.randn(70, 32, OUTPUTS)
    params = (head.frequencies, head.embed.weight, head.embed.bias, head.out.weight, head.out.bias)
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.fitdqn.iqn_quantile_head.default, (features, taus, *params, dtype),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(torch.ops.fitdqn.iqn_quantile_head_backward.default,
                              (grad_out, features, taus, *params[:4], dtype),
                              test_utils=("test_schema", "test_faketensor"))


@cuda
@pytest.mark.parametrize("batch", [1024, 8192])
def test_fused_head_on_cuda_allocates_what_the_trace_counts(batch):
    def make_step(batch_size: int, device: torch.device):
        with device:
            head = IQNHead(D_MODEL, EMBEDDING, OUTPUTS)
            features = torch.randn(batch_size, D_MODEL, requires_grad=True)
            taus, upstream = torch.rand(batch_size, 64), torch.randn(batch_size, 64, OUTPUTS)

        def step():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = head(features, taus)
            (out * upstream).sum().backward()

        return step

    traced = trace_step_memory(make_step, batch, "cuda")
    measured = measure_step_memory(make_step, batch, "cuda")
    slack = (1 << 20) * (traced.large_blocks_at_peak + 1)  # a large block may be rounded up by 1 MiB
    assert abs(measured - traced.step_bytes) <= slack, (measured, traced.step_bytes)
