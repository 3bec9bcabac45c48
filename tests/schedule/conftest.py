import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
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


@pytest.fixture(scope="session")
def postgres_url():
    """A real PostgreSQL server in a temporary folder (pgserver ships its binaries in the wheel), as an SQLAlchemy
    URL with the psycopg driver; stopped and removed at the end."""
    pgserver = pytest.importorskip("pgserver", reason="pgserver (test extra) ships the PostgreSQL server: "
                                   "pip install -e '.[test]'")
    pytest.importorskip("psycopg", reason="psycopg (test extra) is the PostgreSQL driver: pip install -e '.[test]'")
    folder = tempfile.mkdtemp(prefix="fitdqn-pg-")  # short: the server's socket path has a length limit
    try:
        server = pgserver.get_server(folder, cleanup_mode="stop")
    except Exception as error:  # noqa: BLE001 - whatever stops the server from starting here is the reason to skip
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(f"the PostgreSQL server of pgserver cannot start on this machine: {error}")
    yield server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    server.cleanup()
    shutil.rmtree(folder, ignore_errors=True)
