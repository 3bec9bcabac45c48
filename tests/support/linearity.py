"""The linearity check of a traced step's bytes in the batch: a line fitted at two batches against a trace at a
third (the plan assumes the step's bytes are linear in the batch between its traced batches)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fitdqn.memory.trace import MakeStep, StepFit, per_sample_bytes, trace_step_memory


@dataclass(frozen=True)
class Linearity:
    """A line fitted at two batches against a trace at a third."""

    fit: StepFit
    batch_size: int
    predicted_bytes: int
    traced_bytes: int

    @property
    def relative_error(self) -> float:
        return (self.predicted_bytes - self.traced_bytes) / max(self.traced_bytes, 1)

    def holds(self, tolerance: float = 0.01) -> bool:
        return abs(self.relative_error) <= tolerance


def check_linearity(
    make_step: MakeStep,
    batches: Sequence[int] = (1024, 2048, 4096),
    device: torch.device | str = "cuda",
    **trace_options: Any,
) -> Linearity:
    """Fit through the first two batches, trace the third, and compare (``Linearity.holds``)."""
    b1, b2, b3 = batches
    fit = per_sample_bytes(make_step, (b1, b2), device, **trace_options)
    third = trace_step_memory(make_step, b3, device, **trace_options)
    return Linearity(fit, b3, fit.fixed_step_bytes + fit.per_sample_bytes * b3, third.step_bytes)
