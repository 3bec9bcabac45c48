"""End-to-end runs on a small synthetic market (CPU): report, resume, corrupt checkpoint, OOM guard."""

import json

import pytest
import torch

from fitdqn.errors import UserError
from fitdqn.train.checkpoint import CheckpointError
from fitdqn.train.run import evaluate_run, train
from fitdqn.train.trainer import Trainer


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.system.learner.params]


def test_end_to_end_writes_the_run_directory(small_config, tmp_path):
    config = small_config()
    report = train(config, tmp_path / "run")
    run = tmp_path / "run"
    for name in ("config.toml", "plan.json", "metrics.jsonl", "checkpoint.pt", "report.json", "report.md",
                 "equity_test.png", "learning_curves.png", "vram.png"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").iterdir())
    assert report["epochs"] == 4 and report["updates"] > 0
    for split in ("validation", "test"):
        assert {"agent", "buy_and_hold", "random"} <= set(report[split])
        assert report[split]["agent"]["sharpe"] is not None
    plan = json.loads((run / "plan.json").read_text())
    assert plan["batch_size"] == 64 and plan["batch_source"] == "user"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines if r["kind"] == "epoch"] == [1, 2, 3, 4]
    assert any("validation_sharpe" in r for r in lines)
    evaluated = evaluate_run(run, "validation", "cpu")
    assert evaluated["agent"]["sharpe"] == pytest.approx(report["validation"]["agent"]["sharpe"])


def interrupt_after(epochs: int):
    """A trainer hook: Ctrl-C arrives when epoch ``epochs + 1`` would start."""

    def hook(trainer: Trainer):
        run_epoch = trainer.run_epoch

        def interrupted():
            if trainer.epoch == epochs:
                raise KeyboardInterrupt
            return run_epoch()

        trainer.run_epoch = interrupted

    return hook


def test_resume_equals_uninterrupted(small_config, tmp_path):
    straight = {}
    train(small_config(), tmp_path / "a", trainer_hook=lambda t: straight.setdefault("trainer", t))
    with pytest.raises(KeyboardInterrupt):
        train(small_config(), tmp_path / "b", trainer_hook=interrupt_after(3))
    resumed = {}
    train(small_config(), tmp_path / "b", resume=True, trainer_hook=lambda t: resumed.setdefault("trainer", t))
    a, b = straight["trainer"], resumed["trainer"]
    assert a.epoch == b.epoch == 4 and a.updates_done == b.updates_done
    for x, y in zip(params(a), params(b), strict=True):
        assert torch.equal(x, y)
    losses = lambda t: [r["loss"] for r in t.history]  # noqa: E731
    assert losses(a) == losses(b)
    assert len(b.history) == 4


def test_corrupt_checkpoint_is_an_error_not_a_fresh_start(small_config, tmp_path):
    run = tmp_path / "run"
    train(small_config(**{"train.epochs": 2}), run)
    checkpoint = run / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt"):
        train(small_config(), run, resume=True)
    with pytest.raises(UserError, match="no checkpoint.pt"):
        train(small_config(), tmp_path / "empty", resume=True)


def test_oom_guard_replans_and_goes_on(small_config, tmp_path, monkeypatch):
    seen = {}

    def inject(trainer: Trainer):
        original = trainer.update_step
        calls = {"n": 0}

        def flaky():
            calls["n"] += 1
            if calls["n"] == 3:
                raise torch.OutOfMemoryError("injected: CUDA out of memory")
            original()

        trainer.update_step = flaky
        seen["trainer"] = trainer

    report = train(small_config(**{"budget.batch_size": 128, "replay.min_fill": 128}), tmp_path / "run",
                   trainer_hook=inject)
    trainer = seen["trainer"]
    assert 64 <= trainer.batch_size < 128  # re-planned by tracing (tests/train/test_oom.py), not halved
    assert report["epochs"] == 4
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "oom" and e["old_batch"] == 128 and e["new_batch"] == trainer.batch_size for e in events)


def test_the_run_makes_exactly_the_budgeted_updates(small_config, tmp_path):
    """train.sample_reuse 1.5 over 4 epochs of 16 x 16 = 256 env steps at batch 64: 24 updates in all (6 per epoch),
    the first epoch included although replay.min_fill exceeds what it collects."""
    seen = {}
    config = small_config(**{"train.sample_reuse": 1.5, "replay.min_fill": 1000, "train.min_updates": 1})
    report = train(config, tmp_path / "run", trainer_hook=lambda t: seen.setdefault("trainer", t))
    trainer = seen["trainer"]
    assert report["updates"] == trainer.schedule.updates == 24
    assert report["samples"] == 24 * 64 and report["env_steps"] == 4 * 256
    assert [r["updates"] for r in trainer.history] == [6, 6, 6, 6]
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["schedule"]["updates"] == 24 and saved["reward"].startswith("vol x ")


def test_batch_size_moves_updates_not_samples(small_config, tmp_path):
    runs = {}
    for batch in (32, 128):
        config = small_config(**{"budget.batch_size": batch, "train.sample_reuse": 2.0, "train.epochs": 2,
                                 "train.min_updates": 1})
        runs[batch] = train(config, tmp_path / f"b{batch}",
                            trainer_hook=lambda t, b=batch: setattr(t, "_seen", b))
    assert runs[32]["samples"] == runs[128]["samples"] == 2 * 2 * 256
    assert runs[32]["updates"] == 4 * runs[128]["updates"] == 32
    assert runs[32]["schedule"]["lr"] == pytest.approx(runs[128]["schedule"]["lr"] / 4)  # the linear rule


def test_a_batch_larger_than_the_replay_holds_learns_from_the_first_epoch(small_config, tmp_path):
    """Batch 1024 over 4 epochs of 256 env steps, train.sample_reuse 4: one update per epoch from the first one
    (drawn with replacement), not all four crammed into the epoch where the replay first holds a whole batch."""
    seen = {}
    config = small_config(**{"budget.batch_size": 1024, "train.sample_reuse": 4.0, "train.min_updates": 1})
    report = train(config, tmp_path / "run", trainer_hook=lambda t: seen.setdefault("trainer", t))
    assert report["updates"] == 4
    assert [r["updates"] for r in seen["trainer"].history] == [1, 1, 1, 1]
