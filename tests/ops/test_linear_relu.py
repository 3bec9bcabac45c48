"""``fitdqn.ops.linear_relu``: the ReLU in the product's epilogue gives the unfused layer's values, gradients and
saved bytes (fp32 and under bf16 autocast), and the trunk equals the plain one (``tests/support/reference``)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from storage_log import StorageLog
from support.reference.nets import trunk as reference_trunk
from torch._subclasses.fake_tensor import FakeTensorMode

from fitdqn.nets.trunk import TokenMLP
from fitdqn.ops.linear_relu import linear_relu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def layer(in_features=24, out_features=40, rows=33, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator) * 0.5
    return x.to(device), weight.to(device), bias.to(device)


def results(fn, x, weight, bias, upstream, autocast_dtype=None, x_grad=True):
    x, weight, bias = (t.detach().clone().requires_grad_(grad) for t, grad in ((x, x_grad), (weight, True),
                                                                                (bias, True)))
    with torch.autocast(x.device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = fn(x, weight, bias)
    out.float().mul(upstream).sum().backward()  # through both nodes
    return out.detach(), x.grad, weight.grad, bias.grad


def plain(x, weight, bias):
    return F.relu(F.linear(x, weight, bias), inplace=True)


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("x_grad", [True, False])
def test_values_and_gradients_equal_the_unfused_layer(autocast_dtype, x_grad):
    x, weight, bias = layer()
    upstream = torch.randn(33, 40)
    fused = results(linear_relu, x, weight, bias, upstream, autocast_dtype, x_grad)
    reference = results(plain, x, weight, bias, upstream, autocast_dtype, x_grad)
    assert (fused[0] == 0).any() and (fused[0] > 0).any()  # the ReLU cuts somewhere
    for name, got, expected in zip(("out", "grad_x", "grad_w", "grad_b"), fused, reference, strict=True):
        if expected is None:
            assert got is None, name
            continue
        assert got.dtype == expected.dtype, name
        if name == "grad_b" and autocast_dtype is not None:  # 40 columns: summed into fp32, not rounded to bf16
            torch.testing.assert_close(got, expected, msg=name, rtol=1e-2, atol=1e-2)
            continue  # (tests/ops/test_linear.py checks it against the exact sum)
        torch.testing.assert_close(got, expected, msg=name)  # fp32: exact ops; bf16: the same roundings


def test_without_autograd_it_is_the_layer():
    x, weight, bias = layer()
    with torch.no_grad():
        torch.testing.assert_close(linear_relu(x, weight, bias), plain(x, weight, bias), rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, expected = linear_relu(x, weight, bias), plain(x, weight, bias)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def storage_bytes(fused: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The batch-sized ([B * W, ...]) storages a forward + backward of the trunk allocates on fake tensors under
    bf16 autocast."""
    log = StorageLog()
    with FakeTensorMode():
        trunk = TokenMLP(80, 512, 256)
        obs = torch.randn(16, 8, 80)
        with log:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = trunk(obs) if fused else reference_trunk(trunk, obs)
            out.float().sum().backward()
    aliases = ("view", "detach", "t.default", "expand", "relu_")  # no new storage
    return sorted(((shape, dtype) for op, shape, dtype, _ in log.outputs
                   if shape[:1] == (128,) and not any(name in op for name in aliases)), key=str)


def test_fused_trunk_allocates_what_the_unfused_one_does():
    """The batch-sized activations and gradients are the same in number, shape and dtype; the fused trunk adds
    one ``[B * W]`` vector of ones per layer, the matrix-vector product's that takes its bias gradient
    (``fitdqn.ops.linear.column_sum``), where the plain one's reduction stages partial sums on a GPU instead."""
    fused, plain = storage_bytes(True), storage_bytes(False)
    matrices = lambda storages: [s for s in storages if len(s[0]) == 2]  # noqa: E731
    assert matrices(fused) == matrices(plain)
    assert ((128, 512), torch.bfloat16) in fused
    assert [s for s in fused if len(s[0]) == 1] == [((128,), torch.bfloat16)] * 2
    assert not [s for s in plain if len(s[0]) == 1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_trunk_equals_the_plain_trunk(device):
    torch.manual_seed(0)
    trunk = TokenMLP(20, 48, 32).to(device)
    obs = torch.randn(6, 5, 20, device=device)
    dtype = torch.bfloat16 if device == "cuda" else None
    outs = []
    for forward in (functools.partial(reference_trunk, trunk), trunk):
        trunk.zero_grad()
        with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = forward(obs)
        out.float().square().sum().backward()
        outs.append([out.detach().float(), *(p.grad for p in trunk.parameters())])
    for got, expected in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-2 if dtype else 1e-5, atol=2e-2 if dtype else 1e-6)
