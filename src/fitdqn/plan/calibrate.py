"""`fitdqn plan --calibrate`: measure the real training step on this GPU and correct the plan with it.

The plan's per-sample bytes come from tracing the step on fake tensors (``fitdqn.memory.trace``); what a
trace cannot see (kernel scratch inside an op, allocator rounding of large blocks, a kernel the GPU picks that
saves more for backward) only a real run shows. Calibration runs the same captured step the trainer runs
(``fitdqn.plan.build.make_train_step``: sample -> update -> priorities) on the GPU at two small batches:

1. **measured**: ``trace.measure_step_memory`` (``torch.cuda.max_memory_allocated`` above what was allocated
   before the step) at both batches -> ``measured_fixed + measured_per_sample x B`` (``trace.fit_line``);
2. **by group, on real tensors**: the same ``LiveBytes`` + ``GroupOwner`` tracker the trace uses, run on the
   real CUDA tensors (no ``FakeTensorMode``; ``live_bytes_step``) at both batches: the measured bytes split per
   group (dqn, attention, iqn, iql, other). The allocator total minus the tracked total is what no tensor
   owns (kernel scratch, 1 MiB large-block rounding): reported as ``unattributed``. If the tracker fails on
   this GPU/PyTorch, the split is reported as traced only and the reason given;
3. **traced** at the same batches and replay capacity, for the comparison table;
4. **driver-level bytes**: the drop in ``torch.cuda.mem_get_info`` free memory over the measured runs (1.)
   minus the allocator's ``memory_reserved`` growth: memory the driver takes outside PyTorch's allocator when
   the step first runs (kernel images loaded lazily, cuBLAS/cuBLASLt handles, Triton modules). Not seen:
   the collector's kernels and CUDA-graph executables (calibration runs the update eagerly), so this is a
   lower bound of what a training process loads; the GPU's profile holds the whole-process figure (measured
   by ``fitdqn profile``) and the ``cuda_driver`` component keeps the larger of the two (``with_driver_bytes``).

With ``--calibrate`` the plan then *uses* the measurement (``calibrated_components``): every component's
per-sample bytes are the traced ones scaled by one factor so that they sum exactly to the measured slope
(integer parts by largest remainder), a measured step intercept above the traced one is added to ``batch``'s
fixed bytes, and the driver-level bytes to ``cuda_overhead``. Each changed component says so in
``derived_from``. The probe (free memory) is taken *before* calibration, so the plan is for a fresh process.

The replay for the calibration step is small (``CALIBRATION_STEPS`` lockstep steps of ``collect.num_envs``
envs): the step's bytes do not grow with the capacity, and the planned replay may fill most of the card.
The maths is in small pure functions (``apportion``, ``driver_overhead``, ``calibrated_components``) tested on
the CPU; ``live_bytes_step`` runs on any device (it is tested on real CPU tensors).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fitdqn.config import Config, for_device
from fitdqn.device.probe import DeviceInfo
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.memory.attribution import OTHER, GroupOwner
from fitdqn.memory.component import Component, ComponentName
from fitdqn.memory.live_bytes import LiveBytes
from fitdqn.memory.overhead import cuda_driver_component
from fitdqn.memory.trace import (
    MakeStep,
    StepTrace,
    fit_line,
    measure_step_memory,
    per_sample_bytes,
    traced_step,
)
from fitdqn.plan.build import make_train_step, trace_config
from fitdqn.plan.planner import Plan, make_plan

DEFAULT_BATCHES = (64, 256)
CALIBRATION_STEPS = 64  # lockstep steps of num_envs transitions in the calibration replay
STEP_COMPONENTS = ("replay", "her", "dqn", "attention", "iqn", "iql", "batch")  # what the step's slope covers
GROUPS = ("dqn", "attention", "iqn", "iql", "replay", "her", OTHER)  # the trace's groups ('other': the batch)


class CalibrationError(UserError):
    """Calibration cannot run here (no CUDA GPU, out of memory, bad batches); the message says what to do."""


# ----------------------------------------------------------------------------------------------- pure maths
def apportion(total: int, weights: dict[str, int]) -> dict[str, int]:
    """Split ``total`` into integers proportional to ``weights`` that sum to ``total`` exactly.

    Largest-remainder (Hamilton) rounding; ties go to the larger weight, then the name. Zero and negative
    weights get 0; if every weight is 0 the whole total goes to the first name (there must be one).
    """
    if not weights:
        raise ValueError("apportion needs at least one weight")
    positive = {name: w for name, w in weights.items() if w > 0}
    if not positive:
        first = next(iter(weights))
        return {name: (total if name == first else 0) for name in weights}
    weight_sum = sum(positive.values())
    floors = {name: total * w // weight_sum for name, w in positive.items()}
    remainders = {name: total * w - floors[name] * weight_sum for name, w in positive.items()}
    left = total - sum(floors.values())
    order = sorted(positive, key=lambda name: (-remainders[name], -positive[name], name))
    for name in order[:left]:
        floors[name] += 1
    return {name: floors.get(name, 0) for name in weights}


def driver_overhead(free_before: int, free_after: int, reserved_before: int, reserved_after: int) -> int:
    """Device memory taken outside PyTorch's allocator: drop in driver free memory minus reserved growth."""
    return max((free_before - free_after) - (reserved_after - reserved_before), 0)


