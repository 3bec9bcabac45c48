"""The transition contract between the env, the replay and the replay's operators: what one transition is made of
(named fields, each with a per-row shape and dtype) and the bits of its ``flags`` field.

The env declares ``transition_spec() -> dict[str, FieldSpec]`` (:mod:`fitdqn.market.layout`) and sets the flag
bits; the replay allocates one ring tensor ``[capacity, *shape]`` per field from the spec, the planner counts bytes
from the same spec, and the replay's gather (:mod:`fitdqn.ops.replay_gather`) reads the bits. It imports nothing of
fitdqn, so market/, replay/ and ops/ all import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TERMINAL = 1  # flags bit 0: no bootstrap
EPISODE_END = 2  # flags bit 1: last step of the episode


@dataclass(frozen=True)
class FieldSpec:
    """One transition field: ``shape`` of a single row (``()`` for a scalar) and its dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def row_bytes(self) -> int:
        """Bytes of one row of this field."""
        return math.prod(self.shape) * self.dtype.itemsize

    def batched(self, rows: int) -> tuple[int, ...]:
        """Shape of ``rows`` rows: ``[rows, *shape]``."""
        return (int(rows), *self.shape)


TransitionSpec = dict[str, FieldSpec]


def bytes_per_transition(spec: TransitionSpec) -> int:
    """Bytes of one stored transition (the sum of every field's row bytes)."""
    return sum(field.row_bytes() for field in spec.values())
