"""A fixed-capacity ring of named tensor fields, written one lockstep step (E rows) at a time.

Step t of env e lives in slot ``(t * E + e) % capacity``; capacity is a multiple of E, so one step is one
contiguous block of E slots and the same env's step t + k is ``k * E`` slots later. The step counter is a
device tensor, so :meth:`RingStorage.write` is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from fitdqn.transitions import TransitionSpec


def filled_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor[:rows]`` as a tensor of its own, for a checkpoint: ``torch.save`` writes a view's whole storage (a
    ring one tenth filled would be saved whole). All rows: the tensor itself (``torch.save`` copies a device
    tensor to the host one storage at a time); fewer: a host copy of those rows (never more device memory)."""
    if rows == tensor.shape[0]:
        return tensor
    return tensor[:rows].to("cpu", copy=True)


class RingStorage:
    """``capacity`` transitions of the fields in ``spec``; ``steps = capacity // num_envs`` lockstep steps."""

    def __init__(self, spec: TransitionSpec, capacity: int, num_envs: int, device: torch.device | str):
        if num_envs < 1 or capacity < num_envs or capacity % num_envs:
            raise ValueError(f"replay capacity {capacity} must be a positive multiple of num_envs {num_envs}")
        self.spec = dict(spec)
        self.capacity = int(capacity)
        self.num_envs = int(num_envs)
        self.steps = self.capacity // self.num_envs  # lockstep steps the ring holds
        self.device = torch.device(device)
        self.fields = {name: torch.zeros(f.batched(capacity), dtype=f.dtype, device=self.device)
                       for name, f in self.spec.items()}
        self.written = torch.zeros((), dtype=torch.int64, device=self.device)  # steps written so far
        # built from a host list, not torch.arange: on the 'meta' device of the planner's replay sizing a factory
        # is free, while the first arange there imports torch's Python decompositions (about 1.5 s)
        self.env_offsets = torch.tensor(range(self.num_envs), dtype=torch.int64, device=self.device)  # [E]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.fields.values(), self.written, self.env_offsets]

    def step_slots(self, step: torch.Tensor) -> torch.Tensor:
        """Slots ``[E]`` of lockstep step ``step`` (0-dim int64; negative steps wrap like the ring)."""
        start = torch.remainder(step, self.steps) * self.num_envs
        return start + self.env_offsets

    def write(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write one step: every field's ``[E, *shape]`` rows at the write pointer; returns the slots [E].

        Fields missing from ``rows`` are an error; no host sync (the pointer is a device tensor).
        """
        slots = self.step_slots(self.written)  # [E]
        for name, field in self.fields.items():
            field.index_copy_(0, slots, rows[name].to(field.dtype))
        self.written.add_(1)
        return slots

    def gather(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Rows of field ``name`` at ``slots`` (any shape ``[...]``) -> ``[..., *field shape]``."""
        return self.fields[name][slots]

    def filled(self) -> int:
        """Slots written at least once: ``[0, filled)`` (host sync: reads the step counter)."""
        return min(int(self.written) * self.num_envs, self.capacity)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The step counter and the written prefix of every field (the rest of the ring is still zeros), so a
        checkpoint holds what the ring holds (:func:`filled_rows`)."""
        filled = self.filled()
        return {"written": self.written,
                **{f"field.{name}": filled_rows(t, filled) for name, t in self.fields.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        names = {key.removeprefix("field.") for key in state if key.startswith("field.")}
        if names != set(self.fields):
            raise ValueError(f"replay checkpoint fields {sorted(names)} != spec fields {sorted(self.fields)}")
        filled = min(int(state["written"]) * self.num_envs, self.capacity)
        for name, field in self.fields.items():
            source = state[f"field.{name}"]
            if source.shape != field[:filled].shape or source.dtype != field.dtype:
                raise ValueError(
                    f"replay checkpoint field '{name}': {tuple(source.shape)} {source.dtype}, "
                    f"expected {tuple(field[:filled].shape)} {field.dtype} (same capacity and spec needed to resume)"
                )
            field.zero_()
            field[:filled].copy_(source)
        self.written.copy_(state["written"])
