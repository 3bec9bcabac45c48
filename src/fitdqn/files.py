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
import json
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


class RunFileError(UserError):
    """A file fitdqn wrote into a run and reads back is missing a part, damaged or edited; the message names the
    file and what to do."""


def describe_os_error(error: OSError, path: str | Path | None = None, doing: str = "cannot write") -> str:
    """One line naming the path and the cause of ``error`` (and how to fix it when the cause says)."""
    where = path if path is not None else error.filename
    code = errno.errorcode.get(error.errno or 0, "")
    cause = CAUSES.get(error.errno or 0, error.strerror or str(error))
    return (f"{doing} '{where}'" if where is not None else doing) + f": {cause}" + (f" ({code})" if code else "")


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
        cause = os_error_in(error)
        if cause is not None:
            raise FileWriteError(describe_os_error(cause, path) + "; any earlier version of it is kept") from None
        raise
    return path


# what C++ writers (torch.save's zip writer, torch.export.save) say when the Python file under them failed
WRAPPED_CAUSES = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
                  "File too large": errno.EFBIG, "Read-only file system": errno.EROFS,
                  "Permission denied": errno.EACCES, "Input/output error": errno.EIO}


def os_error_in(error: BaseException) -> OSError | None:
    """The ``OSError`` behind a failed write: ``error`` itself, one it was raised from or during (torch's C++
    writers raise a RuntimeError while the Python file's OSError is handled), or one its text names."""
    seen, link = set(), error
    while link is not None and id(link) not in seen:
        if isinstance(link, OSError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    if isinstance(error, RuntimeError):
        for words, code in WRAPPED_CAUSES.items():
            if words in str(error):
                return OSError(code, os.strerror(code))
    return None


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, lambda file: file.write(text.encode()))


def atomic_write_rendered(path: str | Path, render: Callable[[IO[bytes]], Any]) -> Path:
    """``render(buffer)`` into memory first, then the bytes written atomically: for small files whose writer
    must not meet a failing disk (``torch.export.save``'s C++ writer aborts the process when its file fails)."""
    buffer = io.BytesIO()
    render(buffer)
    return atomic_write_bytes(path, lambda file: file.write(buffer.getbuffer()))


def atomic_savefig(fig: Any, path: str | Path, **savefig_kwargs: Any) -> Path:
    """``fig.savefig`` rendered in memory first, then written atomically (format from the suffix)."""
    path = Path(path)
    return atomic_write_rendered(path, lambda buffer: fig.savefig(buffer, format=path.suffix.lstrip(".") or "png",
                                                                   **savefig_kwargs))


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Delete temp files a killed write left in ``folder`` (they never replaced anything); returns them."""
    stale = [p for p in Path(folder).glob(f".*{TEMP_SUFFIX}") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def read_run_file(path: str | Path, parse: Callable[[str], Any], fix: str) -> Any:
    """``parse(text)`` of a file fitdqn wrote into a run and reads back (fold.json, study.json, a report): a file
    that cannot be read, is not text, or that ``parse`` rejects (``ValueError``, ``KeyError``, ``TypeError``,
    ``IndexError``: a damaged or edited file) is a :class:`RunFileError` naming the file, the cause and ``fix``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise RunFileError(f"{describe_os_error(error, path, doing='cannot read')}; {fix}") from None
    except UnicodeDecodeError as error:
        raise RunFileError(f"'{path}' is not text (byte {error.start:,} is 0x{error.object[error.start]:02x}): it "
                           f"is damaged; {fix}") from None
    try:
        return parse(text)
    except json.JSONDecodeError as error:
        raise RunFileError(f"'{path}' is damaged or was edited: not JSON at line {error.lineno} column "
                           f"{error.colno} ({error.msg}); {fix}") from None
    except (ValueError, KeyError, TypeError, IndexError) as error:
        cause = f"no {error}" if isinstance(error, KeyError) else str(error) or type(error).__name__
        raise RunFileError(f"'{path}' is damaged or was edited ({cause}); {fix}") from None


def read_run_json(path: str | Path, fix: str, check: Callable[[Any], Any] = lambda data: data) -> Any:
    """A JSON file of a run, read by :func:`read_run_file`; ``check(data)`` builds the value (raising on a part
    missing or of the wrong kind)."""
    return read_run_file(path, lambda text: check(json.loads(text)), fix)
