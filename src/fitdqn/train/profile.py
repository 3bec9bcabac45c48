"""`fitdqn profile`: measure training speed across batch sizes on this GPU and write its profile TOML.

Bigger is not always faster: the profile's batch is the one that *trains* fastest, not the
largest that fits. On the present CUDA GPU:

1. plan with ``budget.batch_size = 0`` to get ``max_fitting_batch`` (capped by ``budget.max_batch``) and build
   one ``Trainer`` from that plan (replay, collector, networks allocated once, in plan order);
2. fill the replay (collector epochs) until the largest batch can be sampled;
3. for each batch size (powers of two from ``budget.min_batch`` up to the cap, or ``--batches``; without
   ``--batches``, past ``budget.max_batch`` too, doubling while the full-epoch samples/s still rises by more than
   ``RISE`` and the batch fits in memory and in what the replay can serve, ``next_batch_beyond``):
   - **update alone**: ``Trainer.set_batch_size``, capture the update graph (``Trainer.train_updates``: two
     warm-up updates, then the capture), then ``--update-iters`` graph replays, each timed with CUDA events;
     the median in ms (eager ``Trainer.update_step`` if ``train.cuda_graphs`` is off);
   - **full epochs**: ``--epochs-per-batch`` calls of ``Trainer.run_epoch`` (collect + the updates that use each
     transition ``train.sample_reuse`` times): samples/s = updates x batch / s, env steps/s, updates/s;
   - the allocator's peak (``torch.cuda.max_memory_allocated``) while that batch ran;
4. choose the batch (``choose_batch``): **the smallest batch whose full-epoch samples/s is within 5 % of the
   best measured** — a larger batch must pay for its memory with real speed;
5. write the profile TOML (``profile_toml``; same format as the shipped ``device/profiles/*.toml`` plus a
   ``[[measurements]]`` array) atomically, after checking ``device.profiles.parse_profile`` accepts it.

:func:`profile_gpu` does steps 1-5 with typed arguments (``fitdqn.cli.profile`` parses the options, probes the
device and asks for CUDA). Only the measuring (``measure_batches``) needs a GPU; naming, selection and the TOML
writer are pure functions tested on the CPU.
"""

from __future__ import annotations

import datetime
import gc
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch
from rich.console import Console
from rich.table import Table

from fitdqn.config import Config, with_overrides
from fitdqn.device.probe import DeviceInfo
from fitdqn.device.profiles import Profile, parse_profile
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.files import atomic_write_text
from fitdqn.plan.build import sampleable_capacity
from fitdqn.plan.calibrate import driver_overhead
from fitdqn.train.trainer import Trainer

TOLERANCE = 0.05  # a batch within 5 % of the best full-epoch samples/s is as good as the best
RISE = 0.01  # past budget.max_batch, batches are doubled while samples/s rises by more than this per doubling
PROFILE_STEPS_PER_EPOCH = 16  # env steps per epoch while profiling, unless --collect.steps_per_epoch is given
MEASUREMENT_KEYS = ("batch", "update_ms", "epoch_samples_per_s", "env_steps_per_s", "peak_bytes")
VENDOR_WORDS = ("nvidia", "geforce", "tesla", "quadro")


# ----------------------------------------------------------------------------------------------- pure parts
def power_of_two_batches(min_batch: int, max_batch: int) -> list[int]:
    """Powers of two from the first one >= ``min_batch`` up to ``max_batch`` (at least ``[min_batch]``)."""
    if max_batch < min_batch:
        return []
    batch = 1 << max(int(min_batch) - 1, 0).bit_length()
    batches = []
    while batch <= max_batch:
        batches.append(batch)
        batch *= 2
    return batches or [int(min_batch)]


def next_batch_beyond(rows: list[dict[str, Any]], limit: int) -> int | None:
    """The next batch to measure past the last one (twice it), while throughput still rises: the last row
    measured, without error, more than ``RISE`` above the row before in full-epoch samples/s, and the next batch
    within ``limit`` (what fits in memory and what the replay can serve). None: stop."""
    if len(rows) < 2 or any("error" in r for r in rows[-2:]):
        return None
    last, before = rows[-1].get("epoch_samples_per_s"), rows[-2].get("epoch_samples_per_s")
    if not isinstance(last, (int, float)) or not isinstance(before, (int, float)) or last <= (1 + RISE) * before:
        return None
    following = 2 * int(rows[-1]["batch"])
    return following if following <= limit else None


