"""What the queue-of-runs tests share: a one-epoch small run, its TOML, fitdqn in a child process, waiting."""

import os
import subprocess
import sys
import time
from pathlib import Path

import tomli_w
from support.small_run import SMALL_RUN

import fitdqn

# the small run in runs of one epoch, validated once: a queue's run takes seconds
TINY_RUN = {**SMALL_RUN, "train.epochs": 1, "train.eval_every": 1, "evaluate.bootstrap_samples": 200}


def toml_of(values: dict) -> str:
    nested: dict[str, dict] = {}
    for dotted, value in values.items():
        section, _, key = dotted.partition(".")
        nested.setdefault(section, {})[key] = value
    return tomli_w.dumps(nested)


def fitdqn_process(*args: str) -> subprocess.Popen:
    """``python -m fitdqn ARGS`` with this checkout's fitdqn and one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(fitdqn.__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "fitdqn", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(condition, seconds: float, step: float = 0.1):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(step)
    return None
