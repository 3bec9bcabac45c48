"""Activation bytes of a training step, by tracing it on fake tensors (no GPU needed) or measuring it on one.

The step is described by a ``make_step(batch_size, device)`` function. It builds everything the step needs
on ``device`` (networks, optimizer, whatever persists between steps) and returns the step: a callable that
makes its batch and runs forward, backward and the optimizer update; or a ``StepSetup(step, groups)`` whose
``groups`` names the modules whose memory is to be told apart (``{'iqn': [learner.iqn], ...}``). Groups come
back from ``make_step`` because the modules must be created inside the tracer's fake mode.

``trace_step_memory`` runs ``make_step`` and the step under ``FakeTensorMode``: tensors have shapes, dtypes
and devices but no memory, so a batch of 16384 for a GPU traces on a laptop in a second. A ``LiveBytes``
dispatch mode counts every storage as the CUDA caching allocator would (512-byte blocks) and an owner map
(``attribution.GroupOwner``) charges each to the group running when it was made. The step runs
``warmup_steps`` times first, so that what persists between steps (Adam moments, gradients kept with
``set_to_none=False``, cuBLAS workspaces on a real GPU) exists; then the live bytes are the *baseline*, the
peak is reset, and one more step is traced. ``step_bytes = peak - baseline`` is what the step needs on top
of what is already allocated, the same quantity ``measure_step_memory`` reads from a real GPU with
``torch.cuda.max_memory_allocated``.

What a trace cannot see is scratch a CUDA kernel takes inside one op (it never runs the kernel). The
largest common one, the staging buffer of a reduction over the batch (every Linear's bias gradient), is
modelled by ``kernel_scratch`` for CUDA targets; the rest (fused attention backward, LayerNorm backward
partials, cub) is left to ``measure_step_memory`` on the real card.

Fake CUDA tensors need a usable GPU (``fake_device_for``). Without one (a CPU-only PyTorch build, or a
CUDA build with no visible GPU) the trace runs on fake *CPU* tensors with the same shapes and dtypes,
under CUDA's autocast precision rules (``cuda_autocast``); ``StepTrace.traced_device`` and ``note`` say so.
What still differs there: ops that pick a kernel by device (scaled_dot_product_attention: flash/efficient
save a logsumexp, the math path the attention weights) and the optimizer's default implementation (pass
``foreach=True`` or ``fused=True`` to get the GPU's temporaries). Autocast must be written
``torch.autocast(device.type, ...)`` with the device ``make_step`` is given: PyTorch disables
``torch.autocast('cuda')`` on a machine without CUDA with only a warning, which would trace a bf16 step in
fp32, so the tracer raises ``AutocastUnavailable`` instead.

Modules must be built with ``device=``/``dtype=`` factory arguments (or under ``with device:``), not moved
with ``Module.to``/``.cuda()``/``.half()``: under ``FakeTensorMode`` those fail in torch 2.10-2.13
("_apply(): Couldn't swap Linear.weight", pytorch issue 148977). The tracer runs ``make_step`` and the step
under ``with device:`` so tensors made without a device land on it.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from fitdqn.memory.attribution import GroupOwner
from fitdqn.memory.cuda_autocast import CudaAutocastOnCpu
from fitdqn.memory.kernel_scratch import MODELLED_OPS, CudaShape, cuda_kernel_scratch
from fitdqn.memory.live_bytes import (
    LARGE_BLOCK_BYTES,
    AllocEvent,
    LiveBytes,
    LiveStorage,
    large_blocks,
    round_block,
)


class StepSetup(NamedTuple):
    """What ``make_step`` may return: the step, the groups of modules to attribute memory to, and groups of
    calls that are not modules (``{'replay': [(replay, 'batch_from_uniforms')]}``, ``GroupOwner.attach_calls``)."""

    step: Callable[[], Any]
    groups: dict[str, list[nn.Module]] | None = None
    calls: dict[str, list[tuple[object, str]]] | None = None


MakeStep = Callable[[int, torch.device], "StepSetup | Callable[[], Any]"]


@dataclass(frozen=True)
class StepTrace:
    """Bytes of one traced step. ``*_by_group`` dicts sum exactly to the total next to them."""

    batch_size: int
    target_device: str  # the device the step is planned for, e.g. 'cuda'
    traced_device: str  # the fake device it ran on: the target, or 'cpu' where no GPU is usable
    baseline_bytes: int  # live before the step: parameters, optimizer state, anything kept between steps
    peak_bytes: int  # highest live bytes during the step (includes the baseline)
    baseline_by_group: dict[str, int]
    peak_by_group: dict[str, int]
    peak_op: str  # the op whose output made the peak
    large_blocks_at_peak: int  # live blocks > 1 MiB at the peak: each may be up to 1 MiB bigger on a GPU
    scratch_at_peak: int  # modelled kernel scratch inside the peak (kernel_scratch), 0 if none
    allocations: int  # storages made during the traced step
    peak_storages: list[LiveStorage] = field(repr=False, default_factory=list)
    note: str = ""
    # the traced step's allocator requests in order (``record_events=True`` only; else empty): what a CUDA
    # graph capturing the step would ask of its private pool (``allocator_model.pool_usage``)
    events: list[AllocEvent] = field(repr=False, default_factory=list)
    # every change of the live bytes during the traced step (``ledger=True`` only; else None): what
    # ``TraceFit`` derives the step at other batches from
    ledger: Ledger | None = field(repr=False, default=None)

    @property
    def step_bytes(self) -> int:
        """Bytes the step needs above the baseline (what the planner budgets for the step)."""
        return self.peak_bytes - self.baseline_bytes

    @property
    def step_by_group(self) -> dict[str, int]:
        names = set(self.peak_by_group) | set(self.baseline_by_group)
        return {name: self.peak_by_group.get(name, 0) - self.baseline_by_group.get(name, 0)
                for name in sorted(names)}


def fake_device_for(target: torch.device | str) -> tuple[torch.device, str]:
    """The device to build fake tensors on for ``target``, and a note when it is a stand-in.

    Fake CUDA tensors need a usable GPU: on a CPU-only build the bindings of ``copy_``, indexing and
    ``Module.to`` fail for want of a CUDA device guard, and on a CUDA build with no visible GPU the autograd
    engine fails in backward ("hasPrimaryContext expects a valid device index").
    On a real GPU fake CUDA tensors are not safe either: ``torch.tensor(data)`` under ``FakeTensorMode``
    copies host data to the fake storage's pointer (an illegal memory access on an H200, torch 2.11). So a
    CUDA target is always traced on fake CPU tensors under CUDA's autocast rules and kernel-scratch model.
    """
    target = torch.device(target)
    if target.type == "cuda":
        return torch.device("cpu"), "traced on fake CPU tensors with CUDA autocast rules"
    return target, ""


def trace_step_memory(
    make_step: MakeStep,
    batch_size: int,
    device: torch.device | str = "cuda",
    warmup_steps: int = 1,
    fake_device: torch.device | str | None = None,
    cuda_shape: CudaShape | None = None,
    record_events: bool = False,
) -> StepTrace:
    """Trace one training step at ``batch_size`` on fake tensors and report its live bytes (module docstring).

    ``fake_device`` forces the device the fake tensors live on (default: ``fake_device_for(device)``).
    ``record_events`` keeps the traced step's ordered allocations and frees in ``StepTrace.events``.
    For a CUDA target the modelled kernel scratch (``kernel_scratch``) joins the peak; ``cuda_shape`` gives
    the target's SM count for it (default: this machine's GPU if it has one, else no SM cap: an upper bound).
    Parameters and gradients of each group's modules count toward that group's baseline; optimizer state,
    and everything else made by ``make_step`` or kept between steps, toward ``'other'``.
    A :class:`TraceSession` traces several steps and batches of one system built once.
    """
    session = TraceSession(lambda traced: lambda _name, batch: make_step(batch, traced), device, warmup_steps,
                           fake_device, cuda_shape)
    try:
        return session.trace("step", batch_size, record_events)
    finally:
        session.close()


SessionSteps = Callable[[str, int], "StepSetup | Callable[[], Any]"]  # (step name, batch) -> that step set up
MakeSession = Callable[[torch.device], SessionSteps]  # builds the system on the (fake) device, once


class TraceSession:
    """Several steps of one system traced on the same fake tensors: the system is built once, and each named
    step is warmed up once, before its first trace.

    ``make_session(device)`` builds the system on the fake device and returns ``steps(name, batch)``, which
    sets the system up for that step at that batch (no allocation of its own is needed: what it allocates
    joins the baseline) and returns it as ``make_step`` would. Each :meth:`trace` then follows the protocol
    of ``trace_step_memory``: charge parameters to their groups, take the baseline, reset the peak, one step.
    A step traced again at another batch starts from the state its earlier steps left (its persistent state
    exists already, so it is not warmed up again); fitdqn's update keeps nothing sized by the batch between
    steps, so its traces equal those of a fresh system (``tests/plan/test_build.py``). The modes are entered
    for each trace only, so the caller's own code between traces runs on real tensors. ``close`` when done.
    """

    def __init__(self, make_session: MakeSession, device: torch.device | str = "cuda", warmup_steps: int = 1,
                 fake_device: torch.device | str | None = None, cuda_shape: CudaShape | None = None):
        self.target = torch.device(device)
        if fake_device is None:
            self.traced, self.note = fake_device_for(self.target)
        else:
            self.traced = torch.device(fake_device)
            self.note = "" if self.traced.type == self.target.type else \
                f"traced on fake {self.traced.type} tensors (forced)"
        scratch = None
        if self.target.type == "cuda":
            if cuda_shape is None:
                cuda_shape = CudaShape.of_current_device() if torch.cuda.is_available() else CudaShape()
            scratch = partial(cuda_kernel_scratch, device=cuda_shape)
        self.make_session = make_session
        self.warmup_steps = warmup_steps
        self.fake_mode = FakeTensorMode()
        self.owner = GroupOwner()
        self.tracker = LiveBytes(self.traced.type, self.owner.owner, self.owner.in_backward, scratch)
        self._steps: SessionSteps | None = None
        self._warm: set[str] = set()

    def trace(self, name: str, batch_size: int, record_events: bool = False, ledger: bool = False,
              warm_up: bool = True) -> StepTrace:
        """The step ``name`` traced at ``batch_size`` (the first call builds the system); with ``ledger`` it keeps
        every change of the live bytes (``StepTrace.ledger``, for ``TraceFit``). ``warm_up=False``: the step's
        first trace runs no warm-up step (the caller checks that nothing it made persists)."""
        with self._modes():
            if self._steps is None:
                self._steps = self.make_session(self.traced)
            setup = _as_setup(self._steps(name, batch_size))
            self.owner.attach(setup.groups)
            self.owner.attach_calls(setup.calls)
            warmup = 0 if name in self._warm or not warm_up else self.warmup_steps
            self._warm.add(name)
            return _measured_step(setup, batch_size, self.target, self.traced, self.note, warmup, self.tracker,
                                  record_events, ledger)

    def build(self) -> SessionSteps:
        """``make_session``'s steps, the system built on the fake device at the first call (inside the session's
        modes, like every trace)."""
        if self._steps is None:
            with self._modes():
                self._steps = self.make_session(self.traced)
        return self._steps

    def close(self) -> None:
        """Stop listening for the fake storages' deaths (they may outlive the tracker)."""
        self.tracker.detach_finalizers()

    @contextmanager
    def _modes(self) -> Iterator[None]:
        # what lives before the trace is no garbage of the step: frozen, the collections after each step
        # (``_run``) scan only what the trace made (a full collection of a process holding torch costs ~0.4 s).
        # A caller that froze objects itself (``fitdqn plan`` does) gets these frozen with its own, and unfreezes
        # them all when it unfreezes its own.
        freeze = gc.get_freeze_count() == 0
        gc.freeze()
        emulate = CudaAutocastOnCpu() if self.target.type == "cuda" and self.traced.type == "cpu" else nullcontext()
        try:
            with (self.fake_mode, self.traced, emulate, warnings.catch_warnings(), self.owner.active(),
                  self.tracker):
                # PyTorch disables autocast with only a warning when the device type is not available
                warnings.filterwarnings("error", message=".*[Dd]isabling autocast.*")
                yield
        except UserWarning as warning:
            if "autocast" not in str(warning):
                raise
            raise AutocastUnavailable(
                f"the step turned on autocast for a device type this trace cannot run ({warning}); traced on "
                f"fake {self.traced.type} tensors: write torch.autocast(device.type, ...) with the device "
                "make_step is given") from warning
        finally:
            if freeze:
                gc.unfreeze()


