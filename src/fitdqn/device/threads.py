"""CPU threads for torch: as many as the cores this process may really use, set once when a command starts.

PyTorch sizes its intra-op pool from the machine's cores, which in a container or under ``taskset`` can be far more
than the process gets: on 2 usable cores a pool of 16 threads spends its time waiting for each other. The usable
count is the CPU affinity mask, capped by a cgroup CPU quota (``cpu.max``, cgroup v2; ``cpu.cfs_quota_us``, v1).
Of those, auto takes the ones the machine's other work leaves idle (its cores less the 1-minute load average,
at least 1): a thread that waits for a busy core holds up the pool's others at every operation. Measured on a
2-core CPU shared with other jobs (load 1.4-12), the default synthetic run: 2 epochs of the small nets took 47 s
with 1 thread against 96 s with 2 (load 1.4-5.5); the first epoch updated at 8.5 against 0.4 updates/s with the
small nets and 0.3 against 0.2 with the full widths (load 6-12); one epoch at load 10-12 took 236 s (small) and
378 s (full) with 1 thread, while with 2 neither had ended after 15 min. An idle machine keeps every core.
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
