"""A full disk, simulated two ways: a child process whose files may not grow past ``RLIMIT_FSIZE`` (SIGXFSZ
ignored, so a write past it fails with EFBIG as a full disk fails with ENOSPC: the same OSError path), and, where
this process may mount (root), a real 1 MiB tmpfs nearly full (ENOSPC) and a read-only one (EROFS). Every write
keeps the previous file whole, leaves no temp file and says in one line which path failed and why. One child
process makes every write (torch's import and torch.export are the slow part)."""

import json
import os
import resource
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

LIMIT = 256 * 1024  # bytes a file of the child may reach in the limited folder

WRITES = textwrap.dedent("""
    import json, resource, signal, sys
    import numpy as np, pandas as pd, torch
    from fitdqn.deploy.act import write_actions
    from fitdqn.deploy.export import save_program
    from fitdqn.errors import UserError
    from fitdqn.files import atomic_write_text
    from fitdqn.train.checkpoint import save_checkpoint

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails (EFBIG) instead of killing
    rows = np.random.default_rng(0).normal(size=(60_000, 4))
    frame = pd.DataFrame(rows, columns=list("abcd"))
    program = torch.export.export(torch.nn.Linear(256, 256), (torch.zeros(2, 256),))
    writes = {
        "decisions.csv": lambda path: write_actions(frame, path),
        "decisions.parquet": lambda path: write_actions(frame, path),
        "policy.pt2": lambda path: save_program(program, path, {}),
        "checkpoint.pt": lambda path: save_checkpoint(path, {"weights": torch.zeros(200_000)}),
        "report.json": lambda path: atomic_write_text(path, json.dumps(list(range(100_000)))),
    }
    for folder, limit in json.loads(sys.argv[1]):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        for name, write in writes.items():
            try:
                write(f"{folder}/{name}")
                print(json.dumps({"folder": folder, "name": name, "ok": True}), flush=True)
            except UserError as error:
                print(json.dumps({"folder": folder, "name": name, "error": str(error)}), flush=True)
""")
NAMES = ("decisions.csv", "decisions.parquet", "policy.pt2", "checkpoint.pt", "report.json")


def previous_files(folder):
    """A small valid earlier version of every file the child writes."""
    folder.mkdir(exist_ok=True)
    for name in NAMES:
        (folder / name).write_bytes(f"previous {name}".encode())
    return {name: (folder / name).read_bytes() for name in NAMES}


def mount_tmpfs(folder, options):
    return os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                                                capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{case: (folder, previous files, {name: result})} after one child wrote every file into every folder."""
    root = tmp_path_factory.mktemp("disks")
    cases = {"limited": (root / "limited", LIMIT), "unlimited": (root / "unlimited", resource.RLIM_INFINITY)}
    mounts = []
    full, read_only = root / "full", root / "read_only"
    for folder in (full, read_only):
        folder.mkdir()
    if mount_tmpfs(full, "size=1m") and mount_tmpfs(read_only, "size=1m"):
        mounts = [full, read_only]
        cases["full"] = (full, resource.RLIM_INFINITY)
        cases["read_only"] = (read_only, resource.RLIM_INFINITY)
    before = {case: previous_files(folder) for case, (folder, _) in cases.items()}
    if mounts:
        (full / "ballast").write_bytes(b"\0" * (1024 * 1024 - 96 * 1024))  # ~96 KiB left: the writes do not fit
        subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", WRITES, json.dumps([[str(f), n] for f, n in cases.values()])],
                              capture_output=True, text=True, env=env, timeout=600)
        after = {case: ({name: (folder / name).read_bytes() for name in NAMES}, list(folder.glob(".*.tmp")))
                 for case, (folder, _) in cases.items()}  # read before the disks go
    finally:
        for folder in mounts:
            subprocess.run(["umount", "-l", str(folder)], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {}
    for record in map(json.loads, done.stdout.splitlines()):
        results.setdefault(record["folder"], {})[record["name"]] = record
    return {case: (folder, before[case], after[case], results[str(folder)]) for case, (folder, _) in cases.items()}


def check_kept(case, cause):
    folder, before, (after, temp_files), results = case
    for name in NAMES:
        error = results[name].get("error", "")
        assert str(folder / name) in error and cause in error, (name, results[name])
        assert "\n" not in error and "Traceback" not in error
        assert after[name] == before[name], name  # the previous version, whole
    assert temp_files == []  # no temp file left behind


def test_a_file_too_large_for_the_disk_keeps_the_previous_one(written):
    check_kept(written["limited"], "the file is larger than this file system allows (EFBIG)")


def test_the_same_writes_succeed_without_the_limit(written):
    folder, _, _, results = written["unlimited"]  # the reference: the limit, not the writes, failed the others
    assert all(r.get("ok") for r in results.values()), results
    assert pd.read_parquet(folder / "decisions.parquet").shape == (60_000, 4)


def test_a_real_full_disk(written):
    if "full" not in written:
        pytest.skip("mounting a small tmpfs needs root")
    check_kept(written["full"], "the disk is full: free some space (ENOSPC)")


def test_a_read_only_disk(written):
    if "read_only" not in written:
        pytest.skip("mounting a small tmpfs needs root")
    check_kept(written["read_only"], "the file system is read-only: give a folder you can write to (EROFS)")
