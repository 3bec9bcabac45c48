"""CPU threads for torch: as many as the cores this process may really use, set once when a command starts.

PyTorch sizes its intra-op pool from the machine's cores, which in a container or under ``taskset`` can be far more
than the process gets: on 2 usable cores a pool of 16 threads spends its time waiting for each other. The usable
count is the CPU affinity mask, capped by a cgroup CPU quota (``cpu.max``, cgroup v2; ``cpu.cfs_quota_us``, v1).
Of those, auto takes the ones the machine's other work leaves idle (its cores less the 1-minute load average,
at least 1): a thread that waits for a busy core holds up the pool's others at every operation. Measured on a
2-core CPU shared with other jobs, one epoch of the default synthetic run (200 updates at batch 256), 1 thread
against 2 at load 3.4-5.6: the small nets 16.9 against 0.7 updates/s (24 s against 339 s for the whole run), the
full widths 2.4 against 0.4 updates/s (99 s against an evaluation still running at 600 s); the same losses and
validation Sharpe either way. An idle machine keeps every core.
``OMP_NUM_THREADS`` (what PyTorch itself reads) wins over that count, and ``train.threads`` over both; a run
records the count it used in its config.toml.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from fitdqn.errors import UserError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (``quota / period``), or None without a quota."""
    try:
        fields = (root / "cpu.max").read_text().split()  # v2: "max 100000" or "200000 100000"
        if len(fields) == 2 and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return None
    except (OSError, ValueError):
        pass
    try:  # v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may run on: the affinity mask, capped by the cgroup quota (rounded up), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(count, 1)


def omp_num_threads(environ: dict[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` as a positive count, None when unset; anything else is a UserError."""
    text = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    if not text:
        return None
    first = text.split(",")[0]  # OpenMP allows a list per nesting level; the first is the outer pool
    if not first.isdigit() or int(first) < 1:
        raise UserError(f"OMP_NUM_THREADS={text!r}: give a positive whole number of threads, or unset it")
    return int(first)


def idle_cpus(root: Path = CGROUP_ROOT, load: float | None = None) -> int:
    """:func:`usable_cpus` less the busy ones: at most the machine's cores less ``load`` (the 1-minute load
    average: the runnable tasks of every process, this one's start included), rounded, and at least 1."""
    usable = usable_cpus(root)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average (not on Unix): every usable core
            return usable
    idle = round((os.cpu_count() or usable) - load)
    return max(1, min(usable, idle))


def cpu_threads(requested: int, environ: dict[str, str] | None = None, root: Path = CGROUP_ROOT,
                load: float | None = None) -> int:
    """``requested`` (``train.threads``) if positive, else ``OMP_NUM_THREADS`` if set, else :func:`idle_cpus`."""
    if requested > 0:
        return int(requested)
    return omp_num_threads(environ) or idle_cpus(root, load)


def set_torch_threads(requested: int) -> int:
    """Size torch's intra-op pool (:func:`cpu_threads`); returns the count."""
    count = cpu_threads(requested)
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count
