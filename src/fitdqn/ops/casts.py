"""Each parameter cast to the compute dtype once a step: :func:`casts_once` and :func:`cast`.

Under bf16 autocast every linear layer casts its fp32 weight and bias to bf16 when it runs (autocast's own cast
cache is off: it cannot be captured in a CUDA graph, PyTorch's advice). The update runs the online network twice
(on ``next_obs`` for the double-DQN action, under ``no_grad``, then on ``obs`` with gradients), so each of its
layers cast its parameters twice a step: 12 of the step's 57 cast kernels at the small widths, one launch each.

Inside :func:`casts_once` (the learner's update), :func:`cast` keeps the cast copy of each parameter it made and
hands it out again while the parameter is unchanged (its version counter: an in-place update such as the optimizer
step makes a new copy). Only parameters (and the tensors of :func:`derived_once`) are kept; activations are cast as
before. The values are the same bit for bit (the same cast of the same tensor); the copies live until the scope
ends (the networks' parameters in bf16: the online ones were kept for backward anyway, the target's are held a
little longer; the planner traces the update, so its step counts them). Outside the scope (acting, backtests)
``cast`` is ``Tensor.to``.
Thread-local: a collector thread acting while an update runs casts for itself.

``casts_once(parameters, dtype)`` casts the given parameters up front, all in one multi-tensor copy
(``torch._foreach_copy_`` into fresh ``dtype`` tensors: one launch on CUDA where each ``Tensor.to`` was one; the
same values bit for bit), and ``cast`` hands those copies out. The learner's update passes its networks'
parameters: at the small widths 45 cast launches of a few microseconds each were the largest item of the H200's
update profile at batch 8192 (0.086 of 1.50 ms).

:func:`derived_once` does the same for a tensor built from a module's parameters (the C51 head's folded output
weight): built once a scope while the parameters are unchanged, with autograd where they need gradients (even in
a ``no_grad`` pass, so the later pass with gradients reuses it), handed out detached under ``no_grad``; ``cast``
keeps one copy of it for both passes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

# .casts while a scope is open: {(id, version, dtype): (parameter, copy)}, {("derived", id, versions): (module,
# tracked, detached)}, {("derived tensor", id): token} and {("derived cast", token, version, dtype): (tensor, copy)}
_LOCAL = threading.local()


@contextlib.contextmanager
def casts_once(parameters: Sequence[nn.Parameter] = (), dtype: torch.dtype | None = None) -> Iterator[None]:
    """Cast each parameter once per dtype inside (nested scopes share the outermost one); with ``dtype``, the
    floating ``parameters`` of another dtype are cast on entry in one multi-tensor copy."""
    if getattr(_LOCAL, "casts", None) is not None:
        yield
        return
    _LOCAL.casts = {}
    try:
        if dtype is not None:
            _cast_up_front(parameters, dtype)
        yield
    finally:
        _LOCAL.casts = None


def _cast_up_front(parameters: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
    sources = [p for p in parameters if p.is_floating_point() and p.dtype != dtype]
    if not sources:
        return
    copies = [torch.empty_like(p, dtype=dtype) for p in sources]
    with torch.no_grad():
        torch._foreach_copy_(copies, sources)  # one launch on CUDA (fp32 -> dtype in the kernel)
    for p, copy in zip(sources, copies, strict=True):
        _LOCAL.casts[(id(p), p._version, dtype)] = (p, copy)


def derived_once(owner: nn.Module, build: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``build()`` (tensors computed from ``owner``'s parameters); inside :func:`casts_once`, once while they are
    unchanged: the autograd-tracked result under grad mode, the same values detached under ``no_grad``."""
    casts = getattr(_LOCAL, "casts", None)
    if casts is None:
        return build()
    parameters = tuple(owner.parameters())
    key = ("derived", id(owner), tuple(p._version for p in parameters))
    if key not in casts:
        tracked = any(p.requires_grad for p in parameters)
        with torch.enable_grad() if tracked else contextlib.nullcontext():
            built = build()
        detached = tuple(t.detach() for t in built)
        casts[key] = (owner, built, detached)
        for index, pair in enumerate(zip(built, detached, strict=True)):
            for t in pair:  # cast() keeps one copy for both (kept alive here, so the ids stay theirs)
                casts[("derived tensor", id(t))] = (*key, index)
    _, built, detached = casts[key]
    return built if torch.is_grad_enabled() else detached


def _kept_key(tensor: torch.Tensor, casts: dict) -> tuple | None:
    if isinstance(tensor, nn.Parameter):
        return (id(tensor), tensor._version)
    token = casts.get(("derived tensor", id(tensor)))
    return None if token is None else ("derived cast", token, tensor._version)


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``; inside :func:`casts_once`, a parameter's copy made once while it is unchanged."""
    casts = getattr(_LOCAL, "casts", None)
    if (tensor.dtype == dtype or casts is None
            or (tensor.requires_grad and torch.is_grad_enabled())):  # a copy autograd must see: cast as before
        return tensor.to(dtype)
    kept = _kept_key(tensor, casts)
    if kept is None:  # an activation
        return tensor.to(dtype)
    key = (*kept, dtype)
    if key not in casts:  # the tensor is kept beside its copy, so its id is not reused while the scope is open
        casts[key] = (tensor, tensor.detach().to(dtype))
    return casts[key][1]
