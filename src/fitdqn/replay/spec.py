"""What one transition is made of: named fields with a per-row shape and dtype.

The env declares ``transition_spec() -> dict[str, FieldSpec]``; the replay allocates one ring tensor
``[capacity, *shape]`` per field from it and the planner counts bytes from the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitdqn.memory.component import tensor_bytes


@dataclass(frozen=True)
class FieldSpec:
    """One transition field: ``shape`` of a single row (``()`` for a scalar) and its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def row_bytes(self) -> int:
        """Bytes of one row of this field."""
        return tensor_bytes(self.shape, self.dtype)

    def batched(self, rows: int) -> tuple[int, ...]:
        """Shape of ``rows`` rows: ``[rows, *shape]``."""
        return (int(rows), *self.shape)


TransitionSpec = dict[str, FieldSpec]


def bytes_per_transition(spec: TransitionSpec) -> int:
    """Bytes of one stored transition (the sum of every field's row bytes)."""
    return sum(field.row_bytes() for field in spec.values())


def storage_bytes(spec: TransitionSpec, capacity: int) -> int:
    """Bytes of the ring tensors for ``capacity`` transitions."""
    return sum(tensor_bytes(field.batched(capacity), field.dtype) for field in spec.values())


def check_rows(spec: TransitionSpec, rows: dict[str, torch.Tensor], num_rows: int) -> None:
    """Raise ValueError if ``rows`` does not hold exactly the spec's fields as ``[num_rows, *shape]``.

    Shape/dtype checks only (metadata, no host sync); call it outside captured regions if at all.
    """
    missing = sorted(set(spec) - set(rows))
    extra = sorted(set(rows) - set(spec))
    if missing or extra:
        raise ValueError(f"transition fields: missing {missing}, unexpected {extra}")
    for name, field in spec.items():
        tensor = rows[name]
        if tuple(tensor.shape) != field.batched(num_rows):
            raise ValueError(
                f"field '{name}': shape {tuple(tensor.shape)}, expected {field.batched(num_rows)}")
        if tensor.dtype != field.dtype:
            raise ValueError(f"field '{name}': dtype {tensor.dtype}, expected {field.dtype}")
