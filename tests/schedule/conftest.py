import shutil
import tempfile

import pytest


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
