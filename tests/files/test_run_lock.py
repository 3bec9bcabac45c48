"""One writer per run directory: real processes hold the lock, are killed, and a second writer is refused."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fitdqn.cli.app import EXIT_USER_ERROR, main
from fitdqn.config import Config, dump_config
from fitdqn.run_lock import LOCK_NAME, Holder, RunInUse, held, host_name, run_lock

HOLD = textwrap.dedent("""
    import sys, time
    from fitdqn.run_lock import run_lock
    with run_lock(sys.argv[1], command="fitdqn train --out " + sys.argv[1]):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def holder_of(run_dir):
    """Who holds ``run_dir``'s lock now (None: nobody, or a holder that has not written its record yet)."""
    return held(run_dir)[1]


def hold(run_dir, seconds=60.0):
    """A child process holding ``run_dir``'s lock (returns once it does)."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), str(seconds)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.stdout.readline().strip() == "held"
    return child


def test_second_writer_is_refused_with_the_holders_pid_and_command(tmp_path):
    run_dir = tmp_path / "run"
    child = hold(run_dir)
    try:
        with pytest.raises(RunInUse) as error, run_lock(run_dir):
            pass
        message = str(error.value)
        assert f"pid {child.pid}" in message and f"fitdqn train --out {run_dir}" in message
        assert host_name() in message and f"kill {child.pid}" in message
        assert holder_of(run_dir).pid == child.pid
    finally:
        child.kill()
        child.wait()


def test_a_killed_holder_is_named_and_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    child = hold(run_dir)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert holder_of(run_dir) is None  # the kernel released the flock with the process
    notes = []
    with run_lock(run_dir, notify=notes.append) as holder:
        assert holder.pid == os.getpid()
        assert holder_of(run_dir) is None or holder_of(run_dir).pid == os.getpid()
    assert len(notes) == 1 and f"pid {child.pid}" in notes[0] and "ended without releasing" in notes[0]
    with run_lock(run_dir, notify=notes.append):  # a clean release leaves no record: no note the next time
        pass
    assert len(notes) == 1


def test_a_clean_exit_leaves_no_stale_record(tmp_path):
    run_dir = tmp_path / "run"
    child = hold(run_dir, seconds=0.0)
    assert child.wait() == 0
    notes = []
    with run_lock(run_dir, notify=notes.append):
        pass
    assert notes == []


def test_a_holder_on_another_host_is_refused_and_named(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = Holder(4242, "other-node", "fitdqn train --out run", "2026-01-01T00:00:00+00:00")
    (run_dir / LOCK_NAME).write_text(json.dumps(record.to_json()))
    with pytest.raises(RunInUse, match="pid 4242 on other-node.*another host.*delete"):
        with run_lock(run_dir):
            pass


def test_the_lock_is_reentrant_in_one_process(tmp_path):
    with run_lock(tmp_path) as outer, run_lock(tmp_path) as inner:
        assert inner is outer
    with run_lock(tmp_path):  # released: taken again
        pass


def test_train_and_evaluate_refuse_a_run_another_process_writes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    child = hold(run_dir)
    try:
        assert main(["train", "--data", "synthetic", "--train.device", "cpu", "--out", str(run_dir)]) \
            == EXIT_USER_ERROR
        assert f"in use by pid {child.pid}" in capsys.readouterr().err
        assert main(["evaluate", str(run_dir), "--device", "cpu"]) == EXIT_USER_ERROR
        assert f"in use by pid {child.pid}" in capsys.readouterr().err
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # nothing written beside the holder
        (run_dir / "config.toml").write_text(dump_config(Config()))  # what the writer wrote is not the reason
        assert main(["train", "--data", "synthetic", "--train.device", "cpu", "--out", str(run_dir)]) \
            == EXIT_USER_ERROR
        assert f"in use by pid {child.pid}" in capsys.readouterr().err
        assert main(["train", "--resume", str(run_dir)]) == EXIT_USER_ERROR  # a second resume: refused too
        assert f"in use by pid {child.pid}" in capsys.readouterr().err
    finally:
        child.kill()
        child.wait()


def test_a_missing_run_is_not_created_by_a_reader(tmp_path, capsys):
    missing = tmp_path / "missing"
    with run_lock(missing, create=False) as holder:
        assert holder is None
    assert main(["evaluate", str(missing), "--device", "cpu"]) == EXIT_USER_ERROR
    assert "no config.toml" in capsys.readouterr().err
    assert not missing.exists()


def test_act_and_export_wait_their_turn_only_when_writing_into_the_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    child = hold(run_dir)
    try:
        for args in (["act", str(run_dir), "--data", "synthetic"],  # default --out: RUN_DIR/actions.csv
                     ["export", str(run_dir), "--out", str(run_dir / "policy.pt2")]):
            assert main(args) == EXIT_USER_ERROR
            assert f"in use by pid {child.pid}" in capsys.readouterr().err
        assert main(["export", str(run_dir), "--out", str(tmp_path / "policy.pt2")]) == EXIT_USER_ERROR
        assert "no config.toml" in capsys.readouterr().err  # writing elsewhere: not refused for the lock
    finally:
        child.kill()
        child.wait()


def test_a_lock_file_that_is_not_a_record_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text("edited by hand")
    notes = []
    with run_lock(tmp_path, notify=notes.append):
        pass
    assert len(notes) == 1 and "a record fitdqn cannot read" in notes[0]
