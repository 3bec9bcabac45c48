"""``fitdqn::c51_means``: the C51 means as one operator. Its CPU kernel is the torch form bit for bit, its fake
kernel allocates the result, the Q network takes it without a gradient (the torch form where one is wanted), and
its Triton kernel (under Triton's interpreter, and compiled on a GPU) agrees with the float64 reference within fp32
rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from c51_means_interpreter import CASES, logits_for, reference
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interpreter import run_under_interpreter

from fitdqn.config import Config, for_device
from fitdqn.nets.qnet import QNetwork
from fitdqn.ops import c51_means
from fitdqn.ops.c51_means import expected_values

TOLERANCE = 2e-5  # of a mean on a [-10, 10] support: a few fp32 ulp


@pytest.mark.parametrize(("name", "shape", "dtype", "scale"), CASES)
def test_the_cpu_kernel_is_the_torch_form(name, shape, dtype, scale):
    logits = logits_for(shape, dtype, scale)
    support = torch.linspace(-10.0, 10.0, shape[-1])
    out = c51_means(logits, support)
    assert out.shape == shape[:-1] and out.dtype == torch.float32
    assert torch.equal(out, expected_values(logits, support))
    if out.numel():
        torch.testing.assert_close(out.double(), reference(logits, support), rtol=0, atol=TOLERANCE)


def test_the_fake_kernel_allocates_the_result_and_bad_shapes_are_refused():
    with FakeTensorMode():
        out = c51_means(torch.empty(8, 3, 5, 51, dtype=torch.bfloat16), torch.empty(51))
        assert out.shape == (8, 3, 5) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="logits"):
        c51_means(torch.zeros(4, 51), torch.zeros(50))


def test_the_q_network_takes_the_operator_without_a_gradient_and_the_torch_form_for_one():
    torch.manual_seed(0)
    net = for_device(Config(), "cpu").net
    network = QNetwork(net, 12)
    logits = torch.randn(6, len(net.branches), max(net.branches), net.num_atoms)
    with torch.no_grad(), CensusOf("fitdqn.c51_means.default") as census:
        assert torch.equal(network.q_values(logits), expected_values(logits, network.support))
    assert census.calls == 1
    wanted = logits.clone().requires_grad_()
    q = network.q_values(wanted)
    assert q.grad_fn is not None  # the torch form: differentiable
    q.sum().backward()
    assert wanted.grad is not None and torch.isfinite(wanted.grad).all()


# -------------------------------------------------------------------- Triton kernel under the interpreter

@pytest.fixture(scope="module")
def interpreted():
    return run_under_interpreter(Path(__file__).with_name("c51_means_interpreter.py"))


@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_triton_kernel_under_the_interpreter_matches_the_reference(interpreted, case):
    errors = interpreted[case]
    assert errors["reference"] <= TOLERANCE, errors
    assert errors["torch"] <= TOLERANCE, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("name", "shape", "dtype", "scale"), CASES)
def test_triton_kernel_on_cuda_matches_the_reference(name, shape, dtype, scale):
    pytest.importorskip("triton")
    logits = logits_for(shape, dtype, scale)
    support = torch.linspace(-10.0, 10.0, shape[-1])
    out = c51_means(logits.cuda(), support.cuda())
    assert out.shape == shape[:-1] and out.dtype == torch.float32
    if out.numel():
        torch.testing.assert_close(out.double().cpu(), reference(logits, support), rtol=0, atol=TOLERANCE)


class CensusOf(TorchDispatchMode):
    """How many times ``name`` runs inside."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.calls = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += str(func) == self.name
        return func(*args, **(kwargs or {}))