def calibrated_components(
    components: list[Component] | tuple[Component, ...],
    per_sample_total: int,
    extra_fixed: int = 0,
    driver_bytes: int = 0,
    how: str = "measured by --calibrate",
) -> list[Component]:
    """The plan's components with the measurement applied (module docstring).

    ``per_sample_total`` replaces the sum of the per-sample bytes of ``STEP_COMPONENTS`` (apportioned in the
    proportions the trace gave them); ``extra_fixed`` (> 0: the measured step intercept above the traced one)
    joins ``batch``'s fixed bytes; ``driver_bytes`` raises ``cuda_driver`` (from the GPU's profile, or added)
    to at least itself (``with_driver_bytes``). Other components are unchanged.
    """
    step = [c for c in components if c.name in STEP_COMPONENTS]
    traced_total = sum(c.per_sample_bytes for c in step)
    if not step:
        raise ValueError("no step component (replay, her, dqn, attention, iqn, iql, batch) to calibrate")
    shares = apportion(per_sample_total, {c.name: c.per_sample_bytes for c in step})
    factor = per_sample_total / traced_total if traced_total else float("nan")
    out = []
    for c in components:
        if c.name in shares:
            text = (f"{c.derived_from}; per-sample x{factor:.3f}: traced shares of the measured "
                    f"{per_sample_total} B/sample ({how})")
            fixed = c.fixed_bytes
            if c.name == "batch" and extra_fixed > 0:
                fixed += extra_fixed
                text += f"; + {format_bytes(extra_fixed)} measured step intercept above the traced one"
            c = Component(c.name, fixed, shares[c.name], text)
        out.append(c)
    return with_driver_bytes(out, driver_bytes, how) if driver_bytes > 0 else out


def with_driver_bytes(components: list[Component], measured: int, how: str) -> list[Component]:
    """``cuda_driver`` raised to at least ``measured``: it holds a profile's whole-process figure (or is absent);
    this calibration measured the update alone, a lower bound. The larger of the two is kept."""
    held = next((c for c in components if c.name == "cuda_driver"), None)
    if held is not None and held.fixed_bytes >= measured:
        note = f"{held.derived_from} (more than the {format_bytes(measured)} {how})"
        return [Component(c.name, c.fixed_bytes, c.per_sample_bytes, note) if c is held else c for c in components]
    driver = cuda_driver_component(measured, how)
    if held is None:
        return [*components, driver]
    return [driver if c is held else c for c in components]


def group_per_sample(components: list[Component] | tuple[Component, ...]) -> dict[str, int]:
    """The plan's per-sample bytes per trace group: each group's component by name, 'batch' as 'other'."""
    by_name = {c.name: c.per_sample_bytes for c in components}
    groups = {name: by_name.get(name, 0) for name in GROUPS if name != OTHER}
    groups[OTHER] = by_name.get(ComponentName.BATCH, 0)
    return groups