class AutocastUnavailable(RuntimeError):
    """The step asked for autocast on a device type PyTorch disables here (it would trace in fp32)."""


def traced_step(make_step: MakeStep, batch_size: int, target: torch.device, traced: torch.device, note: str,
                warmup_steps: int, owner: GroupOwner, tracker: LiveBytes, record_events: bool = False
                ) -> StepTrace:
    """The protocol shared by fake traces and live (real-tensor) ones, run inside the caller's modes:
    build, warm up, charge parameters to their groups, take the baseline, reset the peak, one step."""
    setup = _as_setup(make_step(batch_size, traced))
    owner.attach(setup.groups)
    owner.attach_calls(setup.calls)
    return _measured_step(setup, batch_size, target, traced, note, warmup_steps, tracker, record_events)


def _measured_step(setup: StepSetup, batch_size: int, target: torch.device, traced: torch.device, note: str,
                   warmup_steps: int, tracker: LiveBytes, record_events: bool, ledger: bool = False) -> StepTrace:
    """Warm up, charge parameters to their groups, take the baseline, reset the peak, one step."""
    for _ in range(warmup_steps):
        _run(setup.step)
    _charge_parameters(tracker, setup.groups)
    baseline_by_group = tracker.snapshot_by_group()
    baseline = tracker.live_bytes
    tracker.reset_peak()
    allocations = tracker.allocations
    if record_events:
        tracker.start_events()
    tracker.ledger = Ledger(tracker.scratch) if ledger else None
    try:
        _run(setup.step)
    finally:
        kept, tracker.ledger = tracker.ledger, None
    events = tracker.stop_events() if record_events else []
    if traced.type == "cuda":
        torch.cuda.synchronize(traced)  # host sync: frees on the autograd threads are done
    return StepTrace(
        batch_size=batch_size,
        target_device=str(target),
        traced_device=str(traced),
        baseline_bytes=baseline,
        peak_bytes=tracker.peak_bytes,
        baseline_by_group=baseline_by_group,
        peak_by_group={name: count for name, count in tracker.peak_by_group.items() if count},
        peak_op=tracker.peak_op,
        large_blocks_at_peak=large_blocks(tracker.peak_storages),
        scratch_at_peak=tracker.scratch_at_peak,
        allocations=tracker.allocations - allocations,
        peak_storages=tracker.peak_storages,
        note=note,
        events=events,
        ledger=kept,
    )


