"""Stopping a run anywhere loses nothing and misreads nothing: real processes, real signals.

One run is stopped five times at points inside epochs (SIGINT, SIGTERM, two SIGINTs, SIGKILL) and resumed
each time; at the end its parameters, optimizer, metrics.jsonl, TensorBoard scalars and learning-curve plot
equal those of the same run never stopped. The signals come from the run's own process at a chosen update or
collector step (``os.kill``), so the point inside the epoch is exact and the test is repeatable.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import fitdqn.files as files_module
import fitdqn.train.run as run_module
import fitdqn.train.trainer as trainer_module
from fitdqn.cli import main
from fitdqn.config import Config, dump_config, with_overrides
from fitdqn.errors import UserError
from fitdqn.train.checkpoint import load_checkpoint
from fitdqn.train.logs import read_jsonl
from fitdqn.train.run import evaluate_run, train

SRC = Path(__file__).resolve().parents[2] / "src"
TIMING = ("seconds", "env_steps_per_s", "updates_per_s")  # wall-clock figures: the only fields that may differ

# Runs `fitdqn train ARGS` in this process after patching in signal points: KILL_AT is a JSON list of
# [phase ("update" | "collect"), epoch (1-based), call number within that epoch's phase, signal number].
# The plan is the one the reference run computed (PLAN_FILE): planning is not what is tested and costs seconds.
DRIVER = r"""
import json, os, pickle, sys
import fitdqn.collect.collector as collector_module
import fitdqn.train.trainer as trainer_module
from fitdqn.cli import main

plan = pickle.loads(open(os.environ["PLAN_FILE"], "rb").read())
trainer_module.plan_for_device = lambda *args, **kwargs: plan
points = json.loads(os.environ.get("KILL_AT", "[]"))
calls, current = {}, {"epoch": 0}

def tick(phase):
    key = (phase, current["epoch"])
    calls[key] = calls.get(key, 0) + 1
    for p, epoch, count, signum in points:
        if (p, epoch, count) == (phase, current["epoch"], calls[key]):
            os.kill(os.getpid(), signum)

def patched(cls, name, phase=None, before=None):
    original = getattr(cls, name)
    def method(self, *args, **kwargs):
        if before is not None:
            before(self)
        if phase is not None:
            tick(phase)
        return original(self, *args, **kwargs)
    setattr(cls, name, method)

patched(trainer_module.Trainer, "run_epoch", before=lambda self: current.update(epoch=self.epoch + 1))
patched(trainer_module.Trainer, "update_step", phase="update")
patched(collector_module.Collector, "step", phase="collect")
sys.exit(main(["train", *sys.argv[1:]]))
"""

RUN = {"train.epochs": 5, "train.checkpoint_every": 2, "train.eval_every": 2}


def drive(args: list[str], shared: dict, kill_at: list[list[int | str]] = ()) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))  # the caller's packages too
    env = {**os.environ, "PYTHONPATH": path, "PLAN_FILE": str(shared["plan_file"]),
           "KILL_AT": json.dumps(list(kill_at)), "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "MKL_NUM_THREADS": str(torch.get_num_threads())}
    return subprocess.run([sys.executable, "-c", DRIVER, *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=shared["dir"])


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The uninterrupted reference run, its plan (for the other runs) and its config file, made once."""
    return {"dir": tmp_path_factory.mktemp("resume")}


@pytest.fixture
def reference(shared, small_config, monkeypatch):
    if "plan" not in shared:
        config = small_config(**RUN)
        plans = []
        train(config, shared["dir"] / "reference", console=Console(quiet=True),
              trainer_hook=lambda t: plans.append(t.plan))
        shared.update(plan=plans[0], plan_file=shared["dir"] / "plan.pickle", config=config,
                      config_file=shared["dir"] / "small.toml")
        shared["plan_file"].write_bytes(pickle.dumps(plans[0]))
        shared["config_file"].write_text(dump_config(config))
    monkeypatch.setattr(trainer_module, "plan_for_device", lambda *args, **kwargs: shared["plan"])
    return shared


def epochs_in(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "epoch"]


