"""C51's expected values: ``sum_j softmax(logits)_j z_j`` over the atoms, as one PyTorch operator,
``fitdqn::c51_means`` (a Triton kernel on CUDA: :mod:`fitdqn.ops.c51_means_triton`).

``c51_means(logits [..., A], support [A]) -> [...]`` fp32, logits of any floating dtype read as fp32:

    m = max_j logits_j      e_j = exp(logits_j - m)      mean = sum_j e_j z_j / sum_j e_j

The torch form (:func:`expected_values`, the CPU kernel, and :func:`q_means` where a gradient is wanted) is a
softmax, a product and a sum: on CUDA three kernels, each passing
over an fp32 ``[..., A]`` tensor. Where the update takes the online network's greedy actions for its targets that
tensor is ``[B, br, n, A]`` (25 MB at batch 8192, 3 x 5 sub-actions, 51 atoms), written by the softmax, read and
written by the product, read by the sum: about 110 MB of traffic for a 0.4 MB result. The kernel reads the logits
once (bf16: 12.5 MB) and writes the result. No autograd: the means choose actions and form targets, under
``torch.no_grad``; :func:`q_means` takes the torch form where a gradient is wanted.

Exactness: the kernel divides once, at the end (``sum e z / sum e``), where the torch form rounds each probability
first, and sums in another order: the two agree within fp32 rounding (a few ulp of the mean), not bit for bit, so
an argmax over sub-actions whose means tie to within that may pick another of them.
"""

from __future__ import annotations

import torch

from fitdqn.ops.kernels import triton_available, triton_module


def expected_values(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """``logits [..., A]``, ``support [A]`` -> ``[...]`` fp32: the mean of each C51 distribution (the torch form)."""
    return (torch.softmax(logits, dim=-1, dtype=torch.float32) * support).sum(-1)  # not a matmul: fp32


def check_shapes(logits: torch.Tensor, support: torch.Tensor) -> None:
    if logits.dim() < 1 or support.dim() != 1 or logits.shape[-1] != support.shape[0]:
        raise ValueError(f"c51_means takes logits [..., A] and support [A]; got logits {tuple(logits.shape)}, "
                         f"support {tuple(support.shape)}")


@torch.library.custom_op("fitdqn::c51_means", mutates_args=())
def c51_means(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """``[...]`` fp32: each distribution's mean on the support; the default (CPU) kernel is the torch form."""
    check_shapes(logits, support)
    return expected_values(logits, support)


@c51_means.register_kernel("cuda")
def _c51_means_cuda(logits, support):
    if not triton_available():
        check_shapes(logits, support)
        return expected_values(logits, support)
    return triton_module("fitdqn.ops.c51_means_triton").fused_means(logits, support)


@c51_means.register_fake
def _c51_means_fake(logits, support):
    check_shapes(logits, support)
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32)


def q_means(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """``logits [..., A]`` -> ``[...]`` fp32: the operator where no gradient is wanted (it has no autograd), else the
    torch form, whose autograd is ATen's."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return expected_values(logits, support)
    return c51_means(logits, support)
