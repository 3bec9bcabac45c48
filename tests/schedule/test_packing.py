"""The packing decision on fake devices of several sizes: never more shares at once than the free memory, never more
runs than cores, the user's cap honoured, every run started once; and a run's share from its own plan."""

import dataclasses
import random

import pytest

from fitdqn.config import Config
from fitdqn.device.probe import DeviceInfo
from fitdqn.schedule.packing import AUTO, first_fit, packing, share_bytes, to_start
from fitdqn.schedule.shares import SHARE_MARGIN_BYTES, SHARE_RESOLUTION_BYTES, run_share

GiB = 2**30
CARDS = {"4 GiB": 4 * GiB, "8 GiB": 8 * GiB, "24 GiB": 24 * GiB, "80 GiB": 80 * GiB, "141 GiB": 141 * GiB}


def simulate(shares: list[int], free: int, cores: int, cap: int, seed: int) -> tuple[int, list[int]]:
    """Run a queue to the end, runs ending in random order: (most runs at once, the order they started in);
    asserts at every start that the running shares fit in ``free`` (or one run is alone)."""
    rng = random.Random(seed)
    pack = packing(shares, free, cores, cap)
    waiting = list(range(len(shares)))
    running: list[int] = []
    started: list[int] = []
    most = 0
    while waiting or running:
        left = free - sum(shares[i] for i in running)
        chosen = to_start([shares[i] for i in waiting], len(waiting), left, pack.at_once - len(running),
                          len(running))
        for index in sorted(chosen, reverse=True):
            running.append(waiting.pop(index))
        started += [r for r in running if r not in started]
        if len(running) > 1:
            assert sum(shares[i] for i in running) <= free, "over-committed"
        assert len(running) <= pack.at_once <= max(cores, 1)
        most = max(most, len(running))
        if not running:
            raise AssertionError("nothing could start")
        running.remove(rng.choice(running))
    return most, started


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("cores", [1, 2, 16])
@pytest.mark.parametrize("cap", [AUTO, 1, 3])
def test_the_packing_never_over_commits(card, cores, cap):
    free = CARDS[card]
    rng = random.Random(f"{card}{cores}{cap}")
    for seed in range(20):
        shares = [rng.choice([GiB // 4, GiB // 2, GiB, 3 * GiB, 6 * GiB, 100 * GiB]) for _ in range(rng.randint(1, 12))]
        most, started = simulate(shares, free, cores, cap, seed)
        assert sorted(started) == list(range(len(shares)))  # every run once, none lost
        assert most <= (cap if cap != AUTO else cores)


def test_as_many_as_fit_and_have_a_core():
    plan = [800 * 2**20] * 20  # a 5 x 4 study of default runs (800 MiB each)
    assert packing(plan, 80 * GiB, cores=16, cap=AUTO).at_once == 16  # cores decide
    assert packing(plan, 80 * GiB, cores=16, cap=AUTO).threads == 1
    assert packing(plan, 4 * GiB, cores=16, cap=AUTO).at_once == 5  # memory decides
    assert packing(plan, 4 * GiB, cores=16, cap=AUTO).threads == 3
    assert packing(plan, 80 * GiB, cores=16, cap=4) == packing(plan, 80 * GiB, cores=16, cap=4)
    assert packing(plan, 80 * GiB, cores=16, cap=4).at_once == 4  # the user's cap
    assert packing(plan, 80 * GiB, cores=16, cap=4).threads == 4
    assert packing(plan[:2], 80 * GiB, cores=16, cap=AUTO).at_once == 2  # no more than there are runs


def test_a_cpu_splits_the_threads_as_asked():
    assert packing(None, None, cores=8, cap=AUTO).at_once == 1  # auto: one at a time, every thread
    assert packing(None, None, cores=8, cap=AUTO).threads == 8
    assert packing(None, None, cores=8, cap=4).threads == 2
    assert packing(None, None, cores=2, cap=4).threads == 1
    assert to_start(None, waiting=5, free_bytes=None, slots=2, running=0) == [0, 1]


def test_first_fit_keeps_queue_order_and_lets_smaller_runs_through():
    assert first_fit([3, 5, 1, 1], free_bytes=5, slots=4) == [0, 2, 3]
    assert first_fit([3, 5, 1, 1], free_bytes=5, slots=2) == [0, 2]
    assert to_start([9, 9], waiting=2, free_bytes=5, slots=2, running=0) == [0]  # too big for any card: alone
    assert to_start([9, 9], waiting=2, free_bytes=5, slots=2, running=1) == []  # waits for the card


@dataclasses.dataclass
class FakePlan:
    planned_bytes: int
    batch_size: int
    replay_capacity: int


def fake_planner(grows: bool, replay_cap: int | None = None):
    """A plan of 1 GiB; with ``grows``, its replay is a share of what it is given (up to ``replay_cap``)."""

    def plan(config, device):
        capacity = device.free_bytes // 1000 if grows else 10_000
        return FakePlan(GiB, 512, min(capacity, replay_cap or capacity))

    return plan


def test_a_share_is_the_plan_with_headroom_and_margin_unless_the_plan_grows_with_memory():
    device = DeviceInfo("NVIDIA H100 80GB HBM3", "cuda", 0, 80 * GiB, 79 * GiB, (9, 0), True)
    config = Config()
    expected = share_bytes(GiB, config.budget.headroom_fraction, SHARE_MARGIN_BYTES)
    assert GiB + SHARE_MARGIN_BYTES < expected < 2 * GiB
    assert run_share(config, device, fake_planner(grows=False)) == expected
    assert run_share(config, device, fake_planner(grows=True)) == device.free_bytes  # alone, as by itself
    # a replay at its cap from 3 GiB free: the least free memory giving that plan, to the resolution
    share = run_share(config, device, fake_planner(grows=True, replay_cap=3 * GiB // 1000))
    assert 3 * GiB <= share <= 3 * GiB + SHARE_RESOLUTION_BYTES
    small = dataclasses.replace(device, free_bytes=GiB)
    assert run_share(config, small, fake_planner(grows=False)) == GiB  # more than there is: the whole card