def _as_setup(made: StepSetup | Callable[[], Any]) -> StepSetup:
    if isinstance(made, tuple) and len(made) in (2, 3):
        step, groups, calls = (*made, None) if len(made) == 2 else made
        return StepSetup(step, dict(groups or {}), dict(calls or {}))
    if callable(made):
        return StepSetup(made, {}, {})
    raise TypeError(f"make_step must return a callable or StepSetup(step, groups), not {type(made).__name__}")


def _run(step: Callable[[], Any]) -> None:
    """Run the step and drop what it returns, then collect garbage cycles so frees are not left pending."""
    step()
    gc.collect()


def _charge_parameters(tracker: LiveBytes, groups: dict[str, list[nn.Module]]) -> None:
    """Parameters, their gradients and buffers belong to their module's group, wherever they were made."""
    for name, modules in groups.items():
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                tracker.recharge(tensor, name)
                if tensor.grad is not None:
                    tracker.recharge(tensor.grad, name)


class StepFit(NamedTuple):
    """Step bytes as ``fixed + per_sample * batch``, fitted through two traces (first three fields as asked).

    ``per_sample_bytes`` is rounded up, and ``fixed_step_bytes`` set so the line passes exactly through the
    smaller batch's trace: the fit is exact there and high by less than a byte per sample above it. Per group
    likewise (so the groups' per-sample bytes may sum to a few bytes more than the total's).
    """

    fixed_step_bytes: int
    per_sample_bytes: int
    per_group_per_sample: dict[str, int]
    traces: tuple[StepTrace, StepTrace]


