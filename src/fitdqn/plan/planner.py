"""The planner: free memory in, a batch size out — chosen last, from what the fixed consumers leave.

Consumers are listed in allocation order (``ALLOCATION_ORDER``): the replay buffer is sized from the
probed free memory first (its component arrives already sized), then the collector, the CUDA overhead,
every network with its optimizer, the headroom; the batch comes last::

    remaining = free - sum(fixed_bytes) - headroom
    batch     = clamp(remaining // sum(per_sample_bytes), min_batch, max_batch)

A profile batch (budget.batch_size = -1) or a user batch (N > 0) is used as given but checked first;
one that does not fit is refused with every consumer listed, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fitdqn.config import BudgetConfig, FixedBatch, ProfileBatch, batch_choice
from fitdqn.device.probe import DeviceInfo
from fitdqn.device.profiles import Profile
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.memory.component import NETWORK_COMPONENTS, Component, ComponentName

ALLOCATION_ORDER = (ComponentName.REPLAY, ComponentName.HER, ComponentName.COLLECTOR, ComponentName.CUDA_OVERHEAD,
                    ComponentName.CUDA_DRIVER, *NETWORK_COMPONENTS)


class InfeasiblePlan(UserError):
    """The memory does not hold what the config asks for; the message lists every consumer."""


@dataclass(frozen=True)
class Budgets:
    """What the plan hands the trainer to allocate by, typed (the trainer never looks components up by name)."""

    replay_capacity: int  # transitions the replay is built for
    batch_size: int  # samples per update
    update_bytes: int  # every per-sample byte of the step at ``batch_size``: what one update may allocate
    graph_pool_fixed_bytes: int  # the update graph's private pool beyond its per-sample bytes (pages)


@dataclass(frozen=True)
class Plan:
    device: DeviceInfo
    profile: Profile
    batch_size: int
    batch_source: str  # "profile" | "auto" | "user"
    components: tuple[Component, ...]
    headroom_bytes: int
    replay_capacity: int | None
    max_fitting_batch: int | None  # None when the device memory is unknown
    notes: tuple[str, ...] = field(default=())

    @property
    def budgets(self) -> Budgets:
        if self.replay_capacity is None:
            raise ValueError("this plan sized no replay (its device memory is unknown): nothing to allocate by")
        return Budgets(
            replay_capacity=self.replay_capacity,
            batch_size=self.batch_size,
            update_bytes=self.per_sample_bytes * self.batch_size,
            graph_pool_fixed_bytes=sum(c.fixed_bytes for c in self.components if c.name == ComponentName.CUDA_GRAPHS),
        )

    @property
    def fixed_bytes(self) -> int:
        return sum(c.fixed_bytes for c in self.components)

    @property
    def per_sample_bytes(self) -> int:
        return sum(c.per_sample_bytes for c in self.components)

    @property
    def planned_bytes(self) -> int:
        """Everything the plan expects to be allocated at the chosen batch (headroom not included)."""
        return self.fixed_bytes + self.per_sample_bytes * self.batch_size

    @property
    def remaining_bytes(self) -> int | None:
        """Free memory left after the fixed consumers and the headroom: what the batch is cut from."""
        if self.device.free_bytes is None:
            return None
        return self.device.free_bytes - self.fixed_bytes - self.headroom_bytes

    def to_json(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "batch_source": self.batch_source,
            "profile": self.profile.name,
            "profile_source": self.profile.source,
            "device": self.device.to_json(),
            "components": [c.to_json() for c in self.components],
            "fixed_bytes": self.fixed_bytes,
            "per_sample_bytes": self.per_sample_bytes,
            "planned_bytes": self.planned_bytes,
            "remaining_bytes": self.remaining_bytes,
            "headroom_bytes": self.headroom_bytes,
            "replay_capacity": self.replay_capacity,
            "max_fitting_batch": self.max_fitting_batch,
            "notes": list(self.notes),
        }


def order_components(components: list[Component]) -> tuple[Component, ...]:
    """Allocation order: known names in ALLOCATION_ORDER, any other consumer after them."""
    rank = {name: i for i, name in enumerate(ALLOCATION_ORDER)}
    return tuple(sorted(components, key=lambda c: rank.get(c.name, len(rank))))


def consumer_table(components: tuple[Component, ...], batch_size: int) -> str:
    lines = [
        f"  {c.name:<14} fixed {format_bytes(c.fixed_bytes):>10}  per sample {format_bytes(c.per_sample_bytes):>10}"
        f"  at batch {batch_size}: {format_bytes(c.bytes_at(batch_size)):>10}"
        for c in components
    ]
    return "\n".join(lines)


def make_plan(
    device: DeviceInfo,
    profile: Profile,
    budget: BudgetConfig,
    components: list[Component],
    replay_capacity: int | None = None,
    sampleable: int | None = None,
) -> Plan:
    """Choose the batch size last, from what the fixed consumers leave; refuse what does not fit.

    ``sampleable``: the most transitions the replay can serve at once (its capacity less the n-step windows not
    yet complete); an auto batch is capped by it, a profile or user batch beyond it is refused (the trainer would
    wait for a fill the replay never reaches and make no update)."""
    ordered = order_components(components)
    fixed = sum(c.fixed_bytes for c in ordered)
    per_sample = sum(c.per_sample_bytes for c in ordered)
    notes: list[str] = []
    free = device.free_bytes
    headroom = int(free * budget.headroom_fraction) if free is not None else 0

    if free is None:
        max_fitting = None
        notes.append("device memory unknown: give --free-memory (or --total-memory) to check the fit")
    else:
        remaining = free - fixed - headroom
        if remaining < 0 or (per_sample > 0 and remaining // per_sample < 1):
            raise InfeasiblePlan(
                f"the fixed consumers need {format_bytes(fixed)} + headroom {format_bytes(headroom)}, "
                f"but only {format_bytes(free)} is free on {device.name}:\n"
                f"{consumer_table(ordered, budget.min_batch)}\n"
                "lower budget.replay_buffer_vram_fraction or replay.capacity, collect.num_envs, "
                "or the network sizes; or free memory on the device"
            )
        max_fitting = remaining // per_sample if per_sample > 0 else budget.max_batch

    choice = batch_choice(budget)
    if isinstance(choice, FixedBatch):
        batch, source = choice.size, "user"
    elif isinstance(choice, ProfileBatch):
        batch, source = profile.batch_size, "profile"
    else:
        if max_fitting is None:
            raise InfeasiblePlan(
                "budget.batch_size = 0 (auto) needs the device's free memory: give --free-memory SIZE "
                "(and --total-memory SIZE) for a GPU you do not have"
            )
        batch, source = min(max(max_fitting, budget.min_batch), budget.max_batch), "auto"
        if sampleable is not None and batch > sampleable:
            notes.append(f"auto batch capped at {sampleable}, what the replay can serve (its capacity "
                         f"{replay_capacity} less the n-step windows still open); up to "
                         f"{min(max_fitting, budget.max_batch)} would fit in memory: raise replay.capacity for more")
            batch = sampleable
    if sampleable is not None and sampleable < max(budget.min_batch if source == "auto" else batch, 1):
        raise InfeasiblePlan(
            f"the replay can serve at most {sampleable} transitions at once (capacity {replay_capacity} less the "
            f"n-step windows still open), fewer than the batch of {batch if source != 'auto' else budget.min_batch}"
            f" ({source}): no update would ever run; raise replay.capacity, or use a smaller --batch-size "
            f"(at most {sampleable})"
        )

    if max_fitting is not None and batch > max_fitting:
        how = {
            "user": f"the batch size {batch} you asked for",
            "profile": f"the '{profile.name}' profile's batch {batch}",
            "auto": f"the smallest batch allowed (budget.min_batch = {budget.min_batch})",
        }[source]
        raise InfeasiblePlan(
            f"{how} does not fit on {device.name}: {format_bytes(free)} free, fixed consumers "
            f"{format_bytes(fixed)}, headroom {format_bytes(headroom)}, {format_bytes(per_sample)} per sample "
            f"-> at most {max_fitting} samples fit.\n{consumer_table(ordered, batch)}\n"
            "use --batch-size 0 (auto) or a batch <= "
            f"{max_fitting}, or lower budget.replay_buffer_vram_fraction / replay.capacity"
        )
    if source == "auto" and max_fitting is not None and max_fitting > budget.max_batch and batch == budget.max_batch:
        notes.append(f"auto batch clamped to budget.max_batch = {budget.max_batch} (up to {max_fitting} fit)")
    return Plan(
        device=device, profile=profile, batch_size=int(batch), batch_source=source, components=ordered,
        headroom_bytes=headroom, replay_capacity=replay_capacity, max_fitting_batch=max_fitting,
        notes=tuple(notes),
    )


@dataclass
class BatchSearch:
    """The search for the largest batch whose traced need fits: which batch to trace next, from what each trace
    said. Shared by the auto batch (``fitdqn.plan.build.refine_auto_batch``) and the OOM guard's re-plan
    (``fitdqn.train.oom.fitting_batch``).

    Each trace is exact at its own batch and proposes the batch that fits in proportion to it. A trace just over
    the room proposes a batch just under itself, while the update graph's pool, mapped in whole pages, stays flat
    over thousands of samples: so the next batch steps under the smallest miss by at least ``converged / 4``,
    twice that after two misses, and so on (else the search creeps down a few samples a round and never fits).
    Done when a fitting trace proposes less than ``converged`` more, or a miss proposes no more than the largest
    fit and the bracket between them is at most twice ``converged`` wide (a wider one has its middle traced)."""

    converged: float
    fitted: int | None = None  # the largest batch whose trace fitted
    missed: int | None = None  # the smallest batch whose trace did not
    misses: int = 0

    def next(self, batch: int, fits: bool, proposal: int) -> int | None:
        """Record the trace at ``batch`` (``fits``: whether its need fits) and its ``proposal``; the batch to
        trace next, or None when the search is done."""
        if fits:
            self.fitted = batch if self.fitted is None else max(self.fitted, batch)
        else:
            self.missed = batch if self.missed is None else min(self.missed, batch)
            self.misses += 1
        if self.missed is not None:  # under the smallest miss, by a step that doubles with each miss
            proposal = min(proposal, int(self.missed * (1 - self.converged / 4 * 2 ** (self.misses - 1))))
        if self.fitted is None:
            return proposal
        if fits and proposal <= self.fitted * (1 + self.converged):
            return None
        if proposal <= self.fitted:
            return None if self.missed - self.fitted <= 2 * self.converged * self.fitted \
                else (self.fitted + self.missed) // 2
        return proposal