def checkpoint_epoch(run: Path) -> int:
    return int(load_checkpoint(run / "checkpoint.pt")["epoch"])


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_resume_after_signals_anywhere_equals_the_uninterrupted_run(reference, tmp_path):
    run = tmp_path / "run"
    resume = ["--resume", str(run)]

    # SIGINT during an update of epoch 1: the epoch finishes, is saved, the run exits 130
    result = drive(["--config", str(reference["config_file"]), "--out", str(run)], reference,
                   [["update", 1, 2, signal.SIGINT]])
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert "stopping at the end of this epoch" in result.stdout and "Ctrl-C again stops at once" in result.stdout
    assert checkpoint_epoch(run) == 1 and epochs_in(run) == [1]

    # SIGTERM during collection in epoch 2: the same, exit 143
    result = drive(resume, reference, [["collect", 2, 5, signal.SIGTERM]])
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert checkpoint_epoch(run) == 2 and epochs_in(run) == [1, 2]

    # epoch 3 runs (logged, not a checkpoint epoch); SIGKILL during an update of epoch 4
    result = drive(resume, reference, [["update", 4, 3, signal.SIGKILL]])
    assert result.returncode == -signal.SIGKILL
    assert checkpoint_epoch(run) == 2 and epochs_in(run) == [1, 2, 3]

    result = drive(resume, reference)
    assert result.returncode == 0, result.stderr

    straight = reference["dir"] / "reference"
    a, b = load_checkpoint(straight / "checkpoint.pt"), load_checkpoint(run / "checkpoint.pt")
    assert a["epoch"] == b["epoch"] == 5 and a["updates_done"] == b["updates_done"] > 0
    for part in ("online", "target", "value"):
        for key, tensor in a["learner"][part].items():
            assert torch.equal(tensor, b["learner"][part][key]), f"{part}.{key}"
    for index, slots in a["learner"]["optimizer"]["state"].items():
        for key, tensor in slots.items():
            assert torch.equal(tensor, b["learner"]["optimizer"]["state"][index][key]), f"adam {index} {key}"
    assert comparable(read_jsonl(run / "metrics.jsonl")) == comparable(read_jsonl(straight / "metrics.jsonl"))
    assert epochs_in(run) == [1, 2, 3, 4, 5]
    ours, theirs = scalars(run), scalars(straight)
    assert ours.keys() == theirs.keys() and "epoch/loss" in ours
    for tag in ours:
        if tag.split("/")[1] not in TIMING:
            assert ours[tag] == theirs[tag], tag  # every step once, the same values
    assert (run / "learning_curves.png").read_bytes() == (straight / "learning_curves.png").read_bytes()
    assert not list(run.glob(".*.tmp"))


def signals_at(points: list[tuple[int, int, int]]):
    """A trainer hook sending real signals to this process at (epoch, update call, signal)."""

    def hook(trainer):
        update_step, calls = trainer.update_step, {}

        def signalled():
            epoch = trainer.epoch + 1
            calls[epoch] = calls.get(epoch, 0) + 1
            for at_epoch, at_call, signum in points:
                if (at_epoch, at_call) == (epoch, calls[epoch]):
                    os.kill(os.getpid(), signum)
            update_step()

        trainer.update_step = signalled

    return hook


def test_a_second_signal_stops_at_once_and_keeps_the_last_checkpoint(reference, small_config, tmp_path):
    run = tmp_path / "run"
    console = Console(quiet=True)
    with pytest.raises(KeyboardInterrupt):  # SIGTERM then SIGINT in epoch 3, after the checkpoint of epoch 2
        train(small_config(**RUN), run, console=console,
              trainer_hook=signals_at([(3, 1, signal.SIGTERM), (3, 3, signal.SIGINT)]))
    assert checkpoint_epoch(run) == 2 and epochs_in(run) == [1, 2]
    saved = (run / "checkpoint.pt").read_bytes()
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt) as stopped:
        train(small_config(**RUN), run, resume=True, console=console,
              trainer_hook=signals_at([(3, 2, signal.SIGINT), (3, 3, signal.SIGINT)]))
    assert not stopped.value.saved and (run / "checkpoint.pt").read_bytes() == saved
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # put back


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stopped_before_the_first_checkpoint_leaves_no_folder(reference, small_config, tmp_path, signum):
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(small_config(**RUN), run, console=Console(quiet=True),
              trainer_hook=signals_at([(1, 1, signum), (1, 2, signum)]))
    assert not run.exists()


def test_failed_new_run_leaves_no_folder(reference, small_config, tmp_path):
    def fail(trainer):
        raise UserError("injected before the first epoch")

    with pytest.raises(UserError, match="injected"):
        train(small_config(**RUN), tmp_path / "new", console=Console(quiet=True), trainer_hook=fail)
    assert not (tmp_path / "new").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="injected"):
        train(small_config(**RUN), empty, console=Console(quiet=True), trainer_hook=fail)
    assert empty.is_dir() and not list(empty.iterdir())  # the user's empty folder stays, empty


@pytest.mark.parametrize(("code", "cause"), [(errno.ENOSPC, "the disk is full"),
                                             (errno.EROFS, "the file system is read-only")])