def choose_batch(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> int:
    """The smallest batch whose ``epoch_samples_per_s`` is within ``tolerance`` of the best row's.

    Rows without a positive ``epoch_samples_per_s`` (failed, out of memory) are ignored; none left is an error.
    """
    usable = [r for r in rows if isinstance(r.get("epoch_samples_per_s"), (int, float))
              and r["epoch_samples_per_s"] > 0]
    if not usable:
        raise UserError("no batch size was measured successfully: nothing to choose a profile batch from")
    best = max(r["epoch_samples_per_s"] for r in usable)
    return min(r["batch"] for r in usable if r["epoch_samples_per_s"] >= (1.0 - tolerance) * best)


def profile_name(card: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA GeForce RTX 3050 Laptop GPU' -> 'rtx-3050-laptop-gpu'."""
    words = [w for w in re.split(r"[^a-z0-9]+", card.lower()) if w and w not in VENDOR_WORDS]
    return "-".join(words) or "gpu"


def match_pattern(card: str) -> str:
    """The profile's match regex: exactly this card's name (another variant is another card: profile it)."""
    return "^" + re.escape(card.strip()).replace("\\ ", " ") + "$"  # spaces need no escape: keep it readable


def profile_toml(name: str, card: str, batch_size: int, total_memory: int | None, source: dict[str, Any],
                 measurements: list[dict[str, Any]], match: list[str] | None = None,
                 driver_bytes: int | None = None) -> str:
    """The profile file: a header comment, the shipped fields, [source] and [[measurements]]."""
    data: dict[str, Any] = {"name": name, "match": match if match is not None else [match_pattern(card)],
                            "batch_size": int(batch_size)}
    if total_memory is not None:
        data["total_memory"] = int(total_memory)
    if driver_bytes is not None:
        data["driver_bytes"] = int(driver_bytes)
    data["source"] = {"kind": "measured", **{k: v for k, v in source.items() if k != "kind"}}
    data["measurements"] = [{k: round(row[k], 4) if isinstance(row[k], float) else row[k]
                             for k in MEASUREMENT_KEYS if row.get(k) is not None} for row in measurements]
    header = [
        f"# fitdqn GPU profile: {card}",
        f"# Where the numbers came from: measured by `fitdqn profile` on this card on {source.get('date', '?')}.",
        "# batch_size is the smallest batch whose full-epoch training throughput (samples/s) is within "
        f"{TOLERANCE:.0%}",
        "# of the best measured (fitdqn.train.profile.choose_batch); [[measurements]] are the rows it chose from.",
        "# total_memory is in bytes" + (f" ({format_bytes(total_memory)})." if total_memory else "."),
        "# driver_bytes: the drop in the driver's free memory over the whole profiling run less the allocator's",
        "# growth (kernel images, cuBLAS handles, graph executables); the plan budgets it as cuda_driver.",
        "",
    ]
    return "\n".join(header) + tomli_w.dumps(data)


def check_profile_text(text: str, origin: str) -> Profile:
    """``device.profiles.parse_profile`` must accept what we write (it raises a UserError otherwise)."""
    return parse_profile(text, origin)


def write_profile(path: Path, text: str) -> Path:
    check_profile_text(text, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return path


def driver_version() -> str:
    """The NVIDIA driver from nvidia-smi where it answers, else the CUDA runtime PyTorch was built with."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=False).stdout.strip()
            if out:
                return out.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return f"unknown (CUDA runtime {torch.version.cuda})"


# ----------------------------------------------------------------------------------------------- measuring
def profile_config(config: Config, steps_given: bool) -> Config:
    """The config the profile runs: auto batch (the plan gives the cap), short epochs unless given, and no floor of
    updates (an epoch makes what train.sample_reuse gives at each batch: the throughput of the run as set)."""
    overrides: dict[str, Any] = {"budget.batch_size": 0, "train.min_updates": 0}
    if not steps_given:
        overrides["collect.steps_per_epoch"] = min(config.collect.steps_per_epoch or PROFILE_STEPS_PER_EPOCH,
                                                       PROFILE_STEPS_PER_EPOCH)
    return with_overrides(config, overrides)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: a measurement boundary


def time_updates(trainer, iters: int) -> float:
    """Median ms of one update (graph replay, or eager update_step): CUDA events around each on a GPU,
    the wall clock elsewhere (the measuring runs on any device; ``fitdqn profile`` itself asks for CUDA)."""
    device = trainer.device
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            trainer.train_updates(1)
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        trainer.train_updates(1)
        end.record()
    sync(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def fill_replay(trainer, needed: int, max_epochs: int = 1000) -> None:
    """Collect until ``needed`` transitions can be sampled (and ``replay.min_fill``)."""
    needed = max(needed, trainer.config.replay.min_fill)
    for _ in range(max_epochs):
        if int(trainer.system.replay.sampleable()) >= needed:  # host sync
            return
        trainer.collect()
    raise UserError(f"the replay did not reach {needed} sampleable transitions: raise collect.num_envs or "
                    "collect.steps_per_epoch, or lower replay.min_fill")


def measure_batch(trainer, batch: int, epochs: int, update_iters: int) -> dict[str, Any]:
    """One row: update alone (median ms), full epochs (samples/s, env steps/s), allocator peak."""
    device = trainer.device
    cuda = device.type == "cuda"
    trainer.set_batch_size(batch)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train_updates(3)  # warm-up; on CUDA graphs this captures the update at this batch
    update_ms = time_updates(trainer, update_iters)
    updates = env_steps = 0
    seconds = 0.0
    for _ in range(epochs):
        stats = trainer.run_epoch()
        updates += stats.updates
        env_steps += stats.env_steps
        seconds += stats.seconds
    sync(device)
    return {
        "batch": batch, "update_ms": update_ms, "updates_per_s": 1e3 / update_ms if update_ms > 0 else None,
        "update_samples_per_s": batch * 1e3 / update_ms if update_ms > 0 else None,
        "epoch_samples_per_s": updates * batch / seconds if seconds > 0 else None,
        "env_steps_per_s": env_steps / seconds if seconds > 0 else None,
        "epoch_updates": updates, "epoch_seconds": seconds,
        "peak_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
    }


def measure_batches(config: Config, device: DeviceInfo, batches: list[int] | None, epochs: int,
                    update_iters: int, console=None) -> tuple[list[dict[str, Any]], Any, int | None]:
    """Build the trainer once and measure each batch; an out-of-memory batch is a row with an error.
    Returns the rows, the trainer and the driver-side bytes of the whole run (``driver_side_bytes``)."""
    before = driver_memory(device)
    trainer = Trainer(config, device)
    plan = trainer.plan
    cap = min(plan.max_fitting_batch or config.budget.max_batch, config.budget.max_batch)
    extend = batches is None  # past the cap while throughput still rises (next_batch_beyond)
    if batches is None:
        batches = power_of_two_batches(config.budget.min_batch, cap)
        if not batches:
            raise UserError(f"no batch from budget.min_batch = {config.budget.min_batch} fits (largest: {cap})")
    limit = min(plan.max_fitting_batch or cap, sampleable_capacity(trainer.config, plan.replay_capacity or 0))
    fill_replay(trainer, max(batches))
    rows = []
    queue = list(batches)
    while queue:
        batch = queue.pop(0)
        if batch > max(batches):
            fill_replay(trainer, batch)
        if console is not None:
            console.print(f"batch {batch} ...", highlight=False)
        try:
            row = measure_batch(trainer, batch, epochs, update_iters)
        except torch.OutOfMemoryError as error:
            row = {"batch": batch, "error": f"out of memory: {str(error).splitlines()[0][:160]}"}
            trainer.set_batch_size(min(batches))
            trainer.pending = None
            gc.collect()
            if trainer.device.type == "cuda":
                torch.cuda.empty_cache()
        if batch > cap:
            row["note"] = (f"beyond budget.max_batch = {config.budget.max_batch}: throughput still rose"
                           if extend else f"above the planned largest batch {cap}")
        rows.append(row)
        if extend and not queue:
            following = next_batch_beyond(rows, limit)
            queue += [following] if following is not None else []
    return rows, trainer, driver_side_bytes(before, driver_memory(device))


def driver_memory(device: DeviceInfo) -> tuple[int, int] | None:
    """``(free bytes the driver reports, bytes PyTorch's allocator reserves)`` now; None off CUDA."""
    if device.kind != "cuda":
        return None
    index = torch.device("cuda", device.index or 0)
    torch.cuda.synchronize(index)
    return int(torch.cuda.mem_get_info(index)[0]), int(torch.cuda.memory_reserved(index))


def driver_side_bytes(before: tuple[int, int] | None, after: tuple[int, int] | None) -> int | None:
    """What the driver took outside the allocator between two ``driver_memory`` readings (kernel images loaded
    lazily, cuBLAS handles, graph executables): ``calibrate.driver_overhead`` of them."""
    if before is None or after is None:
        return None
    (free_before, reserved_before), (free_after, reserved_after) = before, after
    return driver_overhead(free_before, free_after, reserved_before, reserved_after)


def print_profile(rows: list[dict[str, Any]], chosen: int, title: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=title, title_justify="left")
    for column in ("batch", "update ms", "update samples/s", "epoch samples/s", "env steps/s", "peak memory", ""):
        table.add_column(column, justify="right" if column else "left", no_wrap=not column)
    number = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for row in rows:
        if "error" in row:
            table.add_row(str(row["batch"]), "-", "-", "-", "-", "-", row["error"])
            continue
        table.add_row(
            str(row["batch"]), number(row.get("update_ms"), ".3f"), number(row.get("update_samples_per_s"), ",.0f"),
            number(row.get("epoch_samples_per_s"), ",.0f"), number(row.get("env_steps_per_s"), ",.0f"),
            format_bytes(row["peak_bytes"]) if row.get("peak_bytes") is not None else "-",
            "chosen" if row["batch"] == chosen else row.get("note", ""),
            style="bold" if row["batch"] == chosen else None,
        )
    console.print(table)


@dataclass(frozen=True)
class ProfileResult:
    """What :func:`profile_gpu` measured, chose and wrote (``path``)."""

    name: str
    card: str
    batch_size: int
    path: Path
    rows: list[dict[str, Any]]
    driver_bytes: int | None
    source: dict[str, Any]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "batch_size": self.batch_size, "path": str(self.path), "rows": self.rows,
                "driver_bytes": self.driver_bytes, "source": self.source, "seconds": self.seconds}


def profile_gpu(config: Config, device: DeviceInfo, *, batches: list[int] | None, epochs_per_batch: int,
                update_iters: int, name: str, out: Path, command: str, console: Console | None) -> ProfileResult:
    """Measure ``config`` (see :func:`profile_config`) on ``device`` at ``batches`` (None: powers of two up to
    the plan's largest, see the module docstring), choose the profile batch and write the profile TOML to
    ``out``. ``command``: the command line recorded as the profile's source; ``console``: progress lines, or
    None for none."""
    if epochs_per_batch < 1 or update_iters < 1:
        raise UserError(f"epochs_per_batch ({epochs_per_batch}) and update_iters ({update_iters}) must be at least 1")
    started = time.perf_counter()
    rows, trainer, driver_bytes = measure_batches(config, device, batches, epochs_per_batch, update_iters, console)
    chosen = choose_batch(rows)
    source = {
        "kind": "measured",
        "description": f"measured by `fitdqn profile` on {device.name}: smallest batch within "
                       f"{TOLERANCE:.0%} of the best full-epoch samples/s",
        "date": datetime.date.today().isoformat(),
        "command": command,
        "card": device.name,
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "num_envs": trainer.config.collect.num_envs,
        "steps_per_epoch": trainer.config.collect.steps_per_epoch,
        "sample_reuse": trainer.config.train.sample_reuse,
        "cuda_graphs": trainer.config.train.cuda_graphs,
        "precision": trainer.config.learn.precision,
    }
    del trainer  # its replay and graphs go before the file is written
    text = profile_toml(name, device.name, chosen, device.total_bytes, source,
                        [r for r in rows if "error" not in r], driver_bytes=driver_bytes)
    write_profile(out, text)
    return ProfileResult(name, device.name, chosen, out, rows, driver_bytes, source, time.perf_counter() - started)
