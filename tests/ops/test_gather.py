"""``gather_in_place_grad``: ATen's gather values and gradients, and a trace on fake tensors without the
out-of-place copy ATen's backward makes for tensor subclasses."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

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


def test_fake_backward_allocates_one_source_sized_tensor():
    """ATen's backward on fake tensors makes the zeros and a second, out-of-place result; ours the zeros only."""
    def backward_bytes(take) -> int:
        with FakeTensorMode():
            source = torch.empty(64, 3, 5, 51, requires_grad=True)
            index = torch.zeros(64, 3, 1, 51, dtype=torch.long)
            out = take(source, index)
            grad = torch.empty_like(out)
            allocated = []
            from torch.utils._python_dispatch import TorchDispatchMode

            class Count(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    result = func(*args, **(kwargs or {}))
                    if func._schema.name in ("aten::new_zeros", "aten::zeros", "aten::scatter_add"):
                        allocated.append(result.numel() * result.element_size())
                    return result

            with Count():
                torch.autograd.grad(out, source, grad)
        return sum(allocated)

    source_bytes = 64 * 3 * 5 * 51 * 4
    assert backward_bytes(lambda s, i: gather_in_place_grad(s, 2, i)) == source_bytes
    assert backward_bytes(lambda s, i: s.gather(2, i)) == 2 * source_bytes
