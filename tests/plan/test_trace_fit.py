"""The update at any batch derived from two traces (``memory.trace.TraceFit``) equals the update traced there, event by
event, for the default config planned for a CUDA card (CUDA autocast and kernel-scratch model on fake CPU tensors)
and for the CPU; a step whose changes differ between batches, or whose sizes are not affine in the batch, is not
derived (the planner traces it at each batch and says why)."""

import pytest
import torch

from fitdqn.config import Config, with_overrides
from fitdqn.device import what_if
from fitdqn.device.probe import DeviceInfo
from fitdqn.memory.trace import TraceSession, _dim_at, _dim_line, fit_traces
from fitdqn.plan import build

CHECKED = (1024, 3000, 12345, 16384)
CPU = DeviceInfo(name="CPU", kind="cpu", index=None, total_bytes=None, free_bytes=None, compute_capability=None,
                 bf16=True)


def keyed(events):
    """The events with their keys renumbered in order of appearance (a trace's serials continue its session's)."""
    serials = {}
    return [(op, serials.setdefault(key, len(serials)), nbytes) for op, key, nbytes in events]


def same_step(derived, traced) -> None:
    assert derived.step_bytes == traced.step_bytes
    assert derived.step_by_group == traced.step_by_group
    assert derived.peak_by_group == traced.peak_by_group
    assert (derived.peak_op, derived.scratch_at_peak, derived.allocations, derived.large_blocks_at_peak) == (
        traced.peak_op, traced.scratch_at_peak, traced.allocations, traced.large_blocks_at_peak)
    assert keyed(derived.events) == keyed(traced.events)


@pytest.mark.parametrize(("device", "first", "overrides"), [
    # the operators' fake kernels, which need no Triton: what a GPU machine traces, here on every machine
    (what_if("rtx3050", None, int(1.7 * 2**30)), 4096, {}),
    (CPU, 512, {}),
], ids=["cuda", "cpu"])
def test_the_derived_update_equals_the_traced_one_event_by_event(device, first, overrides):
    """As the planner fits it (``fit_update``: its first batch, without a warm-up, and twice that), at the first
    batch the plan asks for on each (the graph pool's 4096 on a graphed GPU, 512 on the CPU)."""
    config, _ = build.trace_config(with_overrides(Config(), overrides), device)
    shape = build._cuda_shape(device) if device.kind == "cuda" else None
    session = TraceSession(build.make_system_session(config, 2000, 2**15), device.kind, cuda_shape=shape)
    try:
        session.trace(build.COLLECT, config.collect.num_envs)  # as in a plan: the collector first
        fit, at_first, why = build.fit_update(session, first)
        assert fit is not None, why
        assert fit.batches == (first, 2 * first)
        same_step(fit.at(first), at_first)
        for batch in (first, 2 * first, *CHECKED):  # warm traces, also at the fit's own batches
            same_step(fit.at(batch), session.trace(build.UPDATE, batch, True))
    finally:
        session.close()


def toy_session(allocate):
    """A step that allocates ``allocate(batch)`` (a list of element counts) and a Linear's activations."""

    def make_session(device):
        layer = torch.nn.Linear(8, 8, device=device)

        def steps(name, batch):
            def step():
                kept = [torch.empty(n, device=device) for n in allocate(batch)]
                layer(torch.ones(batch, 8, device=device)).sum().backward()
                return kept

            return step

        return steps

    return TraceSession(make_session, "cpu")


@pytest.mark.parametrize(("allocate", "reason"), [
    (lambda batch: [batch] * (1 + (batch > 100)), "changes"),  # one more allocation at the larger batch
    # the same changes, a size with no whole bytes per sample between the two batches (a size that is not affine
    # but has whole bytes per sample through both, such as one quadratic in the batch, cannot be told from two
    # traces: the test above checks the configs that are planned)
    (lambda batch: [batch // 3], "not affine"),
])
def test_a_step_that_is_not_affine_in_the_batch_is_not_derived(allocate, reason):
    session = toy_session(allocate)
    try:
        traces = [session.trace("step", batch, ledger=True) for batch in (64, 256)]
    finally:
        session.close()
    fit, why = fit_traces(*traces)
    assert fit is None and reason in why


def test_a_toy_step_is_derived_exactly():
    session = toy_session(lambda batch: [3 * batch + 5, 7])
    try:
        fit, why = fit_traces(*(session.trace("step", batch, True, ledger=True) for batch in (64, 256)))
        assert fit is not None, why
        for batch in (1, 100, 1000):
            same_step(fit.at(batch), session.trace("step", batch, True))
    finally:
        session.close()


def test_a_first_step_that_makes_lasting_state_is_traced_again_warm():
    """``fit_update`` traces its first batch without a warm-up; a step whose first run makes what persists (here a
    buffer, as a lazily made optimizer state would be) is traced again once warm, and that trace is the one kept."""

    def make_session(device):
        persistent = []
        layer = torch.nn.Linear(8, 8, device=device)

        def steps(name, batch):
            def step():
                if not persistent:
                    persistent.append(torch.zeros(1000, device=device))  # made once, kept
                layer(torch.ones(batch, 8, device=device)).sum().backward()

            return step

        return steps

    session = TraceSession(make_session, "cpu")
    try:
        fit, first, why = build.fit_update(session, 64)
        assert fit is not None, why
        warm = session.trace(build.UPDATE, 64, True)
        same_step(first, warm)
        same_step(fit.at(64), warm)
    finally:
        session.close()


def test_the_stand_in_collector_is_warm_when_built():
    """The planner traces the collector with no warm-up step: the stand-in system ran it to fill its replay."""
    device = what_if("rtx3050", None, int(1.7 * 2**30))
    config, _ = build.trace_config(Config(), device)
    summaries = []
    for warm_up in (True, False):
        session = TraceSession(build.make_system_session(config, 2000, 2**15), "cuda",
                               cuda_shape=build._cuda_shape(device))
        try:
            trace = session.trace(build.COLLECT, config.collect.num_envs, True, warm_up=warm_up)
        finally:
            session.close()
        summaries.append((trace.baseline_bytes, trace.step_by_group, keyed(trace.events)))
    assert summaries[0] == summaries[1]


def test_a_grid_dimension_is_fitted_as_ceil_divided_programs():
    """A reduction's input of ``ceil(B / 64)`` rows (a Triton kernel's partial sums, a row a program) through
    batches 4096 and 8192 is the grid at every batch; an integer line stays one; a dimension that is neither is
    refused."""
    grid = _dim_line(64, 128, (4096, 8192))
    assert grid == (0, 1, 64)
    assert [_dim_at(grid, batch) for batch in (1, 64, 65, 3000, 12345)] == [1, 1, 2, 47, 193]
    assert _dim_line(4096 + 7, 8192 + 7, (4096, 8192)) == (7, 1, 1)
    assert _dim_line(20, 20, (4096, 8192)) == (20, 0, 1)
    assert _dim_line(1, 2, (3, 5)) is None  # half a row a sample from an odd batch: no whole grid through both
