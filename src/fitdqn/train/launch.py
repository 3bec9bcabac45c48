"""The launcher process behind ``fitdqn train --gpus N``: torchrun (``torch.distributed.run``, same arguments),
with a failed or killed rank turned into fitdqn's one line and exit status instead of torchrun's
``ChildFailedError`` traceback. ``python -m fitdqn.train.launch --standalone --nproc-per-node=N -m fitdqn ...``."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

RESUME_HINT = "a run with a checkpoint continues with fitdqn train --resume RUN_DIR and the same --gpus"


def failure_line(error: ChildFailedError) -> str:
    """The first rank that failed, how, and what to do."""
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with status {failure.exitcode} (its own message is above)"
    return f"rank {rank} (pid {failure.pid}) {how}; torchrun stopped the other ranks; {RESUME_HINT}"


def exit_status(error: ChildFailedError) -> int:
    """128 + the signal for a rank killed by one (as a shell says it), else the rank's status (1 at least)."""
    _, failure = error.get_first_failure()
    return 128 - failure.exitcode if failure.exitcode < 0 else max(failure.exitcode, 1)


def stop_ranks_left() -> None:
    """SIGKILL what this launcher started and is still running: torchrun stops its ranks at a signal, but under
    load a rank could outlive it (each rank leads its own process group, which goes with it)."""
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():  # no /proc (not Linux): torchrun's own stop alone
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])  # "pid (name) state ppid ..."
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(entry.name), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as error:
        stop_ranks_left()
        print(f"fitdqn train: error: {failure_line(error)}", file=sys.stderr)
        return exit_status(error)
    except SignalException as error:  # SIGTERM / SIGINT to the launcher: torchrun stopped the ranks
        stop_ranks_left()
        name = signal.Signals(error.sigval).name
        print(f"fitdqn train: interrupted ({name}): the ranks were stopped; {RESUME_HINT}", file=sys.stderr)
        return 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
