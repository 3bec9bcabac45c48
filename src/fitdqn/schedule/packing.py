"""How many runs at once, and which to start: a pure function of each run's memory share, the free memory, the
cores and the user's cap, so that it is tested on devices of any size without one.

A run's share is the free memory its own plan needs (``fitdqn.schedule.shares``): it is started with its allocator
capped there and plans within it. Runs start in queue order, first fit: a run that does not fit in what the running
ones leave waits, and a later smaller one may start before it. The shares of the runs at once never add up to more
than the free memory (zero over-commit); a run alone whose share is more than the free memory is started alone,
uncapped (its own plan then says what it lacks). Each run needs a core of its own at least: no more run at once than
cores, and the threads are split evenly between the runs at once (``Packing.threads``), decided before the first
starts so that every run of a workload has the same threads (on a CPU, the same figures as alone with them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

AUTO = 0  # --parallel auto: as many at once as fit


@dataclass(frozen=True)
class Packing:
    """The runs of a workload at once on one device: at most ``at_once``, each with ``threads`` CPU threads."""

    at_once: int
    threads: int


def share_bytes(planned_bytes: int, headroom_fraction: float, margin_bytes: int) -> int:
    """The free memory a run is given for a plan of ``planned_bytes``: the planner keeps ``headroom_fraction`` of
    the free memory it sees unused, and ``margin_bytes`` cover what the allocator rounds up beyond the plan."""
    return math.ceil((planned_bytes + margin_bytes) / (1.0 - headroom_fraction))


def first_fit(shares: Sequence[int], free_bytes: int, slots: int) -> list[int]:
    """Indices of the waiting runs to start now, in queue order: each whose share fits in what is left of
    ``free_bytes`` once the earlier chosen are counted, at most ``slots`` of them."""
    chosen: list[int] = []
    left = free_bytes
    for index, share in enumerate(shares):
        if len(chosen) >= slots:
            break
        if share <= left:
            chosen.append(index)
            left -= share
    return chosen


def to_start(shares: Sequence[int] | None, waiting: int, free_bytes: int | None, slots: int, running: int) -> list[int]:
    """Which of the ``waiting`` runs to start now (indices in queue order).

    ``shares``: each waiting run's share, or None on a CPU (memory is not packed: the first ``slots`` start);
    ``free_bytes``: the free memory less the shares of the ``running`` runs; ``slots``: how many more may run
    (``Packing.at_once`` less the running). With nothing running and no share that fits, the first run starts
    alone (uncapped: see the module)."""
    if slots <= 0 or waiting == 0:
        return []
    if shares is None or free_bytes is None:
        return list(range(min(slots, waiting)))
    chosen = first_fit(shares, free_bytes, slots)
    if not chosen and running == 0:
        return [0]
    return chosen


def packing(shares: Sequence[int] | None, free_bytes: int | None, cores: int, cap: int) -> Packing:
    """How many of a workload's runs at once, and the threads of each.

    ``shares``: the runs' shares in queue order, or None on a CPU; ``cores``: the thread budget of all the runs
    together; ``cap``: the user's ``--parallel K`` (``AUTO``: as many as fit). On a CPU, auto is one run at a
    time with every thread (one run's threads already use the cores); ``K`` splits the threads K ways. On a GPU,
    auto is as many as fit in the free memory together (first fit in queue order) and have a core each."""
    cores = max(int(cores), 1)
    if shares is None or free_bytes is None:
        at_once = cap if cap != AUTO else 1
    else:
        slots = min(len(shares), cores, cap if cap != AUTO else len(shares))
        at_once = max(len(first_fit(shares, free_bytes, slots)), 1)
    return Packing(at_once=at_once, threads=max(cores // at_once, 1))
