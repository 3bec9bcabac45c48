"""`fitdqn plan --calibrate`: the maths (CPU), the live-bytes tracker on real tensors (CPU), the GPU run (CUDA)."""

import dataclasses

import pytest
import torch

from fitdqn.config import BudgetConfig, Config, for_device, with_overrides
from fitdqn.device.probe import DeviceInfo, what_if
from fitdqn.device.profiles import load_profiles
from fitdqn.memory.component import Component
from fitdqn.memory.overhead import cuda_driver_component, cuda_overhead_component
from fitdqn.memory.trace import trace_step_memory
from fitdqn.plan.build import make_train_step
from fitdqn.plan.calibrate import (
    GROUPS,
    STEP_COMPONENTS,
    Calibration,
    CalibrationError,
    apportion,
    calibrated_components,
    calibrated_plan,
    comparison_rows,
    driver_overhead,
    group_slopes,
    live_bytes_step,
    parse_batches,
    require_cuda,
)
from fitdqn.plan.planner import make_plan

GIB = 2**30
TINY = {
    "market.data": "synthetic", "market.synthetic_bars": 1200, "market.episode_length": 32,
    "net.window": 4, "net.trunk_hidden": 64, "net.d_model": 32, "net.stream_hidden": 32, "net.num_atoms": 11,
    "net.iqn_embedding": 16, "net.iqn_quantiles": 8, "net.iqn_act_quantiles": 8, "net.iql_hidden": 32,
    "collect.num_envs": 16, "replay.capacity": 4096, "replay.min_fill": 128, "learn.precision": "fp32",
}


@pytest.mark.parametrize("total, weights", [
    (1000, {"a": 1, "b": 1, "c": 1}),
    (7, {"a": 5, "b": 3, "c": 0, "d": 2}),
    (123457, {"replay": 90, "her": 12, "dqn": 3000, "attention": 2100, "iqn": 12000, "iql": 5, "batch": 4400}),
    (0, {"a": 3, "b": 4}),
])
def test_apportion_sums_exactly_and_keeps_proportions(total, weights):
    parts = apportion(total, weights)
    assert list(parts) == list(weights)
    assert sum(parts.values()) == total
    weight_sum = sum(w for w in weights.values() if w > 0)
    for name, weight in weights.items():
        assert abs(parts[name] - total * max(weight, 0) / weight_sum) < 1  # largest remainder: off by < 1
    assert all(parts[name] == 0 for name, weight in weights.items() if weight <= 0)


def test_apportion_all_zero_weights_gives_everything_to_the_first():
    assert apportion(10, {"x": 0, "y": 0}) == {"x": 10, "y": 0}
    with pytest.raises(ValueError):
        apportion(10, {})


def test_driver_overhead_is_free_drop_minus_reserved_growth():
    assert driver_overhead(10 * GIB, 9 * GIB, 0, 768 * 2**20) == 256 * 2**20
    assert driver_overhead(10 * GIB, 10 * GIB, 0, GIB) == 0  # another process freed memory: never negative


def plan_components() -> list[Component]:
    return [
        Component("replay", 3 * GIB, 100, "replay"),
        Component("her", 0, 12, "her"),
        Component("collector", 200 * 2**20, 0, "collector"),
        cuda_overhead_component((9, 0)),
        Component("dqn", 10 * 2**20, 3000, "dqn"),
        Component("attention", 5 * 2**20, 2100, "attention"),
        Component("iqn", 6 * 2**20, 12000, "iqn"),
        Component("iql", 2**20, 5, "iql"),
        Component("batch", 4096, 4400, "batch"),
    ]


def test_calibrated_components_scale_to_the_measured_slope():
    components = plan_components()
    traced = {c.name: c for c in components}
    measured, extra, driver = 43210, 3 * 2**20, 300 * 2**20
    out = {c.name: c for c in calibrated_components(components, measured, extra, driver, "test run")}
    assert list(out) == [c.name for c in components] + ["cuda_driver"]
    assert sum(out[name].per_sample_bytes for name in STEP_COMPONENTS) == measured
    factor = measured / sum(traced[name].per_sample_bytes for name in STEP_COMPONENTS)
    for name in STEP_COMPONENTS:
        assert abs(out[name].per_sample_bytes - traced[name].per_sample_bytes * factor) < 1
        assert "test run" in out[name].derived_from and f"x{factor:.3f}" in out[name].derived_from
        if name != "batch":
            assert out[name].fixed_bytes == traced[name].fixed_bytes
    assert out["batch"].fixed_bytes == traced["batch"].fixed_bytes + extra
    assert out["cuda_overhead"] == traced["cuda_overhead"]  # the workspaces: unchanged
    assert out["cuda_driver"].fixed_bytes == driver and "test run" in out["cuda_driver"].derived_from
    assert out["collector"] == traced["collector"]


