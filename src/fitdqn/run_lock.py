"""One writer per run directory: an advisory lock on a file inside the folder, with a record of who holds it.

Every command that writes into a run directory (``train``, ``train --resume``, ``evaluate``, ``act`` and
``export`` writing into the run, a study's members, a tune trial) holds :func:`run_lock` on that folder while
it works. A second writer is refused at once with one line naming the holder's pid, command, host and start.

The lock is ``fcntl.flock`` on ``RUN_DIR/.fitdqn.lock``: the kernel releases it when its holder ends in any way
(kill -9 included), so a dead holder on this host never blocks a new writer. The file also holds a JSON record
of the holder (pid, host, command, start time), cleared on a clean release: a record found by a writer that got
the lock is one that ended without releasing it, and is named (the new writer takes over). A record of a holder
on another host is refused: on a shared file system fitdqn cannot tell from here whether that process still
runs, so the message says how to take the folder over once it does not. The lock file is never renamed or
deleted (a lock is on the file itself: a new file would be a second lock).

Locks are re-entrant within a process (``evaluate`` on a study holds the study's folder and then each member's).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitdqn.errors import UserError
from fitdqn.files import describe_os_error

LOCK_NAME = ".fitdqn.lock"  # inside the run directory
RECORD_LIMIT = 4096  # bytes of the holder record read back (a record is ~200)
COMMAND_SHOWN = 100  # characters of the holder's command a refusal shows


class RunInUse(UserError):
    """Another process writes into the run directory; the message names it and what to do."""


@dataclass
class Holder:
    """Who holds (or held) a run directory's lock: from the record in its lock file."""

    pid: int
    host: str
    command: str
    started: str

    def describe(self) -> str:
        command = self.command if len(self.command) <= COMMAND_SHOWN else self.command[: COMMAND_SHOWN - 3] + "..."
        return f"pid {self.pid} on {self.host} ({command}; since {self.started})"

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": self.host, "command": self.command, "started": self.started}


# resolved folder -> its holder record: the locks this process holds (re-entrant)
_HELD: dict[Path, Holder] = {}


def this_command() -> str:
    """The command line of this process, as the user typed it (``fitdqn train --out X``)."""
    argv = list(sys.argv)
    first = Path(argv[0]).name if argv else "python"
    if first == "__main__.py":
        first = "python -m fitdqn"
    return " ".join([first, *argv[1:]])[:300]


def host_name() -> str:
    return socket.gethostname() or "?"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts as ended)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_holder(file) -> Holder | None:
    """The record in an open lock file, or None when it is empty or not a record."""
    file.seek(0)
    text = file.read(RECORD_LIMIT)
    if not text.strip():
        return None
    try:
        record = json.loads(text)
        return Holder(int(record["pid"]), str(record["host"]), str(record["command"]), str(record["started"]))
    except (ValueError, KeyError, TypeError):  # not a record fitdqn wrote: taken for one of this host's
        return Holder(0, host_name(), "a record fitdqn cannot read", "?")


def write_holder(file, holder: Holder) -> None:
    file.seek(0)
    file.truncate()
    file.write(json.dumps(holder.to_json()))
    file.flush()
    os.fsync(file.fileno())


def refusal(run_dir: Path, holder: Holder | None) -> str:
    """The one line a second writer gets."""
    if holder is None:
        return (f"'{run_dir}' is in use by another fitdqn process (its lock is held; no record of it yet): one "
                "writer per run directory; wait for it to end, or give another folder")
    ended = holder.host == host_name() and not pid_alive(holder.pid)
    who = holder.describe() + (", which has ended, but a process it started still holds the lock" if ended else "")
    return (f"'{run_dir}' is in use by {who}: one writer per run directory; wait for it to end or stop it "
            f"(kill {holder.pid}), or give another folder")


def other_host_refusal(run_dir: Path, holder: Holder) -> str:
    return (f"'{run_dir}' is locked by {holder.describe()}, another host: fitdqn cannot tell from here whether it "
            f"still runs; wait for it, or if it has ended delete '{run_dir / LOCK_NAME}' and run again")


def stale_note(run_dir: Path, holder: Holder) -> str:
    return (f"note: the last writer of '{run_dir}', {holder.describe()}, ended without releasing its lock "
            "(killed?); this process takes the run over")


def print_note(text: str) -> None:
    print(text, file=sys.stderr)


@contextlib.contextmanager
def run_lock(run_dir: str | Path, command: str | None = None, notify: Callable[[str], None] = print_note,
             create: bool = True) -> Iterator[Holder | None]:
    """Hold ``run_dir``'s lock while the block runs; :class:`RunInUse` at once when another process holds it.
    ``create``: make the folder when missing (a new run), else a missing folder holds nothing to protect and the
    block runs unlocked (yielding None: the command's own message says the run is not there). ``command`` is
    recorded for the message a second writer gets (default: this process's command line); ``notify`` gets the
    note about a stale record taken over."""
    run_dir = Path(run_dir)
    if not create and not run_dir.is_dir():
        yield None
        return
    key = run_dir.resolve()
    if key in _HELD:  # re-entrant: this process holds it already (the outermost block releases it)
        yield _HELD[key]
        return
    path = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(describe_os_error(error, run_dir, doing="cannot create the run directory")) from None
    try:
        file = open(path, "a+")  # never truncated by opening: the holder's record stays readable
    except OSError as error:
        raise UserError(describe_os_error(error, path, doing="cannot lock the run directory at")) from None
    try:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUse(refusal(run_dir, read_holder(file))) from None
        except OSError as error:  # a file system without locks
            raise UserError(describe_os_error(error, path, doing="cannot lock the run directory at")) from None
        previous = read_holder(file)
        if previous is not None and previous.host != host_name():
            raise RunInUse(other_host_refusal(run_dir, previous))
        if previous is not None and previous.pid != os.getpid():
            notify(stale_note(run_dir, previous))
        holder = Holder(os.getpid(), host_name(), command or this_command(),
                        datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
        try:
            write_holder(file, holder)
        except OSError as error:
            raise UserError(describe_os_error(error, path, doing="cannot lock the run directory at")) from None
        _HELD[key] = holder
        try:
            yield holder
        finally:
            del _HELD[key]
            with contextlib.suppress(OSError):  # a clean release leaves no record (the folder may be gone)
                file.seek(0)
                file.truncate()
    finally:
        file.close()  # releases the flock


def held(run_dir: str | Path) -> tuple[bool, Holder | None]:
    """Whether another process holds ``run_dir``'s lock now, and its record (None until it has written one)."""
    path = Path(run_dir) / LOCK_NAME
    if not path.is_file() or Path(run_dir).resolve() in _HELD:
        return False, None
    with open(path) as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, read_holder(file)
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
    return False, None


def check_not_in_use(run_dir: str | Path) -> None:
    """:class:`RunInUse` when another process holds ``run_dir``'s lock now: checked before anything else looks at
    the folder (what a running writer has put there is not a reason the user should act on)."""
    busy, holder = held(run_dir)
    if busy:
        raise RunInUse(refusal(Path(run_dir), holder))