def test_a_failed_write_is_one_line_and_loses_nothing(reference, small_config, tmp_path, monkeypatch, capsys,
                                                      code, cause):
    """The disk fills up (or turns read-only) while the checkpoint of epoch 4 is written."""
    run = tmp_path / "run"
    real_fsync = files_module.os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(run / ".checkpoint.pt.")) and epochs_in(run)[-1] == 4:
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(files_module.os, "fsync", fsync)
    config_file = tmp_path / "small.toml"
    config_file.write_text(dump_config(small_config(**RUN)))
    assert main(["train", "--config", str(config_file), "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"cannot write '{run / 'checkpoint.pt'}': {cause}" in err and errno.errorcode[code] in err
    assert checkpoint_epoch(run) == 2 and not list(run.glob(".*.tmp"))  # the last checkpoint is intact


def test_run_files_are_readable_like_any_output_and_a_finished_run_can_leave_the_replay_out(
        reference, small_config, tmp_path):
    run = tmp_path / "run"
    old = os.umask(0o022)
    try:
        train(small_config(**RUN, **{"train.keep_replay": False}), run, console=Console(quiet=True))
    finally:
        os.umask(old)
    for name in ("config.toml", "plan.json", "metrics.jsonl", "checkpoint.pt", "report.json", "report.md",
                 "vram.png", "learning_curves.png", "equity_test.png"):
        assert (run / name).stat().st_mode & 0o777 == 0o644, name
    state = load_checkpoint(run / "checkpoint.pt")
    assert "replay" not in state and "replay" not in state["contents"] and state["contents"]["learner"]["bytes"] > 0
    with_replay = load_checkpoint(reference["dir"] / "reference" / "checkpoint.pt")
    replay = with_replay["contents"]["replay"]
    assert replay["bytes"] > 0 and "replay buffer" in replay["what"]
    assert evaluate_run(run, "validation", "cpu", console=Console(quiet=True))["agent"]["sharpe"] is not None
    with pytest.raises(UserError, match="saved without its replay buffer"):
        train(small_config(**{**RUN, "train.epochs": 6}), run, resume=True, console=Console(quiet=True))


def test_a_checkpoint_is_as_big_as_its_contents(reference):
    """The checkpoint's size line (``checkpoint_summary``: its ``contents``) tells what the file holds: the replay
    is saved as its filled rows, not as views of its whole ring (which ``torch.save`` writes whole)."""
    path = reference["dir"] / "reference" / "checkpoint.pt"
    state = load_checkpoint(path)
    replay = state["replay"]
    assert replay["storage"]["field.flags"].shape[0] < replay["capacity"]  # the ring is not full: what matters here
    listed = sum(part["bytes"] for part in state["contents"].values())
    assert listed <= path.stat().st_size <= listed + 2**18  # a zip's headers and the pickled structure besides


def test_resume_after_a_time_limit_takes_a_new_limit_or_none(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_config(with_overrides(Config(), {"train.minutes": 5.0})))
    seen = []
    monkeypatch.setattr(run_module, "train", lambda config, run_dir, resume, **_: seen.append(config.train.minutes))
    assert main(["train", "--resume", str(run)]) == 0
    assert main(["train", "--resume", str(run), "--minutes", "2"]) == 0
    assert seen == [0.0, 2.0]


def test_a_signal_outside_the_epochs_stops_at_once(reference, small_config, tmp_path):
    """SIGTERM while the run is set up (before any epoch): nothing to finish, so it stops there, leaving nothing."""
    run = tmp_path / "runs" / "run"
    with pytest.raises(KeyboardInterrupt) as stopped:
        train(small_config(**RUN), run, console=Console(quiet=True),
              trainer_hook=lambda trainer: os.kill(os.getpid(), signal.SIGTERM))
    assert stopped.value.signum == signal.SIGTERM and not stopped.value.saved
    assert not (tmp_path / "runs").exists()  # nor the parent folder the run made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_run_resumes_from_its_checkpoint(small_config, tmp_path):
    """A CUDA checkpoint is loaded onto the device, generator states included; they must go back to the CPU for
    ``set_state`` (found by a real-bars study resuming its folds on an H200)."""
    config = small_config(**{"train.device": "cuda", "train.epochs": 2, "train.checkpoint_every": 1,
                             "train.eval_every": 1})
    run = tmp_path / "cuda_run"
    train(config, run, console=Console(quiet=True))
    longer = with_overrides(config, {"train.epochs": 3})
    report = train(longer, run, resume=True, console=Console(quiet=True))
    assert report["epochs"] == 3