@pytest.mark.parametrize("held, measured, expected", [(300, 1000, 1000), (3000, 1000, 3000), (None, 1000, 1000)])
def test_calibration_keeps_the_larger_of_the_profile_and_measured_driver_bytes(held, measured, expected):
    components = [cuda_overhead_component((9, 0)), Component("dqn", 0, 10, "dqn")]
    if held is not None:
        components.append(cuda_driver_component(held, "by a profile"))
    out = {c.name: c for c in calibrated_components(components, 20, 0, measured, "measured by --calibrate")}
    assert out["cuda_overhead"] == components[0]
    assert out["cuda_driver"].fixed_bytes == expected
    assert ("more than" in out["cuda_driver"].derived_from) == (held is not None and held >= measured)


def calibration(**changes) -> Calibration:
    values = dict(
        device_name="Test GPU", batches=(64, 256), replay_capacity=4096 * 64,
        measured_step_bytes=(64 * 30000 + 10 * 2**20, 256 * 30000 + 10 * 2**20),
        traced_step_bytes=(64 * 21617, 256 * 21617), measured_fixed=10 * 2**20, measured_per_sample=30000,
        traced_fixed=0, traced_per_sample=21617, traced_by_group={"dqn": 3000, "attention": 2100, "iqn": 12000,
                                                                   "iql": 5, "other": 4512},
        live_by_group={"dqn": 3100, "attention": 2500, "iqn": 13000, "iql": 5, "other": 5000},
        live_total_per_sample=23605, live_note="test", free_before=70 * GIB, free_after=69 * GIB,
        reserved_before=0, reserved_after=768 * 2**20, seconds=1.0,
    )
    values.update(changes)
    return Calibration(**values)


def test_calibrated_plan_uses_the_measured_total_and_checks_the_fit_again():
    device = dataclasses.replace(what_if("Test GPU", 80 * GIB, 70 * GIB), compute_capability=(9, 0))
    profile = load_profiles()["default"]
    budget = BudgetConfig(batch_size=0, max_batch=1 << 22)
    traced = make_plan(device, profile, budget, plan_components(), 123)
    cal = calibration()
    plan = calibrated_plan(traced, cal, with_overrides(Config(), {"budget.batch_size": 0, "budget.max_batch": 1 << 22}))
    assert plan.per_sample_bytes == 30000
    assert plan.fixed_bytes == traced.fixed_bytes + cal.extra_fixed + cal.driver_bytes
    assert cal.extra_fixed == 10 * 2**20 and cal.driver_bytes == 256 * 2**20
    assert plan.batch_size == (device.free_bytes - plan.fixed_bytes - plan.headroom_bytes) // 30000
    assert plan.batch_size < traced.batch_size
    assert plan.replay_capacity == 123 and any("calibrated" in note for note in plan.notes)
    rows = {row["group"]: row for row in comparison_rows(traced, plan, cal)}
    assert rows["step"]["measured"] == 30000 and rows["step"]["calibrated"] == 30000
    assert rows["total"]["planned"] == traced.per_sample_bytes and rows["total"]["calibrated"] == 30000
    assert rows["unattributed (scratch, rounding)"]["measured"] == 30000 - 23605
    assert rows["other (batch)"]["planned"] == 4400
    assert rows["replay"]["planned"] == 100 and rows["her"]["planned"] == 12
    groups = ("dqn", "attention", "iqn", "iql", "replay", "her", "other (batch)")
    assert sum(rows[g]["calibrated"] for g in groups) == 30000
    json_record = cal.to_json()
    assert json_record["driver_bytes"] == cal.driver_bytes and json_record["batches"] == [64, 256]


def test_components_outside_the_step_keep_their_per_sample_bytes():
    device = dataclasses.replace(what_if("Test GPU", 80 * GIB, 70 * GIB), compute_capability=(9, 0))
    components = [*plan_components(), Component("cuda_graphs", 20 * 2**20, 2000, "graph pool model")]
    traced = make_plan(device, load_profiles()["default"], BudgetConfig(batch_size=0), components, 123)
    plan = calibrated_plan(traced, calibration(), with_overrides(Config(), {"budget.batch_size": 0}))
    assert plan.per_sample_bytes == 30000 + 2000
    graphs = next(c for c in plan.components if c.name == "cuda_graphs")
    assert graphs == components[-1]
    rows = {row["group"]: row for row in comparison_rows(traced, plan, calibration())}
    assert rows["cuda_graphs (not measured)"]["planned"] == rows["cuda_graphs (not measured)"]["calibrated"] == 2000
    assert rows["step"]["calibrated"] == 30000 and rows["total"]["calibrated"] == 32000


def test_print_calibration_shows_every_group(capsys):
    from rich.console import Console

    from fitdqn.plan.calibrate import print_calibration

    device = dataclasses.replace(what_if("Test GPU", 80 * GIB, 70 * GIB), compute_capability=(9, 0))
    traced = make_plan(device, load_profiles()["default"], BudgetConfig(batch_size=0), plan_components(), 123)
    cal = calibration(live_by_group=None, live_total_per_sample=None, live_note="tracker failed (test)")
    plan = calibrated_plan(traced, cal, with_overrides(Config(), {"budget.batch_size": 0}))
    print_calibration(traced, plan, cal, Console(width=160))
    out = capsys.readouterr().out
    for text in ("dqn", "attention", "iqn", "iql", "replay", "her", "other (batch)", "step", "total",
                 "driver-side bytes",
                 "tracker failed (test)", "29.3 KiB"):
        assert text in out, text
    assert "unattributed" not in out  # no live split: nothing to subtract


