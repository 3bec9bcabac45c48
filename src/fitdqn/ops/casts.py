"""Each parameter cast to the compute dtype once a step: :func:`casts_once` and :func:`cast`.

Under bf16 autocast every linear layer casts its fp32 weight and bias to bf16 when it runs (autocast's own cast
cache is off: it cannot be captured in a CUDA graph, PyTorch's advice). The update runs the online network twice
(on ``next_obs`` for the double-DQN action, under ``no_grad``, then on ``obs`` with gradients), so each of its
layers cast its parameters twice a step: 12 of the step's 57 cast kernels at the small widths, one launch each.

Inside :func:`casts_once` (the learner's update), :func:`cast` keeps the cast copy of each parameter it made and
hands it out again while the parameter is unchanged (its version counter: an in-place update such as the optimizer
step makes a new copy). Only parameters are kept (the online and target networks'); activations are cast as
before. The values are the same bit for bit (the same cast of the same tensor); the copies live until the scope
ends (the networks' parameters in bf16: the online ones were kept for backward anyway, the target's are held a
little longer; the planner traces the update, so its step counts them). Outside the scope (acting, backtests)
``cast`` is ``Tensor.to``.
Thread-local: a collector thread acting while an update runs casts for itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

_LOCAL = threading.local()  # .casts: {(id, version, dtype): (tensor, copy)} while a scope is open


@contextlib.contextmanager
def casts_once() -> Iterator[None]:
    """Cast each parameter once per dtype inside (nested scopes share the outermost one)."""
    if getattr(_LOCAL, "casts", None) is not None:
        yield
        return
    _LOCAL.casts = {}
    try:
        yield
    finally:
        _LOCAL.casts = None


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``; inside :func:`casts_once`, a parameter's copy made once while it is unchanged."""
    casts = getattr(_LOCAL, "casts", None)
    if (tensor.dtype == dtype or casts is None or not isinstance(tensor, nn.Parameter)
            or (tensor.requires_grad and torch.is_grad_enabled())):  # a copy autograd must see: cast as before
        return tensor.to(dtype)
    key = (id(tensor), tensor._version, dtype)
    if key not in casts:  # the tensor is kept beside its copy, so its id is not reused while the scope is open
        casts[key] = (tensor, tensor.detach().to(dtype))
    return casts[key][1]
