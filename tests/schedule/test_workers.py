"""Two workers on one queue of 6 tiny runs in a real PostgreSQL: every run done exactly once, and a worker SIGKILLed
mid-run has its run queued again (heartbeats) and finished by the other; the study's report pools them all."""

import json
import signal

import pytest
from support.queue_runs import TINY_RUN, fitdqn_process, toml_of, wait_for

optuna = pytest.importorskip("optuna")

from optuna.trial import TrialState  # noqa: E402


def trials_of(url: str, name: str):
    try:
        return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    except KeyError:
        return []


def test_two_workers_share_a_queue_and_a_killed_workers_run_is_finished_by_the_other(postgres_url, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(toml_of(TINY_RUN))
    study_dir = tmp_path / "study"
    name = str(study_dir.resolve())
    train = fitdqn_process("train", "--config", str(config), "--seeds", "3", "--folds", "2", "--out", str(study_dir),
                           "--storage", postgres_url, "--tune.heartbeat_seconds", "1", "--parallel", "2")
    try:
        assert wait_for(lambda: len(trials_of(postgres_url, name)) == 6, 120), "the study's runs were never queued"
        worker = fitdqn_process("worker", "--storage", postgres_url, "--heartbeat", "1")

        def started_by_worker():  # a run the worker took and started (its process is starting)
            for t in trials_of(postgres_url, name):
                if t.state == TrialState.RUNNING and t.user_attrs.get("pid") == worker.pid and \
                        (study_dir / t.user_attrs["dir"] / "member.json").is_file():
                    return t
            return None

        killed = wait_for(started_by_worker, 120)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        assert killed is not None, "the worker never started a run"
        output, _ = train.communicate(timeout=600)
    finally:
        train.kill()
    assert train.returncode == 0, output
    trials = trials_of(postgres_url, name)
    keys = sorted({t.user_attrs["key"] for t in trials})
    assert keys == [f"seed_{s}/fold_{k}" for s in range(3) for k in range(2)]
    for key in keys:  # done exactly once: one complete trial per run
        complete = [t for t in trials if t.user_attrs["key"] == key and t.state == TrialState.COMPLETE]
        assert len(complete) == 1, key
        assert (study_dir / trials[0].user_attrs["dir"]).is_dir()
    mine = [t for t in trials if t.user_attrs["key"] == killed.user_attrs["key"]]
    assert [t.state for t in mine] == [TrialState.FAIL, TrialState.COMPLETE]  # failed by its silence, run again
    assert mine[1].user_attrs["pid"] == train.pid and mine[1].system_attrs["failed_trial"] == mine[0].number
    members = json.loads((study_dir / "study.json").read_text())
    assert sorted(m["dir"] for m in members) == keys
    for m in members:
        report = json.loads((study_dir / m["dir"] / "report.json").read_text())
        assert report["test"]["agent"]["sharpe"] == m["test_sharpe"]


def test_a_worker_on_a_bad_url_is_one_clear_error_and_on_an_empty_queue_ends(tmp_path, capsys):
    from fitdqn.cli import main

    assert main(["worker", "--storage", "nonsense://x"]) == 2
    assert "cannot open the queue's storage 'nonsense://x'" in capsys.readouterr().err
    assert main(["worker", "--storage", f"sqlite:///{tmp_path / 'queue.db'}"]) == 0
    assert "served 0 queue(s)" in capsys.readouterr().out
    assert main(["worker", "--storage", f"sqlite:///{tmp_path / 'queue.db'}", "--study", "nope"]) == 2
    assert "no queue of runs named 'nope'" in capsys.readouterr().err
