"""CUDA's autocast precision rules for a step traced on fake CPU tensors.

When a CUDA step is traced on fake CPU tensors (``trace.fake_device_for``), ``torch.autocast('cpu', bf16)``
stands in for ``torch.autocast('cuda', bf16)``. Both run matmuls and convolutions in bf16, but CUDA also
runs a list of ops in fp32 that CPU autocast leaves in bf16: layer/group norm, softmax and log-softmax,
exp/log/pow and friends, sums and norms (``aten/src/ATen/autocast_mode.cpp``, CUDA's ``fp32`` and
``fp32_set_opt_dtype`` lists). Their outputs, often saved for backward, are then twice as big on the GPU
(on the attention toy of the tests: LayerNorm's [B, W, 256] output, 16 KiB a sample at W = 32).

``CudaAutocastOnCpu`` is a ``TorchFunctionMode`` that, while CPU autocast is on, applies CUDA's rule to those
ops: 'fp32' ops get their low-precision floating inputs cast to fp32 (the copies CUDA makes too);
'set dtype' ops (sum, softmax, cumsum...) are called with ``dtype=torch.float32`` when none is given.
Ops outside both lists are left to CPU autocast, which agrees with CUDA's on the matmul family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

_LOW = (torch.bfloat16, torch.float16)

_FP32 = {
    F.layer_norm, torch.layer_norm, F.group_norm, torch.group_norm, F.softplus,
    torch.exp, torch.Tensor.exp, torch.expm1, torch.Tensor.expm1,
    torch.log, torch.Tensor.log, torch.log1p, torch.Tensor.log1p, torch.log2, torch.Tensor.log2,
    torch.log10, torch.Tensor.log10, torch.rsqrt, torch.Tensor.rsqrt,
    torch.reciprocal, torch.Tensor.reciprocal, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__,
    torch.Tensor.__rpow__, torch.acos, torch.asin, torch.cosh, torch.sinh, torch.tan, torch.erfinv,
    torch.logsumexp, torch.Tensor.logsumexp, torch.dist, torch.cdist, F.cosine_similarity,
    torch.cosine_similarity, F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.mse_loss, F.nll_loss,
    F.binary_cross_entropy_with_logits,
}
_FP32_SET_DTYPE = {
    torch.sum, torch.Tensor.sum, torch.prod, torch.Tensor.prod, torch.cumsum, torch.Tensor.cumsum,
    torch.cumprod, torch.Tensor.cumprod, F.softmax, torch.softmax, torch.Tensor.softmax,
    F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, torch.linalg.vector_norm,
}


def _to_fp32(value):
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.float()
    return value


class CudaAutocastOnCpu(TorchFunctionMode):
    """While ``torch.autocast('cpu')`` is on, run CUDA autocast's fp32 ops in fp32 (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        if func in _FP32:
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        if func in _FP32_SET_DTYPE and kwargs.get("dtype") is None:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.dtype in _LOW:
                kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)
