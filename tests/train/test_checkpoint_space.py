"""A checkpoint that does not fit: the message says so, what is kept and what is lost."""

import errno
import io

import pytest
from rich.console import Console

import fitdqn.train.run as runs
from fitdqn.files import CHECKPOINT_NAME, FileWriteError, describe_os_error
from fitdqn.train.checkpoint import load_checkpoint


def fail_checkpoint_at(monkeypatch, epoch):
    """``checkpoint.pt``'s write of ``epoch`` fails as a full disk does (after the temp file: the old one stays)."""
    real = runs.save_checkpoint

    def save(path, state):
        if path.name == CHECKPOINT_NAME and state["epoch"] == epoch:
            raise FileWriteError(describe_os_error(OSError(errno.ENOSPC, "No space left on device"), path))
        return real(path, state)

    monkeypatch.setattr(runs, "save_checkpoint", save)


def test_a_first_run_that_cannot_save_says_its_epochs_are_lost(small_config, tmp_path, monkeypatch):
    config = small_config(**{"train.epochs": 1, "train.eval_every": 1})
    fail_checkpoint_at(monkeypatch, 1)
    run_dir = tmp_path / "run"
    with pytest.raises(FileWriteError) as error:
        runs.train(config, run_dir, console=Console(file=io.StringIO()))
    message = str(error.value)
    assert "checkpoint of epoch 1" in message and "could not be saved" in message and "disk is full" in message
    assert "no checkpoint yet, so its 1 epoch(s) of training are lost" in message
    assert not run_dir.exists()  # nothing half-made is left


def test_a_later_checkpoint_that_does_not_fit_keeps_the_previous_one(small_config, tmp_path, monkeypatch):
    config = small_config(**{"train.epochs": 2, "train.eval_every": 1, "train.checkpoint_every": 1})
    fail_checkpoint_at(monkeypatch, 2)
    run_dir = tmp_path / "run"
    with pytest.raises(FileWriteError, match=r"epoch 2 .*could not be saved.*previous checkpoint is kept.*--resume"):
        runs.train(config, run_dir, console=Console(file=io.StringIO()))
    assert load_checkpoint(run_dir / CHECKPOINT_NAME)["epoch"] == 1


def test_a_best_network_that_does_not_fit_says_what_is_lost(small_config, tmp_path, monkeypatch):
    config = small_config(**{"train.epochs": 1, "train.eval_every": 1})
    real = runs.save_checkpoint

    def save(path, state):
        if path.name == "best.pt":
            raise FileWriteError(describe_os_error(OSError(errno.ENOSPC, "No space left on device"), path))
        return real(path, state)

    monkeypatch.setattr(runs, "save_checkpoint", save)
    with pytest.raises(FileWriteError, match=r"best.pt, the best network so far \(epoch 1\) .*could not be saved.*"
                                             r"1 epoch\(s\) of training are lost"):
        runs.train(config, tmp_path / "run", console=Console(file=io.StringIO()))
