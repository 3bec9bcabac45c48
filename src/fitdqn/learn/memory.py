"""Measure the activation memory of the real update step, on any device (CPU included).

:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every op (forward, autograd backward, optimizer):
each output storage that is new (not a view of, or in place on, an input) is counted while it lives (a
weakref finalizer on the storage subtracts it when freed). Storages that existed before entering —
parameters, gradients, Adam state, the batch — are never counted, so the peak is what the step adds on top
of the fixed memory: activations, saved tensors, transients, outputs. Forward hooks on the tagged modules
(:mod:`fitdqn.nets.groups`) attribute each allocation made inside a module's forward to its memory group;
everything else (losses, targets outside modules, backward, optimizer) is 'other'.

It counts tensor bytes, not allocator blocks: the CUDA caching allocator rounds up (512-byte blocks, larger
segments), so ``torch.cuda.max_memory_allocated`` on a GPU reads a little higher.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fitdqn.nets.groups import MEMORY_GROUPS, group_of, parameter_groups

OTHER = "other"


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages allocated while active; the composition at the peak by group."""

    def __init__(self, modules: Iterable[nn.Module] = ()) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.live_by_group: dict[str, int] = defaultdict(int)
        self.peak_by_group: dict[str, int] = {}
        self._live: dict[int, tuple[int, str]] = {}  # storage data_ptr -> (bytes, group)
        self._groups: list[str] = []
        self._modules = list(modules)
        self._hooks: list = []

    def __enter__(self):
        for module in self._modules:
            self._hooks.append(module.register_forward_pre_hook(self._enter_module))
            self._hooks.append(module.register_forward_hook(self._exit_module))
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def _enter_module(self, module: nn.Module, _args) -> None:
        self._groups.append(group_of(module) or OTHER)

    def _exit_module(self, _module: nn.Module, _args, _output) -> None:
        self._groups.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _is_dense(t)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if _is_dense(tensor):
                self._track(tensor.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        pointer, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or pointer in inputs or pointer in self._live:
            return
        group = self._groups[-1] if self._groups else OTHER
        self._live[pointer] = (size, group)
        self.current += size
        self.live_by_group[group] += size
        weakref.finalize(storage, self._free, pointer)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_group = dict(self.live_by_group)

    def _free(self, pointer: int) -> None:
        size, group = self._live.pop(pointer, (0, OTHER))
        self.current -= size
        self.live_by_group[group] -= size


def _is_dense(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_meta


@dataclass(frozen=True)
class StepMemory:
    """Bytes one call added on top of what existed before it, at the peak, and the peak's make-up."""

    batch_size: int
    peak_bytes: int
    peak_by_group: dict[str, int] = field(default_factory=dict)

    @property
    def per_sample(self) -> float:
        return self.peak_bytes / self.batch_size


def measure_step(fn: Callable[[], object], batch_size: int, modules: Iterable[nn.Module] = ()) -> StepMemory:
    """Run ``fn`` once under :class:`LiveBytes` (hooks on ``modules`` for the by-group split)."""
    tracker = LiveBytes(modules)
    with tracker:
        result = fn()
        del result
    by_group = {name: tracker.peak_by_group.get(name, 0) for name in (*MEMORY_GROUPS, OTHER)}
    return StepMemory(batch_size, tracker.peak, by_group)


def measure_update(learner, batch: dict[str, torch.Tensor]) -> StepMemory:
    """Peak bytes of one real ``learner.update(batch)`` beyond the fixed memory (it does update the
    learner). Hooks go on every tagged module of the online and target Q networks and V(s)."""
    modules = [m for g in parameter_groups(learner).values() for m in g.modules]
    modules += [m for g in parameter_groups(learner.target).values() for m in g.modules]
    return measure_step(lambda: learner.update(batch), batch["obs"].shape[0], modules)


def slope(small: StepMemory, large: StepMemory) -> float:
    """Marginal bytes per sample between two batch sizes (fixed per-call allocations cancel out)."""
    return (large.peak_bytes - small.peak_bytes) / (large.batch_size - small.batch_size)
