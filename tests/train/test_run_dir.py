"""What a run may write into, and what is refused before any work (no planning, no training, no files)."""

import io
import json
import signal
import time

import pytest
from rich.console import Console

import fitdqn.train.run as run_module
from fitdqn.cli import main
from fitdqn.config import Config, dump_config
from fitdqn.train.logs import RunLogger, read_jsonl
from fitdqn.train.run import Interrupted, StopRequests, default_run_dir, status_line


def refused(capsys, *args) -> str:
    assert main(["train", *args]) == 2
    return capsys.readouterr().err


def test_out_refuses_a_folder_with_the_users_files(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "report.md").write_text("my notes")
    (folder / "plan.json").write_text("{}")
    err = refused(capsys, "--out", str(folder), "--device", "cpu")
    assert "is not empty and holds no fitdqn run" in err and "report.md" in err and "another --out" in err
    assert (folder / "report.md").read_text() == "my notes" and (folder / "plan.json").read_text() == "{}"
    assert sorted(p.name for p in folder.iterdir()) == ["plan.json", "report.md"]


def test_out_refuses_a_run_without_checkpoint_and_a_run_with_one(tmp_path, capsys):
    died = tmp_path / "died"
    died.mkdir()
    (died / "config.toml").write_text(dump_config(Config()))
    (died / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "epoch"}) + "\n")
    err = refused(capsys, "--out", str(died), "--device", "cpu")
    assert "stopped before its first checkpoint" in err and "nothing to resume" in err
    assert len(read_jsonl(died / "metrics.jsonl")) == 1
    (died / "checkpoint.pt").write_bytes(b"")
    err = refused(capsys, "--out", str(died), "--device", "cpu")
    assert "already holds a run" in err and f"--resume {died}" in err
    file = tmp_path / "file"
    file.write_text("x")
    assert "is a file, not a folder" in refused(capsys, "--out", str(file))


@pytest.mark.parametrize(("option", "value", "key"), [
    ("--learn.lr", "nan", "learn.lr"), ("--learn.lr", "-0.001", "learn.lr"),
    ("--train.checkpoint_every", "0", "train.checkpoint_every"), ("--epochs", "-1", "train.epochs"),
])
def test_bad_values_are_refused_before_any_work(tmp_path, capsys, monkeypatch, option, value, key):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_module, "probe", lambda *a: pytest.fail("probed the device for a refused config"))
    err = refused(capsys, option, value, "--out", str(tmp_path / "run"))
    assert f"error: {key} must be" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_default_run_dirs_never_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-120000")
    first = default_run_dir()
    first.mkdir(parents=True)
    second = default_run_dir()
    assert first.name == "20260101-120000" and second.name == "20260101-120000-2"


def test_logs_roll_back_to_what_the_checkpoint_covers(tmp_path):
    logger = RunLogger(tmp_path, tensorboard=False, keep=None)
    for epoch in (1, 2, 3):
        logger.log(epoch, "epoch", {"loss": float(epoch)})
    assert logger.records == 3
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write('{"step": 4, "kind": "ep')  # the line being written when the run was killed
    logger = RunLogger(tmp_path, tensorboard=False, keep=2)
    logger.log(3, "epoch", {"loss": 30.0})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_file_system_error_is_one_line_naming_the_path(tmp_path, capsys, monkeypatch):
    def denied(config, run_dir, resume, **kwargs):
        raise PermissionError(13, "Permission denied", str(run_dir / "tensorboard"))

    monkeypatch.setattr(run_module, "train", denied)
    assert main(["train", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"fitdqn train: error: file error at '{tmp_path / 'run' / 'tensorboard'}': permission denied: "
                   "give a folder you can write to (EACCES)")


def test_a_tune_trial_folder_is_a_new_run_and_its_setup_files_stay():
    worker = pytest.importorskip("fitdqn.tune.worker")
    assert {worker.SPEC_FILE, worker.LOG_FILE} <= set(run_module.SETUP_FILES)


def test_setup_files_do_not_block_a_new_run_and_outlive_a_failed_one(tmp_path):
    folder = tmp_path / "trial"
    folder.mkdir()
    for name in run_module.SETUP_FILES:
        (folder / name).write_text("kept")
    run_module.check_new_run_dir(folder)  # no error
    (folder / "config.toml").write_text("")
    (folder / "metrics.jsonl").write_text("")
    run_module.discard_new_run(folder, [], set(run_module.SETUP_FILES), Console(quiet=True))
    assert sorted(p.name for p in folder.iterdir()) == sorted(run_module.SETUP_FILES)


def test_the_status_line_shows_an_epoch_without_a_validation_sharpe():
    """A ruined validation account has no Sharpe: the status line says so instead of failing the run."""
    line = status_line({"env_steps_per_s": 10.0, "updates_per_s": 2.0, "loss": 0.5, "validation_sharpe": None})
    assert "val Sharpe -" in line and "loss 0.500" in line
    assert "val Sharpe 1.25" in status_line({"validation_sharpe": 1.25})


def test_a_stop_at_once_swallowed_by_a_finalizer_still_keeps_the_epochs_from_starting():
    """A signal outside the epochs raises Interrupted where the program is; when that is inside a finalizer,
    Python only prints "Exception ignored": the request is kept and the epochs refuse to start after it."""
    stop = StopRequests(Console(file=io.StringIO()))
    with pytest.raises(Interrupted):
        stop.handle(signal.SIGINT, None)  # as the handler would, during set-up
    with pytest.raises(Interrupted, match="SIGINT: stopped at once"), stop.graceful():
        pass  # never reached
    fresh = StopRequests(Console(file=io.StringIO()))
    with fresh.graceful():
        fresh.handle(signal.SIGTERM, None)  # in the epochs: a stop at the end of the epoch, no exception
    assert fresh.signum == signal.SIGTERM and fresh.stopped_at_once is None
