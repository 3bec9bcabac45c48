"""Which autocast dtype the update and acting run under (``learn.precision``)."""

from __future__ import annotations

import contextlib

import torch


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """'auto': bf16 on CUDA devices that support it, else none (fp32); 'bf16': bf16; 'fp32': none."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16
        return None
    raise ValueError(f"learn.precision must be 'auto', 'bf16' or 'fp32', got {precision!r}")


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` (none when ``dtype`` is None). The weight-cast cache is off so the same code
    can be captured in a CUDA graph (PyTorch's advice for autocast under capture)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)
