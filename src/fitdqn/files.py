"""Writing output files so that nothing already saved is lost, and a failed write is one clear line.

Every file fitdqn writes into a run directory (checkpoints, config, plan, reports, plots) goes through
:func:`atomic_write_bytes`: the bytes go to a temporary file beside the target, are flushed to disk, and the
temporary file is renamed over the target, so a crash, a full disk or a kill mid-write leaves the previous
version intact. The new file gets the permissions of any file the user creates (``0o666`` less the umask),
not the owner-only mode of a temporary file.
"""

from __future__ import annotations

import errno
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fitdqn.errors import UserError

CHECKPOINT_NAME = "checkpoint.pt"  # a run's latest checkpoint: everything a resume needs
BEST_NAME = "best.pt"  # the network with the best validation Sharpe so far: the one the run's report is about
NETWORKS = ("best", "last")  # which network a command loads: best.pt's, or the latest checkpoint's
STUDY_NAME = "study.json"  # a study directory's members (fitdqn.train.study), what makes a directory a study's
TEMP_SUFFIX = ".tmp"  # temporary files are ".<name>.<random>.tmp" beside their target

CAUSES = {
    errno.ENOSPC: "the disk is full: free some space",
    errno.EDQUOT: "the disk quota is used up: free some space",
    errno.EROFS: "the file system is read-only: give a folder you can write to",
    errno.EACCES: "permission denied: give a folder you can write to",
    errno.EPERM: "permission denied: give a folder you can write to",
    errno.EFBIG: "the file is larger than this file system allows",
    errno.EIO: "the device reported an input/output error",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "a folder is in the way of the file",
}


class FileWriteError(UserError):
    """A file could not be written; the message names the path and the cause (what was there is kept)."""


def describe_os_error(error: OSError, path: str | Path | None = None, doing: str = "cannot write") -> str:
    """One line naming the path and the cause of ``error`` (and how to fix it when the cause says)."""
    where = path if path is not None else (error.filename or "?")
    code = errno.errorcode.get(error.errno or 0, "")
    cause = CAUSES.get(error.errno or 0, error.strerror or str(error))
    return f"{doing} '{where}': {cause}" + (f" ({code})" if code else "")


def file_mode() -> int:
    """The mode a file the user creates gets: ``0o666`` less the process umask."""
    return 0o666 & ~current_umask()


def current_umask() -> int:
    """The process umask, read without changing it where Linux says it (else set and restored at once)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(file)`` on a temp file beside ``path``, fsync, then rename it into place.

    On any failure the temp file is removed and ``path`` keeps its previous content; an ``OSError`` (disk
    full, read-only folder, no permission) becomes a :class:`FileWriteError` naming ``path`` and the cause.
    """
    path = Path(path)
    temp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
        with os.fdopen(handle, "wb") as file:
            os.fchmod(file.fileno(), file_mode())
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException as error:
        if temp_name is not None:
            Path(temp_name).unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise FileWriteError(describe_os_error(error, path) + "; any earlier version of it is kept") from None
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, lambda file: file.write(text.encode()))


def atomic_savefig(fig: Any, path: str | Path, **savefig_kwargs: Any) -> Path:
    """``fig.savefig`` rendered in memory first, then written atomically (format from the suffix)."""
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lstrip(".") or "png", **savefig_kwargs)
    return atomic_write_bytes(path, lambda file: file.write(buffer.getvalue()))


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Delete temp files a killed write left in ``folder`` (they never replaced anything); returns them."""
    stale = [p for p in Path(folder).glob(f".*{TEMP_SUFFIX}") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
