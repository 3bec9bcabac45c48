"""The quantile Huber loss as one PyTorch operator, ``fitdqn::quantile_huber``: loss ``[B]`` and d loss / d pred.

``quantile_huber(pred [B, N, ...], target [B, N', ...], taus [B, N], kappa) -> (loss [B], grad [B, N, ...])``,
the maths of :func:`fitdqn.learn.losses.quantile_huber_loss`. Kernels: on CUDA the pairwise Triton kernel of
:mod:`fitdqn.learn.quantile_huber_triton` (nothing but the two results is written); everywhere else the sorted
closed form (:func:`fitdqn.learn.losses._quantile_huber_sorted`).

Why an operator: the memory planner traces the update on fake tensors, often fake *CPU* tensors standing in for
CUDA ones. The closed form's float64 temporaries (about 10 of ``[B, C, N]``) would be traced where the GPU
allocates only the two results; the fake kernel allocates exactly those, so a CUDA target's trace sees the GPU's
bytes. ``quantile_huber_loss(..., fused=True)`` calls it; the learner asks for it when it trains on CUDA.
"""

from __future__ import annotations

import torch

from fitdqn.nets.iqn_op import FUSED_DTYPES  # the dtypes the Triton kernels take
from fitdqn.nets.kernels import triton_module


@torch.library.custom_op("fitdqn::quantile_huber", mutates_args=())
def quantile_huber(pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss ``[B]`` and its gradient w.r.t. pred; the default (CPU) kernel is the closed form."""
    from fitdqn.learn.losses import _quantile_huber_sorted

    return _quantile_huber_sorted(pred, target, taus, kappa)


@quantile_huber.register_kernel("cuda")
def _quantile_huber_cuda(pred, target, taus, kappa):
    if pred.dtype not in FUSED_DTYPES or target.dtype not in FUSED_DTYPES:
        from fitdqn.learn.losses import _quantile_huber_sorted

        return _quantile_huber_sorted(pred, target, taus, kappa)
    return triton_module("fitdqn.learn.quantile_huber_triton").fused_quantile_huber(pred, target, taus, kappa)


@quantile_huber.register_fake
def _quantile_huber_fake(pred, target, taus, kappa):
    return pred.new_empty(pred.shape[:1]), pred.new_empty(pred.shape)
