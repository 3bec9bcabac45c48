import errno
import os

import pytest
import torch

from fitdqn.files import FileWriteError
from fitdqn.train.checkpoint import CheckpointError, checkpoint_summary, load_checkpoint, save_checkpoint


def test_round_trip(tmp_path):
    state = {"epoch": 3, "net": {"w": torch.arange(6.0).reshape(2, 3)}, "rng": torch.get_rng_state()}
    path = save_checkpoint(tmp_path / "ckpt.pt", state)
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 3 and torch.equal(loaded["net"]["w"], state["net"]["w"])
    assert not list(tmp_path.glob(".*.tmp"))


def test_truncated_checkpoint_is_called_damaged_and_says_what_is_kept(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoint.pt", {"epoch": 1})
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "metrics.jsonl").write_text("")
    save_checkpoint(tmp_path / "best.pt", {"epoch": 1})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert "last checkpoint" in message and "damaged" in message and "truncated" in message
    assert "config.toml, metrics.jsonl" in message and "best.pt" in message  # what is still there
    assert "earlier checkpoint" not in message  # only the latest is kept
    assert path.exists()


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match="not a fitdqn checkpoint"):
        load_checkpoint(path)


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_malicious_pickle_is_named_and_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "payload": Exploit()}, path)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert f"would call {os.system.__module__}.system" in message  # the blocked global, named
    assert "not a fitdqn checkpoint" in message and "Nothing in it ran" in message
    assert "weights_only" not in message and "will likely succeed" not in message
    assert not (tmp_path / "pwned.txt").exists()


def test_unsafe_object_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "obj": object()}, path)
    with pytest.raises(CheckpointError, match="would call object"):
        load_checkpoint(path)


def test_missing_and_foreign_format(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "none.pt")
    torch.save({"format_version": 99}, tmp_path / "new.pt")
    with pytest.raises(CheckpointError, match="format 99"):
        load_checkpoint(tmp_path / "new.pt")


def test_failed_write_leaves_previous_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", {"epoch": 1})

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(path, {"epoch": 2, "bad": Boom()})
    assert load_checkpoint(path)["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_contents_say_what_is_in_the_file(tmp_path):
    state = {"learner": {"w": torch.zeros(10, dtype=torch.float32)},
             "replay": {"x": torch.zeros(100, dtype=torch.uint8)}, "epoch": 2}
    path = save_checkpoint(tmp_path / "checkpoint.pt", state)
    loaded = load_checkpoint(path)
    assert loaded["contents"]["learner"]["bytes"] == 40 and loaded["contents"]["replay"]["bytes"] == 100
    assert "replay buffer" in loaded["contents"]["replay"]["what"]
    summary = checkpoint_summary(path, loaded)
    assert summary.startswith("checkpoint.pt: ") and summary.index("replay") < summary.index("learner")


def test_checkpoint_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "checkpoint.pt", {"epoch": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644  # group and others may read, like any output file


def test_disk_full_is_one_clear_error_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "checkpoint.pt", {"epoch": 1})
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(FileWriteError, match=r"cannot write '.*checkpoint.pt': the disk is full.*ENOSPC"):
        save_checkpoint(path, {"epoch": 2})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert load_checkpoint(path)["epoch"] == 1
    assert not list(tmp_path.glob(".*.tmp"))
