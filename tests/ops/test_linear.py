"""``fitdqn.ops.linear``: the layer with its bias gradient as a matrix-vector product gives ``F.linear``'s values
and gradients (fp32 and under bf16 autocast), and the planner's trace of it holds no reduction staging."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitdqn.memory.kernel_scratch import CudaShape, reduction_staging_bytes
from fitdqn.memory.live_bytes import round_block
from fitdqn.memory.trace import trace_step_memory
from fitdqn.ops.linear import MATRIX_VECTOR_MIN_COLUMNS, column_sum, linear

# rows x out_features on either side of the width from which the bias gradient is a matrix-vector product
SMALL, LARGE = (33, MATRIX_VECTOR_MIN_COLUMNS - 1), (33, MATRIX_VECTOR_MIN_COLUMNS)


def _results(fn, shape, autocast_dtype, leading=()):
    rows, out_features = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*leading, rows, 24, generator=generator, requires_grad=True)
    weight = (torch.randn(out_features, 24, generator=generator) / 24**0.5).requires_grad_()
    bias = torch.randn(out_features, generator=generator).requires_grad_()
    upstream = torch.randn(*leading, rows, out_features, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_dtype is not None):
        out = fn(x, weight, bias)
    out.float().mul(upstream).sum().backward()
    return out.detach(), x.grad, weight.grad, bias.grad


@pytest.mark.parametrize("shape", [SMALL, LARGE])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_values_and_gradients_equal_the_plain_layer(shape, autocast_dtype):
    ours = _results(linear, shape, autocast_dtype)
    plain = _results(F.linear, shape, autocast_dtype)
    for name, got, expected in zip(("out", "grad_x", "grad_w", "grad_b"), ours, plain, strict=True):
        assert got.dtype == expected.dtype, name
        if name == "grad_b" and autocast_dtype is not None and shape == SMALL:
            continue  # a narrow bias gradient is summed into fp32 directly: below
        # the bias gradient's summation order differs (a product against ones): fp32 rounding only
        torch.testing.assert_close(got, expected, msg=name, rtol=1e-5, atol=1e-4)


def test_a_narrow_bias_gradient_under_autocast_is_the_fp32_sum_not_its_bf16_rounding():
    """Autograd's layer rounds the bf16 column sum to bf16 before the fp32 gradient; ours writes the fp32
    accumulator: within bf16 rounding of autograd's and at fp32 rounding of the exact sum."""
    ours, plain = (_results(fn, SMALL, torch.bfloat16)[3] for fn in (linear, F.linear))
    generator = torch.Generator().manual_seed(0)  # _results' draws again: the upstream gradient
    for shape in ((SMALL[0], 24), (SMALL[1], 24), (SMALL[1],)):
        torch.randn(*shape, generator=generator)
    upstream = torch.randn(*SMALL, generator=generator)
    exact = upstream.bfloat16().double().sum(0)  # what reaches the layer: the bf16 output's gradient
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, plain, rtol=1e-2, atol=1e-2)
    assert (ours.double() - exact).abs().max() < (plain.double() - exact).abs().max()


def test_a_three_dimensional_input_is_the_plain_layer_on_its_rows():
    ours = _results(linear, SMALL, None, leading=(3,))
    plain = _results(F.linear, SMALL, None, leading=(3,))
    assert ours[0].shape == (3, *SMALL)
    for got, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_without_autograd_it_is_f_linear():
    x, weight, bias = torch.randn(5, 4), torch.randn(3, 4), torch.randn(3)
    with torch.no_grad():
        out = linear(x, weight.requires_grad_(), bias)
    assert out.grad_fn is None and torch.equal(out, F.linear(x, weight, bias))


def test_column_sum_is_the_sum_over_rows_either_way():
    for rows, columns in (SMALL, LARGE):
        grad = torch.randn(rows, columns, dtype=torch.float64)
        torch.testing.assert_close(column_sum(grad), grad.sum(0))


def _layer_step(fn, out_features):
    """``make_step`` for the tracer: one layer's forward and backward at ``batch`` rows (fp32)."""
    def build(batch: int, device: torch.device):
        x = torch.empty(batch, 64, device=device, requires_grad=True)
        weight = torch.empty(out_features, 64, device=device, requires_grad=True)
        bias = torch.empty(out_features, device=device, requires_grad=True)

        def step() -> None:
            out = fn(x, weight, bias)
            torch.autograd.grad(out, (x, weight, bias), torch.ones_like(out))

        return step

    return build


def test_the_planners_trace_of_a_cuda_step_holds_no_reduction_staging():
    """Traced for a CUDA card, autograd's layer holds the modelled staging of its bias gradient's reduction at the
    step's peak; ours holds none, and its step is smaller by that staging less its ones vector."""
    batch, out_features, card = 8192, 768, CudaShape(sm_count=132)
    ours = trace_step_memory(_layer_step(linear, out_features), batch, "cuda", cuda_shape=card)
    plain = trace_step_memory(_layer_step(F.linear, out_features), batch, "cuda", cuda_shape=card)
    staging = reduction_staging_bytes(batch, out_features, 4, card)
    assert staging > 0 and plain.scratch_at_peak == staging and ours.scratch_at_peak == 0
    ones = torch.empty(batch)
    assert plain.step_bytes - ours.step_bytes == round_block(staging) - round_block(ones.numel() * ones.element_size())
