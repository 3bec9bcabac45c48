"""A dispatch mode that logs every op's output storages: what a fake kernel (and so the planner's trace) sees."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageLog(TorchDispatchMode):
    """Every op's output storages: (op, shape, dtype, storage bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.outputs.append((str(func), tuple(tensor.shape), tensor.dtype, tensor.untyped_storage().nbytes()))
        return out
