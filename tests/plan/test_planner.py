import pytest

from fitdqn.config import BudgetConfig
from fitdqn.device import load_profiles, match_profile, what_if
from fitdqn.memory import Component
from fitdqn.plan.planner import BatchSearch, InfeasiblePlan, make_plan

GIB = 2**30


def plan(free, components, batch_size=0, gpu="Some Unknown GPU", **budget):
    device = what_if(gpu, None, free)
    profile = match_profile(gpu, load_profiles())
    return make_plan(device, profile, BudgetConfig(batch_size=batch_size, **budget), components)


def parts(replay_fixed=0, per_sample=1000):
    return [
        Component("iqn", 10_000, per_sample // 2, "test"),
        Component("replay", replay_fixed, 0, "test"),
        Component("dqn", 50_000, per_sample - per_sample // 2, "test"),
        Component("collector", 7_000, 0, "test"),
    ]


def test_components_sum_and_allocation_order():
    result = plan(GIB, parts(replay_fixed=GIB // 2))
    assert [c.name for c in result.components] == ["replay", "collector", "dqn", "iqn"]
    assert result.fixed_bytes == GIB // 2 + 67_000
    assert result.per_sample_bytes == 1000
    assert result.planned_bytes == result.fixed_bytes + 1000 * result.batch_size


def test_the_plan_hands_the_trainer_typed_budgets():
    device = what_if("Some Unknown GPU", None, GIB)
    profile = match_profile(device.name, load_profiles())
    components = [*parts(replay_fixed=GIB // 4), Component("cuda_graphs", 22 * 2**20, 400, "test")]
    result = make_plan(device, profile, BudgetConfig(batch_size=0), components, 4096)
    budgets = result.budgets
    assert budgets.replay_capacity == 4096 and budgets.batch_size == result.batch_size
    assert budgets.graph_pool_fixed_bytes == 22 * 2**20
    assert budgets.update_bytes == 1400 * result.batch_size


def test_batch_comes_last_from_what_is_left():
    free = GIB
    result = plan(free, parts(replay_fixed=int(0.7 * free)), headroom_fraction=0.05)
    remaining = free - int(0.7 * free) - 67_000 - int(0.05 * free)
    assert result.remaining_bytes == remaining
    assert result.max_fitting_batch == remaining // 1000
    assert result.batch_size == min(remaining // 1000, 16384)
    assert result.batch_source == "auto"


def test_auto_batch_is_clamped():
    assert plan(100 * GIB, parts(per_sample=10)).batch_size == 16384
    tight = plan(GIB, parts(replay_fixed=GIB // 2, per_sample=10**7), min_batch=8)
    assert 8 <= tight.batch_size == tight.max_fitting_batch < 64


def test_auto_refused_when_min_batch_does_not_fit():
    with pytest.raises(InfeasiblePlan, match="min_batch"):
        plan(GIB, parts(replay_fixed=GIB // 2, per_sample=10**7))


def test_user_batch_checked_and_refused_with_every_consumer():
    assert plan(GIB, parts(), batch_size=1000).batch_source == "user"
    with pytest.raises(InfeasiblePlan) as refusal:
        plan(GIB, parts(replay_fixed=GIB // 2), batch_size=10**6)
    message = str(refusal.value)
    assert all(name in message for name in ("replay", "collector", "dqn", "iqn", "--batch-size 0"))


def test_profile_batch_used_when_it_fits_and_refused_when_not():
    assert plan(GIB, parts(), batch_size=-1, gpu="h100").batch_size == 8192
    with pytest.raises(InfeasiblePlan, match="'h100' profile"):
        plan(GIB, parts(replay_fixed=GIB // 2, per_sample=100_000), batch_size=-1, gpu="h100")


def test_fixed_consumers_beyond_free_memory_are_refused_before_anything():
    with pytest.raises(InfeasiblePlan, match="fixed consumers need"):
        plan(GIB, parts(replay_fixed=2 * GIB))


def test_unknown_memory_keeps_the_profile_and_refuses_auto():
    device = what_if("Some Unknown GPU", None, None)
    profile = match_profile(device.name, load_profiles())
    assert make_plan(device, profile, BudgetConfig(), parts()).batch_size == 256
    with pytest.raises(InfeasiblePlan, match="--free-memory"):
        make_plan(device, profile, BudgetConfig(batch_size=0), parts())


def test_an_auto_batch_never_exceeds_what_the_replay_can_serve():
    device = what_if("Some Unknown GPU", None, GIB)
    profile = load_profiles()["default"]
    capped = make_plan(device, profile, BudgetConfig(batch_size=0), parts(), replay_capacity=4096 * 3,
                       sampleable=4096)
    assert capped.max_fitting_batch > 16384 and capped.batch_size == 4096
    assert any("capped at 4096, what the replay can serve" in note for note in capped.notes)
    assert not any("clamped to budget.max_batch" in note for note in capped.notes)
    # a batch the user asks for beyond it is refused: the run would make no update
    with pytest.raises(InfeasiblePlan, match="at most 4096"):
        make_plan(device, profile, BudgetConfig(batch_size=8192), parts(), 4096 * 3, sampleable=4096)


def test_the_replays_sampleable_capacity_and_a_replay_that_never_fills():
    from fitdqn.config import Config, with_overrides
    from fitdqn.plan.build import sampleable_capacity

    config = with_overrides(Config(), {"collect.num_envs": 1024, "learn.n_step": 3, "replay.min_fill": 1000})
    # the last n_step - 1 lockstep steps wait for their n-step window (replay.sampler.sampleable_steps)
    assert sampleable_capacity(config, 8 * 1024) == 6 * 1024
    with pytest.raises(InfeasiblePlan, match="replay.min_fill"):
        sampleable_capacity(with_overrides(config, {"replay.min_fill": 4000}), 4 * 1024)


def test_a_small_replay_caps_the_planned_auto_batch(tmp_path):
    from fitdqn.config import Config, with_overrides
    from fitdqn.plan.build import plan_for_device

    config = with_overrides(Config(), {
        "market.data": "synthetic", "market.synthetic_bars": 600, "net.window": 4, "net.trunk_hidden": 32,
        "net.d_model": 16, "net.stream_hidden": 16, "net.num_atoms": 11, "net.iqn_embedding": 8,
        "net.iqn_quantiles": 8, "net.iqn_act_quantiles": 8, "net.iql_hidden": 16, "train.cuda_graphs": False,
        "collect.num_envs": 64, "replay.capacity": 64 * 10, "replay.min_fill": 64, "budget.batch_size": 0,
        "learn.n_step": 3,
        "budget.trace_cache_dir": str(tmp_path)})
    plan = plan_for_device(config, what_if("NVIDIA L4", None, None))
    assert plan.replay_capacity == 640 and plan.batch_size == 64 * 8  # 10 steps less the 2 still open
    assert any("what the replay can serve" in note for note in plan.notes)
    assert any("no GPU profile matches 'NVIDIA L4'" in note for note in plan.notes)


def test_the_batch_search_steps_under_misses_and_halves_wide_brackets():
    def search(fitted=None, missed=None, misses=0):
        return BatchSearch(0.01, fitted, missed, misses)

    assert search().next(1000, True, 1200) == 1200  # the model's guess
    assert search().next(1000, True, 1005) is None  # gains < 1 %
    # just under a miss: a quarter of the tolerance under it, twice that after two misses
    assert search().next(1000, False, 999) == 997
    assert search(missed=1000, misses=1).next(1000, False, 999) == 995
    assert search(fitted=900).next(1000, False, 999) == 997
    assert search(fitted=900).next(1000, False, 905) == 905  # above the fit: traced, however little it gains
    assert search(missed=1000, misses=1).next(990, True, 1100) is None  # held under the miss: < 1 % over the fit
    assert search(fitted=900).next(1000, False, 880) == 950  # no more than the fit: a wide bracket halved
    assert search(fitted=995).next(1000, False, 980) is None  # a narrow one: done
    state = search()
    state.next(900, True, 1000)
    state.next(1000, False, 999)
    assert (state.fitted, state.missed, state.misses) == (900, 1000, 1)  # what the traces said, kept
