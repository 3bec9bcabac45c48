from fitdqn.config import Config
from fitdqn.device import load_profiles, what_if
from fitdqn.device.sizes import format_bytes
from fitdqn.memory.component import Component
from fitdqn.plan.planner import make_plan
from fitdqn.train.memory_check import backtest_growth_note, peak_memory_row

MIB = 2**20


def test_run_peak_compares_reserved_bytes_with_the_plan_less_the_drivers_own():
    components = [Component("replay", 100 * MIB, 0, "r"), Component("cuda_driver", 300 * MIB, 0, "d"),
                  Component("dqn", 10 * MIB, 1000, "n")]
    plan = make_plan(what_if("Test GPU", 8 * 2**30, 8 * 2**30), load_profiles()["default"], Config().budget,
                     components, 1024)
    row = peak_memory_row(plan, reserved_peak=plan.planned_bytes - 300 * MIB)
    assert row["planned_bytes"] == 110 * MIB + 1000 * plan.batch_size
    assert row["difference"] == 0.0 and "reserved" in row["phase"]


def test_backtest_growth_is_said_only_when_the_pool_grew():
    assert backtest_growth_note(0) is None
    note = backtest_growth_note(3 * 2**20)
    assert format_bytes(3 * 2**20) in note and "evaluate.segments" in note