def fit_line(small: tuple[int, int], large: tuple[int, int]) -> tuple[int, int]:
    """(fixed, per_sample) of the line through (batch, bytes) points, slope rounded up, exact at ``small``."""
    (b1, y1), (b2, y2) = small, large
    if b2 <= b1:
        raise ValueError(f"batches must grow: got {b1} then {b2}")
    per_sample = math.ceil((y2 - y1) / (b2 - b1))
    return y1 - per_sample * b1, per_sample


def line_above(small: tuple[int, int], large: tuple[int, int]) -> tuple[int, int]:
    """``fit_line`` kept non-negative and above both points, exact at ``large`` where it must move.

    A falling line becomes the larger value, flat; one with a negative intercept (growing faster than in
    proportion) the line through 0 and ``large``. A plan adds lines as parts of one total: clamping a negative
    intercept to 0 instead would lift the whole line by that much at every batch."""
    fixed, per_sample = fit_line(small, large)
    if per_sample < 0:
        return max(small[1], large[1]), 0
    if fixed < 0:
        return 0, -(-max(large[1], 0) // large[0])
    return fixed, per_sample


def per_sample_bytes(
    make_step: MakeStep,
    batches: tuple[int, int] = (1024, 2048),
    device: torch.device | str = "cuda",
    **trace_options: Any,
) -> StepFit:
    """Trace at two batch sizes: per-sample = (step2 - step1) / (b2 - b1), fixed = step1 - per-sample * b1.

    Bytes are the step's own (``StepTrace.step_bytes``, above the baseline). The peak of a step is the
    largest of several phases (end of forward, inside backward, optimizer update), each linear in the batch
    with its own slope; pick batches in the range that will be planned, where activations dominate, and
    check the line against a trace at a third batch.
    """
    b1, b2 = sorted(batches)
    first = trace_step_memory(make_step, b1, device, **trace_options)
    second = trace_step_memory(make_step, b2, device, **trace_options)
    fixed, per_sample = fit_line((b1, first.step_bytes), (b2, second.step_bytes))
    steps1, steps2 = first.step_by_group, second.step_by_group
    group_per_sample = {name: fit_line((b1, steps1.get(name, 0)), (b2, steps2.get(name, 0)))[1]
                        for name in sorted(set(steps1) | set(steps2))}
    return StepFit(fixed, per_sample, group_per_sample, (first, second))


class NoCudaDevice(RuntimeError):
    """``measure_step_memory`` needs a real CUDA device; this machine has none (trace instead)."""


def measure_step_memory(
    make_step: MakeStep,
    batch_size: int,
    device: torch.device | str = "cuda",
    warmup_steps: int = 1,
) -> int:
    """Bytes one real step allocates above what was allocated before it, on a real CUDA device.

    Same protocol as ``trace_step_memory``: build, run ``warmup_steps`` steps, then
    ``torch.cuda.max_memory_allocated() - memory_allocated_before`` around one more step (host syncs: the
    ``torch.cuda.synchronize`` calls). Raises ``NoCudaDevice`` on a machine without one.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise NoCudaDevice(f"cannot measure a step on {device}: no CUDA device here "
                           "(torch.cuda.is_available() is False); use trace_step_memory")
    with device:
        setup = _as_setup(make_step(batch_size, device))
        for _ in range(warmup_steps):
            _run(setup.step)
        torch.cuda.synchronize(device)  # host sync: the warm-up's frees are done
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _run(setup.step)
        torch.cuda.synchronize(device)  # host sync: read the peak after the step
        return torch.cuda.max_memory_allocated(device) - before


# -- the step at other batches, from two traces ---------------------------------------------------------------
CHARGE, FREE, SCRATCH = "charge", "free", "scratch"  # the kinds of a ledger's entries


class LedgerEntry(NamedTuple):
    """One change of a traced step's live bytes (``Ledger``)."""

    kind: str  # CHARGE: a storage appears or is resized; FREE: one dies; SCRATCH: a kernel's transient scratch
    nbytes: int  # CHARGE: the storage's raw bytes (before ``round_block``); FREE of a storage made before the
    # ledger: its charged bytes (else 0: the entry it frees says); SCRATCH: the modelled scratch
    group: str
    op: str  # the op that made the storage or took the scratch ('' for a FREE)
    ref: int  # CHARGE of a resize, FREE: the entry that charged the storage (-1: it was made before the ledger)
    before: int  # CHARGE resizing a storage made before the ledger: its charged bytes then (else 0)
    resize: bool  # CHARGE: the storage existed (resized in place) rather than appeared
    inputs: tuple | None = None  # SCRATCH: (func, pytree spec, leaves) of the op's inputs, tensors by shape


class TensorShape(NamedTuple):
    """A tensor input of a SCRATCH entry, by what the scratch model reads of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    contiguous: bool


class Ledger:
    """Told by ``LiveBytes`` of every change of its live bytes during one traced step, in order, with each
    storage's raw size and, for the ops whose kernel scratch is modelled, the shapes of their inputs: all that
    the tracker's peak, its per-group split and its allocator events are computed from (``TraceFit``)."""

    def __init__(self, scratch: Callable[..., int] | None) -> None:
        self.scratch = scratch  # the tracker's scratch model (None: none)
        self.entries: list[LedgerEntry] = []
        self._charges: dict[int, int] = {}  # storage key -> the entry that charged it

    def charged(self, key: int, nbytes: int, group: str, op: str, replaced: LiveStorage | None) -> None:
        ref = self._charges.get(key, -1) if replaced is not None else -1
        before = replaced.nbytes if replaced is not None and ref < 0 else 0
        self._charges[key] = len(self.entries)
        self.entries.append(LedgerEntry(CHARGE, nbytes, group, op, ref, before, replaced is not None))

    def released(self, key: int, record: LiveStorage) -> None:
        ref = self._charges.pop(key, -1)
        self.entries.append(LedgerEntry(FREE, record.nbytes if ref < 0 else 0, record.group, "", ref, 0, False))

    def transient(self, func, args, kwargs, nbytes: int, owner_of: Callable[[], str]) -> None:
        if func not in MODELLED_OPS:
            return  # no scratch at any batch
        leaves, spec = tree_flatten((args, kwargs))
        shapes = tuple(TensorShape(tuple(leaf.shape), leaf.dtype, leaf.is_contiguous())
                       if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
        self.entries.append(LedgerEntry(SCRATCH, nbytes, owner_of(), str(func), -1, 0, False, (func, spec, shapes)))


Line = tuple[int, int]  # (a, b): a + b x batch


def _line(first: int, second: int, batches: tuple[int, int]) -> Line | None:
    """The integer line through ``(batches[0], first)`` and ``(batches[1], second)``, None if there is none."""
    slope, remainder = divmod(second - first, batches[1] - batches[0])
    return None if remainder else (first - slope * batches[0], slope)


DimLine = tuple[int, int, int]  # (a, n, k): a + ceil(n x batch / k)


def _dim_line(first: int, second: int, batches: tuple[int, int]) -> DimLine | None:
    """A dimension through ``(batches[0], first)`` and ``(batches[1], second)`` as ``a + ceil(n x batch / k)``:
    an integer line where there is one (``k = 1``), else a grid of ``ceil(batch / k)`` programs (the Triton
    kernels' partial sums have a row a program), None where neither goes through both points exactly."""
    step = math.gcd(second - first, batches[1] - batches[0])
    n, k = (second - first) // step, (batches[1] - batches[0]) // step
    if (n * batches[0]) % k:
        return None
    return first - n * batches[0] // k, n, k


def _dim_at(line: DimLine, batch_size: int) -> int:
    a, n, k = line
    return a - (-n * batch_size // k)


@dataclass(frozen=True)
class TraceFit:
    """A traced step at any batch without tracing it: every entry of its ``Ledger`` as an integer line in the
    batch (sizes), or as an integer line or a ceil-divided grid (``_dim_line``: the input shapes of the ops with
    modelled scratch), fitted through two traces of the same step (``fit_traces``). ``at(batch)`` replays the
    entries as ``LiveBytes`` counts them: the live peak, its split by group, the allocator events; each equals the
    real trace's wherever every size is affine in the batch (the scratch is recomputed by the tracker's own model
    from the fitted shapes). Two traces refuse a
    step whose changes differ between them or a size with no whole bytes per sample between them; a size that
    is not affine but has whole bytes per sample through both points cannot be told from two traces, so a step
    planned this way is checked against real traces at other batches (``tests/plan/test_trace_fit.py``)."""

    batches: tuple[int, int]
    template: StepTrace  # the first trace: devices, baseline, note
    entries: tuple[LedgerEntry, ...]
    lines: tuple[tuple, ...]  # per entry: (nbytes line, before line[, per input leaf: None or its dims' lines])
    scratch: Callable[..., int] | None
    large_at_baseline: int = 0  # live blocks over 1 MiB before the step (the tracker counts them at its peak)

    def at(self, batch_size: int) -> StepTrace | None:
        """The step at ``batch_size``, None where a fitted size would be negative there (trace it instead)."""

        def value(line: Line) -> int:
            return line[0] + line[1] * batch_size

        live = peak = scratch_at_peak = large = large_at_peak = allocations = 0
        groups: dict[str, int] = {}
        peak_groups: dict[str, int] = {}
        peak_op = "(no allocation since the reset)"
        sizes = [0] * len(self.entries)
        logged: dict[int, int] = {}  # entry of a live storage -> the serial of its logged 'alloc'
        events: list[AllocEvent] = []
        serials = itertools.count()
        for index, (entry, line) in enumerate(zip(self.entries, self.lines, strict=True)):
            if entry.kind == CHARGE:
                raw = value(line[0])
                if raw < 0:
                    return None
                nbytes = round_block(raw)
                if entry.resize:
                    old = sizes[entry.ref] if entry.ref >= 0 else value(line[1])
                    if nbytes == old:  # the tracker sees no change: the storage keeps its block
                        sizes[index] = old
                        if entry.ref in logged:
                            logged[index] = logged.pop(entry.ref)
                        continue
                    live -= old
                    groups[entry.group] -= old
                    large -= old > LARGE_BLOCK_BYTES
                else:
                    allocations += 1
                sizes[index] = nbytes
                live += nbytes
                groups[entry.group] = groups.get(entry.group, 0) + nbytes
                large += nbytes > LARGE_BLOCK_BYTES
                if live > peak:
                    peak, peak_groups, peak_op, scratch_at_peak, large_at_peak = live, dict(groups), entry.op, 0, large
                previous = logged.pop(entry.ref, None) if entry.resize and entry.ref >= 0 else None
                if nbytes:
                    logged[index] = next(serials)
                    events.append(AllocEvent("alloc", logged[index], nbytes))
                if previous is not None:
                    events.append(AllocEvent("free", previous, sizes[entry.ref]))
            elif entry.kind == FREE:
                nbytes = sizes[entry.ref] if entry.ref >= 0 else value(line[0])
                serial = logged.pop(entry.ref, None) if entry.ref >= 0 else None
                if serial is not None:
                    events.append(AllocEvent("free", serial, nbytes))
                live -= nbytes
                groups[entry.group] = groups.get(entry.group, 0) - nbytes
                large -= nbytes > LARGE_BLOCK_BYTES
            else:
                nbytes = round_block(self._scratch_at(entry, line, batch_size))
                if nbytes:
                    serial = next(serials)
                    events += [AllocEvent("alloc", serial, nbytes), AllocEvent("free", serial, nbytes)]
                if nbytes and live + nbytes > peak:
                    peak, peak_groups, scratch_at_peak = live + nbytes, dict(groups), nbytes
                    peak_groups[entry.group] = peak_groups.get(entry.group, 0) + nbytes
                    peak_op, large_at_peak = f"scratch of {entry.op}", large + (nbytes > LARGE_BLOCK_BYTES)
        base = self.template.baseline_by_group
        peak_by_group = {name: base.get(name, 0) + peak_groups.get(name, 0) for name in {*base, *peak_groups}}
        template = self.template
        return StepTrace(
            batch_size=batch_size, target_device=template.target_device, traced_device=template.traced_device,
            baseline_bytes=template.baseline_bytes, peak_bytes=template.baseline_bytes + peak,
            baseline_by_group=dict(base), peak_by_group={name: n for name, n in peak_by_group.items() if n},
            peak_op=peak_op, large_blocks_at_peak=self.large_at_baseline + large_at_peak,
            scratch_at_peak=scratch_at_peak, allocations=allocations, note=template.note, events=events)

    def _scratch_at(self, entry: LedgerEntry, line: tuple, batch_size: int) -> int:
        if self.scratch is None:
            return line[0][0] + line[0][1] * batch_size
        func, spec, shapes = entry.inputs
        leaves = []
        for shape, dims in zip(shapes, line[2], strict=True):
            if dims is None:
                leaves.append(shape)
                continue
            size = [_dim_at(dim, batch_size) for dim in dims]
            if min(size, default=0) < 0:
                return 0
            tensor = torch.empty(size, dtype=shape.dtype, device="meta")
            leaves.append(tensor if shape.contiguous or tensor.dim() < 2 else tensor.mT)
        args, kwargs = tree_unflatten(leaves, spec)
        return self.scratch(func, args, kwargs)


def fit_traces(first: StepTrace, second: StepTrace) -> tuple[TraceFit | None, str]:
    """The ``TraceFit`` through two traces of one step made with ``ledger=True``, or None and why not: the two
    must make the same changes in the same order (kinds, groups, ops, which storage each frees or resizes) from
    the same baseline, with integer lines through every size and scratch input shape."""
    if first.ledger is None or second.ledger is None:
        return None, "a trace kept no ledger"
    if first.batch_size > second.batch_size:
        first, second = second, first
    batches = (first.batch_size, second.batch_size)
    if batches[0] == batches[1]:
        return None, f"both traces are at batch {batches[0]}"
    if (first.baseline_bytes, first.baseline_by_group) != (second.baseline_bytes, second.baseline_by_group):
        return None, f"the baselines at batch {batches[0]} and {batches[1]} differ"
    ones, twos = first.ledger.entries, second.ledger.entries
    if len(ones) != len(twos):
        return None, f"the steps at batch {batches[0]} and {batches[1]} make {len(ones)} and {len(twos)} changes"
    lines = []
    for index, (one, two) in enumerate(zip(ones, twos, strict=True)):
        where = f"change {index} ({one.kind} by {one.op or 'a free'})"
        if (one.kind, one.group, one.op, one.ref, one.resize) != (two.kind, two.group, two.op, two.ref, two.resize):
            return None, f"{where} differs between batch {batches[0]} and {batches[1]}"
        line = (_line(one.nbytes, two.nbytes, batches), _line(one.before, two.before, batches))
        recomputed = one.kind == SCRATCH and first.ledger.scratch is not None  # by the model, from its inputs
        if (line[0] is None and not recomputed) or line[1] is None:
            return None, f"{where}: its bytes are not affine in the batch"
        if one.kind == SCRATCH:
            (func, spec, shapes), (func2, spec2, shapes2) = one.inputs, two.inputs
            if func != func2 or spec != spec2 or len(shapes) != len(shapes2):
                return None, f"{where}: its inputs differ between batch {batches[0]} and {batches[1]}"
            dims = []
            for a, b in zip(shapes, shapes2, strict=True):
                if not isinstance(a, TensorShape) or not isinstance(b, TensorShape):
                    if a != b:
                        return None, f"{where}: its inputs differ between batch {batches[0]} and {batches[1]}"
                    dims.append(None)
                    continue
                fitted = tuple(_dim_line(x, y, batches) for x, y in zip(a.shape, b.shape, strict=False))
                if (a.dtype, a.contiguous, len(a.shape)) != (b.dtype, b.contiguous, len(b.shape)) or None in fitted:
                    return None, f"{where}: its input shapes are neither affine in the batch nor a ceil-divided grid"
                dims.append(fitted)
            line = (*line, tuple(dims))
        lines.append(line)
    fit = TraceFit(batches, first, tuple(ones), tuple(lines), first.ledger.scratch)
    again = fit.at(first.batch_size)
    if again is None:
        return None, f"a size fitted through batch {batches[0]} and {batches[1]} is negative at {batches[0]}"
    large = first.large_blocks_at_peak - again.large_blocks_at_peak
    return dataclasses.replace(fit, large_at_baseline=large), ""


def describe(trace: StepTrace, top: int = 8) -> str:
    """A few lines for people: totals, groups, the biggest storages live at the peak."""
    lines = [f"batch {trace.batch_size} on {trace.target_device} (traced on {trace.traced_device}): "
             f"baseline {trace.baseline_bytes} B, peak {trace.peak_bytes} B, step {trace.step_bytes} B "
             f"at {trace.peak_op}"]
    lines += [f"  {name:12s} step {count:>12d} B" for name, count in trace.step_by_group.items()]
    for record in sorted(trace.peak_storages, key=lambda r: -r.nbytes)[:top]:
        lines.append(f"  {record.nbytes:>12d} B {record.group:10s} {record.phase:8s} "
                     f"{str(record.dtype):15s} {list(record.shape)} <- {record.op}")
    if trace.note:
        lines.append(f"  note: {trace.note}")
    return "\n".join(lines)
