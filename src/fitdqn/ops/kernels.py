"""Which kernels the fused operators run: ``net.kernels``, resolved for the device they will run on, and the lazy
import of their Triton modules.

``'triton'``: the fused operators of :mod:`fitdqn.ops`, each a PyTorch custom op with Triton kernels on CUDA and
plain maths elsewhere: the IQN head (``fitdqn::iqn_quantile_head``), the attention core
(``fitdqn::last_token_attention``) and its residual add + LayerNorm (``fitdqn::residual_layer_norm``), the quantile
Huber loss (``fitdqn::quantile_huber``), C51's expected values (``fitdqn::c51_means``) and projection
(``fitdqn::categorical_projection``), the C51 head's fold (``fitdqn::folded_output``) and the update's weighted
loss (``fitdqn::weighted_losses``). ``'torch'``: plain PyTorch ops: the chunked IQN head, the elementwise attention
with ``nn.LayerNorm``, the closed-form loss, the means as softmax, product and sum, the dense projection, the fold
as ``FoldedOutput`` and the weighted loss's torch lines. ``'auto'``: Triton for a CUDA device where Triton is
installed, else torch.

Triton is optional (it ships with PyTorch's Linux CUDA wheels, not with the CPU ones): every ``*_triton`` module
of this package imports it at its top, and is itself imported only on first use, by :func:`triton_module`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from types import ModuleType

import torch

from fitdqn.errors import UserError

KERNELS = ("auto", "triton", "torch")
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the dtypes the Triton kernels take


def triton_dtypes(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels take these tensors' dtypes (:data:`FUSED_DTYPES`; else an operator runs its torch
    maths, on any device)."""
    return all(tensor.dtype in FUSED_DTYPES for tensor in tensors)


def next_power_of_2(size: int) -> int:
    """``size`` rounded up to a power of two (Triton's ``next_power_of_2``; 1 for 0): a tile axis, on the host."""
    return 1 << max(size - 1, 0).bit_length()


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it ships with PyTorch's Linux CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def triton_module(name: str) -> ModuleType:
    """The Triton kernels' module ``name``, imported on first use (Triton is only needed on CUDA)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
        raise RuntimeError("net.kernels = 'triton' on CUDA needs the triton package (pip install triton); "
                           "or set net.kernels = 'torch'") from error


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on the tensor's GPU (CPU tensors: the Triton interpreter, no device context)."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()


def resolve_kernels(kernels: str, device_type: str) -> str:
    """``net.kernels`` for networks that will run on ``device_type`` (the *planned* device: the planner resolves
    it for a CUDA target before tracing on fake CPU tensors) -> ``'triton'`` or ``'torch'``. 'auto' asks whether
    Triton is installed *here*, where planning and training normally run; an explicit 'triton' is kept (a plan
    needs only the operators' fake kernels; a CUDA run without Triton fails at the first call, saying so)."""
    if kernels == "auto":
        return "triton" if device_type == "cuda" and triton_available() else "torch"
    if kernels in KERNELS:
        return kernels
    raise UserError(f"net.kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")
