"""Which code produced a figure: the commit benchmark results and run records name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

COMMIT_VARIABLE = "FITDQN_COMMIT"  # set where the tree travelled without its .git (a GPU machine's copy)


def code_commit() -> str:
    """``FITDQN_COMMIT`` if set, else :func:`checkout_commit` of the checkout fitdqn runs from."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    return checkout_commit(Path(__file__).parent)


def checkout_commit(directory: Path) -> str:
    """The short commit of the git checkout holding ``directory``, with ``+modified`` where its tracked files differ
    from that commit (a figure then came from code no commit holds: a copy whose ``.git`` is older than its files
    names the wrong commit otherwise); 'unknown' outside a checkout or without git."""
    head = _git(directory, "rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    changed = _git(directory, "status", "--porcelain", "--untracked-files=no")
    return f"{head}+modified" if changed else head


def _git(directory: Path, *args: str) -> str | None:
    """``git args`` run in ``directory``: its stripped output, None if git is missing or fails."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=False, cwd=directory)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_record() -> dict[str, str]:
    """What a run's report records of the code that made it: fitdqn's version and commit, PyTorch's version."""
    import torch

    from fitdqn import __version__

    return {"fitdqn": __version__, "commit": code_commit(), "torch": torch.__version__}
