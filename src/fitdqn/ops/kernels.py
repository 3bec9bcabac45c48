"""Where the operators' Triton kernels run, and their lazy import.

Every operator of :mod:`fitdqn.ops` has three kernels and chooses among them itself, by the tensors it is given:
its CPU kernel (the plain maths, on any device), its CUDA kernel (Triton, where :func:`runs_triton` says so, else
the CPU maths on the GPU) and its fake kernel (what the CUDA kernel allocates, which the memory planner traces on
fake tensors of any device). Networks, losses and the replay call the operators unconditionally: no kernel set is
chosen anywhere else.

Triton is optional (it ships with PyTorch's Linux CUDA wheels, not with the CPU ones): every ``*_triton`` module
of this package imports it at its top, and is itself imported only on first use, by :func:`triton_module`. The
environment switch ``FITDQN_TRITON=0`` (:data:`TRITON_SWITCH`) turns the Triton kernels off, for debugging: the
operators then run their CPU maths on CUDA tensors too (more memory than the plan, which traces the fake kernels,
counts for them).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

TRITON_SWITCH = "FITDQN_TRITON"  # '0': every operator runs its CPU maths on CUDA too (debugging)
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the dtypes the Triton kernels take


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether the Triton kernels may run: the ``triton`` package is installed (it ships with PyTorch's Linux CUDA
    wheels) and ``FITDQN_TRITON`` is not ``0``."""
    return os.environ.get(TRITON_SWITCH, "1").strip() != "0" and _triton_installed()


def runs_triton(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = ()) -> bool:
    """Whether a CUDA kernel runs Triton for these tensors (and compute ``dtypes``): :func:`triton_available` and
    every dtype one the kernels take (:data:`FUSED_DTYPES`); else the operator runs its CPU maths on the GPU."""
    return (triton_available() and all(tensor.dtype in FUSED_DTYPES for tensor in tensors)
            and all(dtype in FUSED_DTYPES for dtype in dtypes))


def next_power_of_2(size: int) -> int:
    """``size`` rounded up to a power of two (Triton's ``next_power_of_2``; 1 for 0): a tile axis, on the host."""
    return 1 << max(size - 1, 0).bit_length()


def triton_module(name: str) -> ModuleType:
    """The Triton kernels' module ``name``, imported on first use (Triton is only needed on CUDA)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
        raise RuntimeError(f"this operator's CUDA kernel needs the triton package (pip install triton); "
                           f"{TRITON_SWITCH}=0 runs the CPU maths instead") from error


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on the tensor's GPU (CPU tensors: the Triton interpreter, no device context)."""
    return torch.cuda.device(tensor.device) if tensor.device.type == "cuda" else contextlib.nullcontext()
