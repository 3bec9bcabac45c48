import pytest
import torch

from fitdqn.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def test_round_trip(tmp_path):
    state = {"epoch": 3, "net": {"w": torch.arange(6.0).reshape(2, 3)}, "rng": torch.get_rng_state()}
    path = save_checkpoint(tmp_path / "ckpt.pt", state)
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 3 and torch.equal(loaded["net"]["w"], state["net"]["w"])
    assert not list(tmp_path.glob(".*.tmp"))


def test_corrupt_checkpoint_is_a_clear_error_and_the_file_is_kept(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", {"epoch": 1})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)
    assert path.exists()


def test_unsafe_pickle_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "obj": object()}, path)
    with pytest.raises(CheckpointError, match="corrupt or not a fitdqn checkpoint"):
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
