"""What the benchmark scripts share: timing a call on its device, the allocator's peak, the result file.

A script run as ``python benchmarks/NAME.py`` has this folder first on ``sys.path`` and imports it as
``from _common import ...`` (the tests load the scripts the same way, ``tests/support/benchmarks.py``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: a timing boundary


def times_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones: on CUDA the time between
    two events recorded around each call (the calls queued back to back, one host sync after the last), on the CPU
    the wall clock around each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        sync(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def median_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 0) -> float:
    """The median of :func:`times_ms`."""
    return statistics.median(times_ms(fn, device, iters, warmup))


def seconds_of(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call of ``fn`` between two host syncs (its queued device work included)."""
    sync(device)
    begin = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - begin


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Bytes allocated at the peak of one call of ``fn`` beyond those allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)  # host sync: read the peak after the call
    return torch.cuda.max_memory_allocated(device) - before


def write_json(path: str | Path, result: Any, announce: bool = True) -> None:
    """``result`` as indented JSON at ``path`` (its folder made; values JSON does not know written as text),
    then ``wrote PATH`` unless ``announce`` is false."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    if announce:
        print(f"wrote {path}")