def test_live_bytes_on_real_cpu_tensors_match_the_fake_trace():
    """The tracker runs on real tensors: on the CPU it sees exactly what the fake-tensor trace sees."""
    config = for_device(with_overrides(Config(), TINY), "cpu")
    make_step = make_train_step(config, 1200, 16 * 64)
    # batch >= 32: at 16 this tiny net's peak is in the C51 head's folded-weight build (batch-independent bytes)
    first, second = live_bytes_step(make_step, 32, "cpu"), live_bytes_step(make_step, 48, "cpu")
    fake = trace_step_memory(make_step, 48, "cpu")
    assert second.step_bytes == fake.step_bytes > first.step_bytes > 0
    assert second.step_by_group == fake.step_by_group
    assert {"dqn", "attention", "iqn", "iql", "replay", "other"} <= set(second.step_by_group) <= set(GROUPS)
    assert sum(second.peak_by_group.values()) == second.peak_bytes
    slopes = group_slopes(first, second)
    assert slopes["iqn"] > 0 and slopes["dqn"] > 0 and slopes["other"] > 0


def test_calibrate_flow_on_cpu_with_the_cuda_calls_stubbed(monkeypatch):
    """Every line of ``calibrate`` but the CUDA readings runs here: trace, live split, driver bytes, the line."""
    import fitdqn.plan.calibrate as calibrate_module

    measured = {}

    def fake_measure(make_step, batch, device):
        measured[batch] = 30000 * batch + 10 * 2**20
        return measured[batch]

    free, reserved = iter([10 * GIB, 9 * GIB]), iter([0, 512 * 2**20])
    monkeypatch.setattr(calibrate_module, "require_cuda", lambda device, what="": None)
    monkeypatch.setattr(calibrate_module, "measure_step_memory", fake_measure)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (next(free), 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: next(reserved))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    config = with_overrides(Config(), TINY)
    device = DeviceInfo("CPU: test", "cpu", None, 8 * GIB, 4 * GIB, None, True)
    cal = calibrate_module.calibrate(config, device, 1200, (16, 48))
    assert sorted(measured) == [16, 48] and cal.batches == (16, 48)
    assert cal.measured_per_sample == 30000 and cal.measured_fixed == 10 * 2**20
    assert cal.driver_bytes == 512 * 2**20
    assert cal.replay_capacity == 64 * 16
    assert cal.live_by_group is not None, cal.live_note
    assert set(cal.live_by_group) == set(cal.traced_by_group) == set(GROUPS)
    assert cal.traced_per_sample > 0 and cal.live_total_per_sample > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_require_cuda_is_a_clear_error_without_a_gpu():
    cpu = DeviceInfo("CPU: test", "cpu", None, 8 * GIB, 4 * GIB, None, True)
    with pytest.raises(CalibrationError, match="--calibrate measures the step on a CUDA GPU; this machine has none"):
        require_cuda(cpu)
    with pytest.raises(CalibrationError, match="--gpu"):
        require_cuda(what_if("h100", 80 * GIB, None))


def test_parse_batches():
    assert parse_batches("256,64") == (64, 256)
    for bad in ("64", "64,x", "0,64", "64,64"):
        with pytest.raises(CalibrationError):
            parse_batches(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_calibrate_on_the_gpu():
    from fitdqn.device.probe import probe
    from fitdqn.plan.build import PlanInputs, plan_for_device
    from fitdqn.plan.calibrate import calibrate

    config = for_device(with_overrides(Config(), {**TINY, "learn.precision": "auto", "collect.num_envs": 256,
                                                  "budget.batch_size": 0}), "cuda")
    device = probe("cuda")
    inputs = PlanInputs.from_config(config)
    cal = calibrate(config, device, inputs.num_bars, (64, 256))
    assert cal.measured_per_sample > 0 and cal.driver_bytes >= 0
    assert cal.live_by_group is not None, cal.live_note
    traced = plan_for_device(config, device, inputs)
    plan = calibrated_plan(traced, cal, config)
    step = [c.per_sample_bytes for c in plan.components if c.name in STEP_COMPONENTS]
    assert sum(step) == cal.measured_per_sample  # the step's slope is the measured one
    untouched = {c.name: c.per_sample_bytes for c in traced.components if c.name not in STEP_COMPONENTS}
    assert {c.name: c.per_sample_bytes for c in plan.components if c.name not in STEP_COMPONENTS} == untouched
    # the graph pool beyond the step is planned, not measured: it stays on top of the measured step
    assert plan.per_sample_bytes == cal.measured_per_sample + sum(untouched.values())