# ----------------------------------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured on the card (bytes; per-sample figures are slopes between the batches)."""

    device_name: str
    batches: tuple[int, int]
    replay_capacity: int
    measured_step_bytes: tuple[int, int]  # allocator peak above the baseline, per batch
    traced_step_bytes: tuple[int, int]  # the fake-tensor trace at the same batches and capacity
    measured_fixed: int
    measured_per_sample: int
    traced_fixed: int
    traced_per_sample: int
    traced_by_group: dict[str, int]  # per sample, traced at the calibration batches
    live_by_group: dict[str, int] | None  # per sample, LiveBytes on the real tensors; None if it failed
    live_total_per_sample: int | None
    live_note: str
    free_before: int
    free_after: int
    reserved_before: int
    reserved_after: int
    seconds: float
    notes: tuple[str, ...] = field(default=())

    @property
    def driver_bytes(self) -> int:
        return driver_overhead(self.free_before, self.free_after, self.reserved_before, self.reserved_after)

    @property
    def extra_fixed(self) -> int:
        """The measured step intercept above the traced one (what ``batch``'s fixed bytes gain), else 0."""
        return max(self.measured_fixed - self.traced_fixed, 0)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["driver_bytes"] = self.driver_bytes
        data["extra_fixed"] = self.extra_fixed
        data["batches"] = list(self.batches)
        data["measured_step_bytes"] = list(self.measured_step_bytes)
        data["traced_step_bytes"] = list(self.traced_step_bytes)
        data["notes"] = list(self.notes)
        return data


def live_bytes_step(make_step: MakeStep, batch_size: int, device: torch.device | str,
                    warmup_steps: int = 1) -> StepTrace:
    """Like ``trace.trace_step_memory``, on *real* tensors of ``device``: the live bytes per group.

    The same protocol (build, warm up, charge parameters to their groups, baseline, reset the peak, one traced
    step) and the same ``LiveBytes`` / ``GroupOwner`` counters; no fake mode, no kernel-scratch model (a real
    kernel's scratch is not a tensor: on a GPU it shows only in the allocator's peak).
    """
    device = torch.device(device)
    owner = GroupOwner()
    tracker = LiveBytes(device.type, owner.owner, owner.in_backward)  # no scratch model: real kernels
    try:
        with device, owner.active(), tracker:
            return traced_step(make_step, batch_size, device, device, "live bytes of real tensors", warmup_steps,
                               owner, tracker)
    finally:
        tracker.detach_finalizers()


def group_slopes(first: StepTrace, second: StepTrace) -> dict[str, int]:
    """Per-sample bytes per group between two traces (live or fake) at different batches."""
    slopes = {}
    steps1, steps2 = first.step_by_group, second.step_by_group
    for name in GROUPS:
        _fixed, slopes[name] = fit_line((first.batch_size, steps1.get(name, 0)),
                                        (second.batch_size, steps2.get(name, 0)))
    return slopes


def calibration_capacity(config: Config) -> int:
    num_envs = config.collect.num_envs
    return max(CALIBRATION_STEPS, config.learn.n_step + 2) * num_envs


def parse_batches(text: str) -> tuple[int, int]:
    try:
        values = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    except ValueError:
        raise CalibrationError(f"--calibrate-batches {text!r}: expected two batch sizes, e.g. 64,256") from None
    if len(values) != 2 or values[0] < 1:
        raise CalibrationError(f"--calibrate-batches {text!r}: give two different positive batch sizes, "
                               "e.g. 64,256")
    return values[0], values[1]


def require_cuda(device: DeviceInfo, what: str = "--calibrate measures the step") -> None:
    """A clear error (not a traceback) when the device is not a real CUDA GPU."""
    if device.kind == "cuda" and not device.what_if and torch.cuda.is_available():
        return
    if device.what_if:
        raise CalibrationError(f"{what} on this machine's CUDA GPU; it cannot be combined with "
                               "--gpu / --total-memory / --free-memory (a GPU you do not have)")
    if torch.cuda.is_available():
        raise CalibrationError(f"{what} on a CUDA GPU; the device is {device.name}: use --device cuda")
    raise CalibrationError(f"{what} on a CUDA GPU; this machine has none")


