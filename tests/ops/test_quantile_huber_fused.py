"""The quantile Huber operator: its Triton kernel (interpreted on the CPU, and on a GPU when there is one), its
CPU kernel and its fake kernel all agree with ``quantile_huber_loss``'s closed form."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fitdqn.learn.losses import quantile_huber_loss
from fitdqn.ops.quantile_huber import quantile_huber_sorted

SRC = Path(__file__).resolve().parents[2] / "src"
SHAPES = [(5, 64, 64, 3, 1.0), (3, 32, 64, 3, 0.5), (4, 7, 9, 2, 2.0), (2, 8, 8, 1, 1.0)]


def inputs(batch, n, m, columns, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    pred = torch.randn(batch, n, columns, generator=generator) * 2
    target = torch.randn(batch, m, columns, generator=generator) * 2
    target[:, :2] = pred[:, :2]  # pairs with u = 0 exactly
    taus = torch.rand(batch, n, generator=generator)
    return pred.to(device), target.to(device), taus.to(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled kernel is tested below")
def test_triton_kernel_in_the_interpreter_matches_the_closed_form():
    pytest.importorskip("triton")
    script = textwrap.dedent(f"""
        import torch
        from fitdqn.ops.quantile_huber import quantile_huber_sorted
        from fitdqn.ops.quantile_huber_triton import fused_quantile_huber
        worst = 0.0
        for batch, n, m, columns, kappa in {SHAPES!r}:
            g = torch.Generator().manual_seed(batch)
            pred = torch.randn(batch, n, columns, generator=g) * 2
            target = torch.randn(batch, m, columns, generator=g) * 2
            target[:, :2] = pred[:, :2]
            taus = torch.rand(batch, n, generator=g)
            loss, grad = fused_quantile_huber(pred, target, taus, kappa)
            ref_loss, ref_grad = quantile_huber_sorted(pred, target, taus, kappa)
            assert loss.shape == ref_loss.shape and grad.shape == ref_grad.shape
            worst = max(worst, ((loss - ref_loss).abs() / (1 + ref_loss.abs())).max().item(),
                        (grad - ref_grad).abs().max().item())
        print(worst)
    """)
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))  # SRC first, then any triton
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-5


@pytest.mark.parametrize("batch, n, m, columns, kappa", SHAPES)
def test_loss_on_cpu_is_the_closed_form_with_its_gradient(batch, n, m, columns, kappa):
    pred, target, taus = inputs(batch, n, m, columns)
    pred = pred.requires_grad_()
    loss = quantile_huber_loss(pred, target, taus, kappa)
    closed_loss, closed_grad = quantile_huber_sorted(pred.detach(), target, taus, kappa)
    assert torch.equal(loss, closed_loss)
    weights = torch.rand(batch)
    (weights * loss).sum().backward()
    assert torch.equal(pred.grad, closed_grad * weights.view(-1, 1, 1))


def test_fake_kernel_allocates_only_the_loss_and_the_gradient():
    with FakeTensorMode():
        pred, target, taus = torch.empty(16, 64, 3), torch.empty(16, 64, 3), torch.empty(16, 64)
        loss, grad = torch.ops.fitdqn.quantile_huber(pred, target, taus, 1.0)
        assert loss.shape == (16,) and grad.shape == (16, 64, 3)
        assert loss.dtype == grad.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch, n, m, columns, kappa", SHAPES + [(8192, 64, 64, 3, 1.0)])
def test_triton_kernel_on_cuda_matches_the_closed_form(batch, n, m, columns, kappa):
    pred, target, taus = inputs(batch, n, m, columns, device="cuda")
    loss, grad = torch.ops.fitdqn.quantile_huber(pred, target, taus, kappa)
    ref_loss, ref_grad = quantile_huber_sorted(pred, target, taus, kappa)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
