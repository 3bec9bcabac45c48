"""``gather_in_place_grad``: ATen's gather values and gradients, and a trace on the planner's fake tensors without
the out-of-place copy ATen's backward makes for tensor subclasses."""

import torch

from fitdqn.memory.live_bytes import round_block
from fitdqn.memory.trace import trace_step_memory
from fitdqn.ops.gather import gather_in_place_grad


def _case(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(6, 3, 5, 7, generator=generator).to(dtype).requires_grad_()
    action = torch.randint(0, 5, (6, 3), generator=generator)
    index = action.unsqueeze(-1).unsqueeze(-1).expand(-1, -1, 1, 7)  # [B, br, 1, A]
    return source, index


def test_values_and_gradient_equal_aten_gather():
    for dtype in (torch.float32, torch.bfloat16):
        source, index = _case(dtype)
        upstream = torch.randn(6, 3, 1, 7).to(dtype)
        ours = gather_in_place_grad(source, 2, index)
        (grad_ours,) = torch.autograd.grad(ours, source, upstream)
        reference = source.gather(2, index)
        (grad_reference,) = torch.autograd.grad(reference, source, upstream)
        assert torch.equal(ours, reference)
        assert torch.equal(grad_ours, grad_reference)
        assert grad_ours.dtype == dtype


def test_repeated_index_accumulates():
    source = torch.arange(4.0).requires_grad_()
    index = torch.tensor([1, 1, 3])
    gather_in_place_grad(source, 0, index).sum().backward()
    assert source.grad.tolist() == [0.0, 2.0, 0.0, 1.0]


def test_without_grad_is_plain_gather():
    source, index = _case()
    with torch.no_grad():
        out = gather_in_place_grad(source, 2, index)
    assert out.grad_fn is None and torch.equal(out, source.detach().gather(2, index))


def _gather_step(take):
    """``make_step`` for the tracer: the gather of one action's atoms and its backward."""
    def build(batch: int, device: torch.device):
        source = torch.empty(batch, 3, 5, 51, device=device, requires_grad=True)  # [B, br, n, A]
        index = torch.zeros(batch, 3, 1, 51, dtype=torch.long, device=device)  # [B, br, 1, A]

        def step() -> None:
            out = take(source, index)
            torch.autograd.grad(out, source, torch.ones_like(out))

        return step

    return build


def test_the_planners_trace_holds_one_source_sized_tensor_less():
    """On the tracer's fake tensors ATen's backward holds its zeros and a second, out-of-place result at once; ours
    the zeros only: the traced step is one source tensor (block-rounded) smaller, as a GPU run of either is."""
    ours = trace_step_memory(_gather_step(lambda s, i: gather_in_place_grad(s, 2, i)), 64, "cpu")
    aten = trace_step_memory(_gather_step(lambda s, i: s.gather(2, i)), 64, "cpu")
    source = torch.empty(64, 3, 5, 51)
    assert aten.step_bytes - ours.step_bytes == round_block(source.numel() * source.element_size())
