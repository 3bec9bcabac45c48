"""``fitdqn train --gpus N``'s launcher: a rank killed by a signal, or one that fails, ends the job with fitdqn's
one line and exit status, not torchrun's ChildFailedError traceback (real torchrun, real processes, on the CPU)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

RANK = textwrap.dedent("""
    import os, signal, sys, time
    if os.environ["RANK"] == "1":
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("fitdqn train: error: the rank's own message", file=sys.stderr)
        sys.exit(2)
    time.sleep(120)  # rank 0 waits: torchrun stops it when rank 1 ends
""")


@pytest.mark.parametrize("how, status, says", [
    ("kill", 128 + 9, "rank 1 (pid {pid}) was killed by SIGKILL; torchrun stopped the other ranks"),
    ("exit", 2, "rank 1 (pid {pid}) exited with status 2 (its own message is above)"),
])
def test_a_failed_rank_is_one_line_and_the_exit_status(tmp_path, how, status, says):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "fitdqn.train.launch", "--standalone", "--nproc-per-node=2",
                           str(script), how], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == status
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fitdqn train: error: rank 1 (pid ") and "--resume RUN_DIR" in last
    pid = last.split("(pid ")[1].split(")")[0]
    assert says.format(pid=pid) in last


def test_sigterm_to_the_launcher_stops_the_ranks_with_one_line(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text('import time\nprint("started", flush=True)\ntime.sleep(120)\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "fitdqn.train.launch", "--standalone", "--nproc-per-node=2",
                                 str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert launcher.stdout.readline().strip() == "started"  # a rank runs
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "fitdqn train: interrupted (SIGTERM): the ranks were stopped")