def calibrate(config: Config, device: DeviceInfo, num_bars: int,
              batches: tuple[int, int] = DEFAULT_BATCHES) -> Calibration:
    """Measure the real step on ``device`` (a CUDA GPU) at ``batches``; see the module docstring."""
    require_cuda(device)
    config = for_device(config, device.kind)
    b1, b2 = sorted(batches)
    capacity = calibration_capacity(config)
    target = device.torch_device
    notes: list[str] = []
    start = time.perf_counter()

    traced_config, trace_note = trace_config(config, device)
    traced = per_sample_bytes(make_train_step(traced_config, num_bars, capacity), (b1, b2), "cuda")
    if trace_note:
        notes.append(f"trace: {trace_note}")

    gc.collect()
    torch.cuda.synchronize(target)  # host sync: a quiet device before the driver reading
    free_before, _total = torch.cuda.mem_get_info(target)
    reserved_before = torch.cuda.memory_reserved(target)
    make_step = make_train_step(config, num_bars, capacity)
    measured = []
    try:
        for batch in (b1, b2):
            measured.append(measure_step_memory(make_step, batch, target))
            gc.collect()
    except torch.OutOfMemoryError as error:
        raise CalibrationError(
            f"calibration ran out of GPU memory at batch {batch} on {device.name}: free memory on the device, "
            f"or calibrate at smaller batches (--calibrate-batches); {str(error).splitlines()[0]}") from None
    # the driver reading right after the configured step ran (the live split below runs other kernels)
    gc.collect()
    torch.cuda.synchronize(target)  # host sync: the driver reading after the runs
    free_after, _total = torch.cuda.mem_get_info(target)
    reserved_after = torch.cuda.memory_reserved(target)

    live_by_group: dict[str, int] | None = None
    live_total: int | None = None
    try:
        live_make = make_train_step(config, num_bars, capacity)
        first = live_bytes_step(live_make, b1, target)
        second = live_bytes_step(live_make, b2, target)
        live_by_group = group_slopes(first, second)
        live_total = fit_line((b1, first.step_bytes), (b2, second.step_bytes))[1]
        live_note = "LiveBytes on the real tensors"
    except Exception as error:  # noqa: BLE001 - any failure of the tracker: report per group as traced only
        live_note = (f"live-bytes tracker failed on real tensors ({type(error).__name__}: {error}); "
                     "per group as traced only")
        notes.append(live_note)
    torch.cuda.empty_cache()

    measured_fixed, measured_slope = fit_line((b1, measured[0]), (b2, measured[1]))
    if measured_slope <= 0:
        raise CalibrationError(
            f"the measured step did not grow between batch {b1} ({measured[0]} B) and {b2} ({measured[1]} B): "
            "calibrate at larger batches (--calibrate-batches 512,2048)")
    return Calibration(
        device_name=device.name, batches=(b1, b2), replay_capacity=capacity,
        measured_step_bytes=(measured[0], measured[1]),
        traced_step_bytes=(traced.traces[0].step_bytes, traced.traces[1].step_bytes),
        measured_fixed=measured_fixed, measured_per_sample=measured_slope,
        traced_fixed=traced.fixed_step_bytes, traced_per_sample=traced.per_sample_bytes,
        traced_by_group={name: traced.per_group_per_sample.get(name, 0) for name in GROUPS},
        live_by_group=live_by_group, live_total_per_sample=live_total, live_note=live_note,
        free_before=int(free_before), free_after=int(free_after), reserved_before=int(reserved_before),
        reserved_after=int(reserved_after), seconds=time.perf_counter() - start, notes=tuple(notes),
    )


def calibrated_plan(plan: Plan, calibration: Calibration, config: Config) -> Plan:
    """Re-plan with the measured per-sample total, step intercept and driver bytes (checks the fit again)."""
    how = (f"measured by --calibrate at batch {calibration.batches[0]} and {calibration.batches[1]} "
           f"on {calibration.device_name}")
    components = calibrated_components(
        plan.components, calibration.measured_per_sample, calibration.extra_fixed, calibration.driver_bytes, how)
    new = make_plan(plan.device, plan.profile, config.budget, components, plan.replay_capacity)
    note = (f"calibrated: {calibration.measured_per_sample} B/sample measured vs {plan.per_sample_bytes} traced "
            f"({how}); driver-side {format_bytes(calibration.driver_bytes)}")
    return dataclasses.replace(new, notes=(*new.notes, note))


