"""Which code produced a figure: the commit benchmark results and run records name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

COMMIT_VARIABLE = "FITDQN_COMMIT"  # set where the tree travelled without its .git (a GPU machine's copy)


def code_commit() -> str:
    """``FITDQN_COMMIT`` if set, else the short commit of the git checkout fitdqn runs from, else 'unknown'."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).parent)
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def code_record() -> dict[str, str]:
    """What a run's report records of the code that made it: fitdqn's version and commit, PyTorch's version."""
    import torch

    from fitdqn import __version__

    return {"fitdqn": __version__, "commit": code_commit(), "torch": torch.__version__}
