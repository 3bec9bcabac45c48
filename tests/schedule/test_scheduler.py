"""The scheduler on a fake GPU (runs whose processes are stand-ins): the runs at once never hold more than the free
memory, every run is started once, a run whose report exists is recorded and never started, and an interrupted or
failed run is handed back to the queue as such."""

import io
import json
import random

import pytest
from rich.console import Console

from fitdqn.config import Config, with_overrides
from fitdqn.schedule import scheduler as scheduler_module
from fitdqn.schedule.packing import packing
from fitdqn.schedule.queue import LocalQueue, Run
from fitdqn.schedule.scheduler import Resources, Scheduler, Started, config_key

GiB = 2**30


class StandIn:
    """A run's process that ends after a few polls, writing its report (exit 0), or exiting with ``code``."""

    def __init__(self, run_dir, polls: int, code: int = 0) -> None:
        self.run_dir, self.left, self.code, self.returncode = run_dir, polls, code, None

    def poll(self):
        self.left -= 1
        if self.left <= 0 and self.returncode is None:
            if self.code == 0:
                (self.run_dir / "report.json").write_text(json.dumps({"selection": {"validation_sharpe": 1.0}}))
            self.returncode = self.code
        return self.returncode


def fake_gpu_scheduler(tmp_path, monkeypatch, shares_gib, free_gib, cores, codes=None):
    rng = random.Random(0)
    runs, shares = [], {}
    for index, share in enumerate(shares_gib):
        config = with_overrides(Config(), {"replay.capacity": 4096 * (index + 1)})  # a plan of its own
        runs.append(Run(f"run_{index}", tmp_path / f"run_{index}", config))
        shares[config_key(config)] = int(share * GiB)
    free = int(free_gib * GiB)
    pack = packing(list(shares.values()), free, cores, 0)
    resources = Resources(pack, free, 80 * GiB, shares, "fake GPU")
    queue = LocalQueue(runs)
    scheduler = Scheduler(queue, resources, Console(file=io.StringIO()))
    launched, most = [], []

    def launch(self, run, share):
        run.run_dir.mkdir(parents=True, exist_ok=True)
        code = (codes or {}).get(run.key, 0)
        self.running.append(Started(run, StandIn(run.run_dir, rng.randint(1, 4), code), io.StringIO(), share))
        launched.append(run.key)
        held = sum(s.share for s in self.running)
        assert len(self.running) == 1 or held <= free, f"over-committed: {held} of {free}"
        assert len(self.running) <= cores
        most.append(len(self.running))

    monkeypatch.setattr(Scheduler, "launch", launch)
    monkeypatch.setattr(scheduler_module, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(scheduler_module, "IDLE_SECONDS", 0.0)
    return scheduler, queue, launched, most


@pytest.mark.parametrize("free_gib", [2, 8, 80])
def test_the_runs_at_once_never_hold_more_than_the_free_memory(tmp_path, monkeypatch, free_gib):
    shares = [0.5, 3, 1, 1, 6, 0.75, 2, 120, 1.5]  # one too big for any card: it runs alone, uncapped
    scheduler, queue, launched, most = fake_gpu_scheduler(tmp_path, monkeypatch, shares, free_gib, cores=4)
    scheduler.run()
    assert sorted(launched) == sorted(f"run_{i}" for i in range(len(shares)))  # each once
    assert sorted(queue.done) == sorted(launched) and not queue.errors
    assert max(most) > 1 or free_gib == 2


def test_a_run_whose_report_exists_is_recorded_and_not_started(tmp_path, monkeypatch):
    scheduler, queue, launched, _ = fake_gpu_scheduler(tmp_path, monkeypatch, [1, 1, 1], 8, cores=2)
    (tmp_path / "run_1").mkdir()
    (tmp_path / "run_1" / "report.json").write_text("{}")
    scheduler.run()
    assert sorted(launched) == ["run_0", "run_2"] and sorted(queue.done) == ["run_0", "run_1", "run_2"]


def test_a_failed_run_is_recorded_and_an_interrupted_one_goes_back(tmp_path, monkeypatch):
    scheduler, queue, launched, _ = fake_gpu_scheduler(tmp_path, monkeypatch, [1, 1], 8, cores=2,
                                                       codes={"run_0": 1, "run_1": 130})
    released = []
    monkeypatch.setattr(queue, "released", lambda run: released.append(run.key))  # not taken again here
    scheduler.run()
    assert list(queue.errors) == ["run_0"] and "exited with status 1" in queue.errors["run_0"]
    assert released == ["run_1"] and not queue.done