# ----------------------------------------------------------------------------------------------- reporting
def comparison_rows(plan: Plan, calibrated: Plan, calibration: Calibration) -> list[dict[str, Any]]:
    """Per group: traced, live bytes on real tensors, allocator-measured, planned before and after (B/sample).

    'other' is the observations, losses and optimizer temporaries (the plan's batch component); 'unattributed'
    is the allocator's slope minus the tracked one (no tensor owns it).
    Components outside the step with per-sample bytes (``cuda_graphs``: the graph pool beyond the step's live
    peak) keep their own row: calibration does not measure them and leaves them as planned.
    """
    before = group_per_sample(plan.components)
    after = group_per_sample(calibrated.components)
    live = calibration.live_by_group
    rows = []
    for name in GROUPS:
        rows.append({
            "group": name if name != OTHER else "other (batch)",
            "traced": calibration.traced_by_group.get(name, 0),
            "live": None if live is None else live.get(name, 0),
            "measured": None,
            "planned": before.get(name, 0),
            "calibrated": after.get(name, 0),
        })
    if calibration.live_total_per_sample is not None:
        rows.append({"group": "unattributed (scratch, rounding)", "traced": None,
                     "live": None, "measured": calibration.measured_per_sample - calibration.live_total_per_sample,
                     "planned": None, "calibrated": None})
    rows.append({"group": "step", "traced": calibration.traced_per_sample,
                 "live": calibration.live_total_per_sample, "measured": calibration.measured_per_sample,
                 "planned": sum(before.values()), "calibrated": sum(after.values())})
    calibrated_by_name = {c.name: c.per_sample_bytes for c in calibrated.components}
    for c in plan.components:
        if c.name not in STEP_COMPONENTS and (c.per_sample_bytes or calibrated_by_name.get(c.name)):
            rows.append({"group": f"{c.name} (not measured)", "traced": None, "live": None, "measured": None,
                         "planned": c.per_sample_bytes, "calibrated": calibrated_by_name.get(c.name, 0)})
    rows.append({"group": "total", "traced": None, "live": None, "measured": None,
                 "planned": plan.per_sample_bytes, "calibrated": calibrated.per_sample_bytes})
    return rows


def print_calibration(plan: Plan, calibrated: Plan, calibration: Calibration, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    b1, b2 = calibration.batches
    table = Table(title=f"calibration on {calibration.device_name}: bytes per sample between batch {b1} and {b2}",
                  title_justify="left")
    columns = ("group", "traced", "live (real tensors)", "measured (allocator)", "plan before", "plan calibrated")
    for column in columns:
        table.add_column(column, justify="left" if column == "group" else "right")
    show = lambda v: "-" if v is None else format_bytes(v)  # noqa: E731
    for row in comparison_rows(plan, calibrated, calibration):
        table.add_row(row["group"], show(row["traced"]), show(row["live"]), show(row["measured"]),
                      show(row["planned"]), show(row["calibrated"]),
                      style="bold" if row["group"] in ("step", "total") else None)
    console.print(table)
    lines = [
        f"step at batch {b1}: measured {format_bytes(calibration.measured_step_bytes[0])}, traced "
        f"{format_bytes(calibration.traced_step_bytes[0])}; at batch {b2}: measured "
        f"{format_bytes(calibration.measured_step_bytes[1])}, traced {format_bytes(calibration.traced_step_bytes[1])}",
        f"step intercept: measured {format_bytes(calibration.measured_fixed)}, traced "
        f"{format_bytes(calibration.traced_fixed)}",
        f"driver-side bytes (free-memory drop {format_bytes(calibration.free_before - calibration.free_after)} "
        f"- allocator reserved growth {format_bytes(calibration.reserved_after - calibration.reserved_before)}): "
        f"{format_bytes(calibration.driver_bytes)}",
        f"per group: {calibration.live_note}; replay for the calibration step: "
        f"{calibration.replay_capacity:,} transitions; {calibration.seconds:.1f} s",
    ]
    for line in lines:
        console.print(line, highlight=False, markup=False)
