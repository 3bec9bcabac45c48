import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from optuna.trial import TrialState  # noqa: E402
from tune_helpers import SEARCH, TINY, quiet, tiny_config, toml_of  # noqa: E402

import fitdqn  # noqa: E402
from fitdqn.train.run import train  # noqa: E402
from fitdqn.tune.study import REQUEUED_FROM, count_trials, storage_url  # noqa: E402


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def test_a_killed_tune_is_continued_by_the_same_command(tmp_path):
    """SIGKILL the tune process mid-trial: its worker is interrupted with it (saving its checkpoint), and the
    same command again fails the cut-off trial, runs its params again, and ends with the study's one trial."""
    file = tmp_path / "tune.toml"
    file.write_text(toml_of({**TINY, "train.epochs": 12}, SEARCH))  # a trial long enough to be cut off mid-way
    tune_dir = tmp_path / "tune"
    command = ["tune", "--config", str(file), "--dir", str(tune_dir), "--tune.study", "tiny", "--trials", "1"]
    env = {**os.environ, "PYTHONPATH": str(Path(fitdqn.__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-m", "fitdqn", *command], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    run_dir = tune_dir / "trials" / "0000"
    try:
        assert wait_for(lambda: (run_dir / "plan.json").exists(), 240), "the trial never started"
    finally:
        process.kill()
        process.wait()
    assert wait_for(lambda: (run_dir / "result.json").exists(), 120), "the worker outlived its tune process"
    assert json.loads((run_dir / "result.json").read_text())["state"] == "interrupted"

    from fitdqn.cli import main

    assert main(command) == 0
    study = optuna.load_study(study_name="tiny", storage=storage_url(tiny_config(tune_dir).tune))
    cut, again = study.get_trials()
    assert cut.state == TrialState.FAIL and "cut off" in cut.user_attrs["error"]
    assert again.state == TrialState.COMPLETE and again.params == cut.params
    assert again.user_attrs[REQUEUED_FROM] == 0
    assert count_trials(study) == (1, 0)


def test_on_epoch_ends_the_run_early(tmp_path):
    config = tiny_config(tmp_path / "tune", trials=1)
    run_dir = tmp_path / "run"
    seen = []

    def stop_after_first(record) -> bool:
        seen.append(record["epoch"])
        return True

    report = train(config, run_dir, console=quiet(), on_epoch=stop_after_first)
    assert seen == [1] and report["epochs"] == 1
    assert (run_dir / "checkpoint.pt").exists() and (run_dir / "plan.json").exists()
