"""After allocating: what the device reports, beside what the plan said, per allocation phase."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from fitdqn.device.sizes import format_bytes
from fitdqn.memory.component import NETWORK_COMPONENTS, ComponentName
from fitdqn.plan.planner import Plan

PHASE_COMPONENTS = {  # the system's build phases (``fitdqn.system.build_system``) and what the plan budgets them
    ComponentName.REPLAY: (ComponentName.REPLAY,),
    ComponentName.COLLECTOR: (ComponentName.COLLECTOR,),
    "networks": (*NETWORK_COMPONENTS, ComponentName.ALL_REDUCE),  # a data-parallel learner's all-reduce buffers
}


@dataclass
class AllocationLedger:
    """Allocator bytes gained in each named phase (CUDA only; empty on the CPU)."""

    device: torch.device
    measured: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        yield
        torch.cuda.synchronize(self.device)
        self.measured[phase] = self.measured.get(phase, 0) + torch.cuda.memory_allocated(self.device) - before

    def compare(self, plan: Plan, persistent: dict[str, int] | None = None) -> list[dict]:
        """Rows: phase, planned bytes, measured bytes, difference (relative).

        ``persistent`` overrides the planned figure of a phase whose component also budgets a transient
        peak that is not allocated at set-up (the collector's act step).
        """
        rows = []
        planned_by_name = {c.name: c.fixed_bytes for c in plan.components}
        for phase, names in PHASE_COMPONENTS.items():
            if phase not in self.measured:
                continue
            planned = (persistent or {}).get(phase, sum(planned_by_name.get(n, 0) for n in names))
            measured = self.measured[phase]
            rows.append({"phase": phase, "planned_bytes": planned, "measured_bytes": measured,
                         "difference": (measured - planned) / planned if planned else None})
        return rows


def peak_memory_row(plan: Plan, reserved_peak: int) -> dict:
    """The allocator's peak *reserved* bytes over the run (tensors, graph pools, cache) against what the plan
    budgets inside the allocator at the chosen batch: everything but ``cuda_driver`` (the driver's own bytes) and
    ``nccl`` (NCCL's own)."""
    outside = (ComponentName.CUDA_DRIVER, ComponentName.NCCL)  # device memory the allocator never holds
    planned = plan.planned_bytes - sum(c.fixed_bytes for c in plan.components if c.name in outside)
    return {"phase": f"run peak reserved at batch {plan.batch_size}", "planned_bytes": planned,
            "measured_bytes": reserved_peak, "difference": (reserved_peak - planned) / planned if planned else None}


def format_rows(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        diff = row["difference"]
        lines.append(
            f"  {row['phase']:<28} planned {format_bytes(row['planned_bytes']):>10}   device "
            f"{format_bytes(row['measured_bytes']):>10}   {'' if diff is None else f'{100 * diff:+.1f} %'}"
        )
    return lines


def backtest_growth_note(grown_bytes: int) -> str | None:
    """What to say when the backtests' graphs grew the collector graph's pool (the plan budgets none of it: they are
    meant to fit in the collector's pages, ``fitdqn.evaluate.backtest_graphs``), or None when they did not."""
    if grown_bytes <= 0:
        return None
    return (f"note: the backtest graphs grew the collector graph's pool by {format_bytes(grown_bytes)}, which the plan "
            "does not budget (a backtest steps more envs than the collector: evaluate.segments above "
            "collect.num_envs?); on a full card lower evaluate.segments or raise budget.headroom_fraction")
