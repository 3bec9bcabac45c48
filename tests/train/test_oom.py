"""The OOM guard re-plans by tracing candidate batches, guards evaluations and checkpoints, and its batch is
kept across --resume."""

import io
import json

import pytest
import torch
from rich.console import Console

from fitdqn.errors import UserError
from fitdqn.train import oom
from fitdqn.train.oom import OomGuard, fitting_batch, step_need
from fitdqn.train.run import train
from fitdqn.train.trainer import Trainer


@pytest.mark.parametrize("shape", ["concave", "linear", "convex", "flat"])  # how the step's bytes grow with B
def test_the_replanned_batch_is_the_largest_whose_traced_need_fits(shape):
    pages, room = 50_000, 5_000_000
    curvature = {"concave": -2e-3, "linear": 0.0, "convex": 5e-3}.get(shape, 0.0)
    need = lambda b: int(1000 * b + curvature * b * b) + pages  # noqa: E731  # exact bytes at batch b
    if shape == "flat":  # flat just over the room for 1 % of the batch (tests/plan/test_build.py's flat_above)
        edge = int(0.995 * room / 1000)
        need = lambda b: 1000 * b if b < edge else max(1000 * b, room + 1000)  # noqa: E731
    traced = []
    counted = lambda b: traced.append(b) or need(b)  # noqa: E731
    batch = fitting_batch(counted, room, below=10_000, per_sample_guess=500, min_batch=64)  # a guess too low
    largest = max(b for b in range(64, 10_000) if need(b) <= room)
    assert need(batch) <= room and batch >= 0.99 * largest
    assert batch in traced  # checked by its own trace, never extrapolated
    # never the old batch or above, whatever is free; None when even budget.min_batch does not fit
    assert fitting_batch(need, 10**12, below=127, per_sample_guess=1000, min_batch=64) == 127
    assert fitting_batch(need, need(63), below=1000, per_sample_guess=1000, min_batch=64) is None


def inject_oom(seen, at_call=3):
    def hook(trainer):
        original, calls = trainer.update_step, {"n": 0}

        def flaky():
            calls["n"] += 1
            if calls["n"] == at_call:
                raise torch.OutOfMemoryError("injected: CUDA out of memory")
            original()

        trainer.update_step = flaky
        seen["trainer"] = trainer
    return hook


def test_the_guard_replans_from_what_is_free_and_the_batch_survives_resume(small_config, tmp_path, monkeypatch):
    config = small_config(**{"budget.batch_size": 128, "replay.min_fill": 128, "train.epochs": 2})
    room_for = {}

    def free_now(guard):  # another process took memory: room for about 100 samples' update
        room_for.setdefault("free", int(step_need(guard.trainer, 100) / (1 - config.budget.headroom_fraction)))
        return room_for["free"]

    monkeypatch.setattr(OomGuard, "free_bytes", free_now)
    seen = {}
    run = tmp_path / "run"
    train(config, run, trainer_hook=inject_oom(seen), console=Console(file=io.StringIO()))
    trainer = seen["trainer"]
    new = trainer.batch_size
    room = room_for["free"] - int(config.budget.headroom_fraction * room_for["free"])
    assert step_need(trainer, new) <= room < step_need(trainer, int(new * 1.02) + 1)  # the largest that fits
    assert 90 <= new < 128 and trainer.oom_batch_size == new
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "oom" and e["old_batch"] == 128 and e["new_batch"] == new for e in events)
    # the checkpoint keeps the batch; a resumed run uses it and says so
    out = io.StringIO()
    resumed = {}
    train(small_config(**{"budget.batch_size": 128, "replay.min_fill": 128, "train.epochs": 3}), run, resume=True,
          trainer_hook=lambda t: resumed.setdefault("trainer", t), console=Console(file=out, width=200))
    assert resumed["trainer"].batch_size == new
    assert f"at batch {new} (the OOM guard's)" in out.getvalue()


def test_an_evaluation_that_runs_out_of_memory_is_retried_then_refused(small_config, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = oom.OomGuard.release

    def counting_release(self):
        calls["n"] += 1
        original(self)

    monkeypatch.setattr(oom.OomGuard, "release", counting_release)
    trainer = Trainer(small_config(**{"train.epochs": 1}))
    logged = []
    guard = OomGuard(trainer, Console(file=io.StringIO()), type("L", (), {"log": lambda s, *a: logged.append(a)})())
    flaky = {"n": 0}

    def once_out_of_memory():
        flaky["n"] += 1
        if flaky["n"] == 1:
            raise torch.OutOfMemoryError("injected")
        return "done"

    assert guard.run("evaluation", once_out_of_memory) == "done" and calls["n"] == 1
    assert logged and logged[0][1] == "oom" and logged[0][2]["in"] == "evaluation"

    def always():
        raise torch.OutOfMemoryError("injected")

    with pytest.raises(UserError, match="checkpoint ran out of device memory.*--resume"):
        guard.run("checkpoint", always)
