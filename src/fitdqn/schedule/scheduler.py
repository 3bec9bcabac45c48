"""Runs taken from a queue and run as packed processes on this machine's device.

Before the first run starts, the device is probed and each run's share planned in a separate process
(``fitdqn.schedule.shares``: this one holds no CUDA context), and the packing decided
(``fitdqn.schedule.packing``): how many at once, the threads of each. Then, until the queue has nothing left for
this machine: start what fits (first fit, in queue order, in the free memory less the shares of the running runs),
each in its own process (``fitdqn.schedule.member``) capped at its share, and collect each that ends. A run whose
report already exists is recorded, never run again (the run directory decides, not the queue); a run interrupted
goes back to the queue with its checkpoint; a run that fails is recorded with its log's last lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console

import fitdqn
from fitdqn.config import Config, config_to_dict
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.schedule.member import EXIT_INTERRUPTED, LOG_FILE, REPORT_FILE, SPEC_FILE
from fitdqn.schedule.packing import Packing, packing, to_start
from fitdqn.schedule.queue import Run, RunQueue
from fitdqn.schedule.shares import planning_config
from fitdqn.train.checkpoint import atomic_write_text

POLL_SECONDS = 0.2  # how often running runs are checked
IDLE_SECONDS = 1.0  # how often a scheduler running nothing looks at the queue again (runs of other workers)
STOP_SECONDS = 60.0  # how long an interrupted run may take to save its checkpoint


def worker_env(threads: int) -> dict[str, str]:
    """A run process's environment: its threads, and the same fitdqn as this process."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    source = str(Path(fitdqn.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p)
    return env


def interrupt_with_parent() -> None:
    """In a run process, before it runs: on Linux, a SIGINT when the process that started it dies (even by SIGKILL),
    so no orphaned run keeps its share of the GPU (it saves its checkpoint and stops)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)


def config_key(config: Config) -> str:
    return json.dumps(config_to_dict(planning_config(config)), sort_keys=True)


@dataclass(frozen=True)
class Resources:
    """This machine's device for a workload: the packing, the free and total memory (None on a CPU), and each
    distinct run config's share (by :func:`config_key`)."""

    packing: Packing
    free_bytes: int | None
    total_bytes: int | None
    shares: dict[str, int]
    description: str

    def share(self, config: Config) -> int | None:
        """The run's share; a config not planned before the first run started (queued since) is given the whole
        free memory: it runs alone, never over-committed."""
        return None if self.free_bytes is None else self.shares.get(config_key(config), self.free_bytes)


def probe_shares(device_spec: str, configs: list[Config], described: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The device and each config's share, planned by a separate process (``fitdqn.schedule.shares``);
    ``described``: the device probed before (JSON), planned as a what-if device with no GPU visible."""
    env = worker_env(1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "configs.json"
        path.write_text(json.dumps([config_to_dict(c) for c in configs]))
        command = [sys.executable, "-m", "fitdqn.schedule.shares", device_spec, str(path)]
        if described is not None:
            (Path(folder) / "device.json").write_text(json.dumps(described))
            command.append(str(Path(folder) / "device.json"))
            env["CUDA_VISIBLE_DEVICES"] = ""
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    try:
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise UserError(f"planning the runs' shares of device '{device_spec}' in a new process failed: "
                        f"{done.stderr.strip()[-2000:]}") from None
    if "error" in info:
        raise UserError(info["error"])
    return info


def gpu_possible(device_spec: str) -> bool:
    """Whether ``device_spec`` may name a GPU here (else no process is started to probe it)."""
    if device_spec == "cpu":
        return False
    import torch  # what the runs use; is_available() makes no CUDA context

    return torch.cuda.is_available()


def plan_resources(runs: list[Run], device_spec: str, cores: int, cap: int) -> Resources:
    """Probe the device, plan the shares of the runs' distinct configs, decide the packing."""
    distinct = {config_key(r.config): r.config for r in runs}
    if not gpu_possible(device_spec):
        info = {"device": {"kind": "cpu"}, "shares": [None] * len(distinct)}
    else:
        info = probe_shares(device_spec, list(distinct.values()))
    device = info["device"]
    if device["kind"] != "cuda":
        pack = packing(None, None, cores, cap)
        return Resources(pack, None, None, {}, f"{pack.at_once} run(s) at once, {pack.threads} thread(s) each "
                         f"(of {cores})")
    shares = dict(zip(distinct, info["shares"], strict=True))
    free = int(device["free_bytes"])
    pack = packing([shares[config_key(r.config)] for r in runs], free, cores, cap)
    sizes = ", ".join(sorted({format_bytes(s) for s in shares.values()}))
    return Resources(pack, free, int(device["total_bytes"]), shares,
                     f"{device['name']}: {format_bytes(free)} free; each run planned within its share ({sizes}); "
                     f"up to {pack.at_once} run(s) at once, {pack.threads} thread(s) each (of {cores})")


@dataclass
class Started:
    run: Run
    process: subprocess.Popen
    log: IO[str]
    share: int | None
    started: float = field(default_factory=time.monotonic)


def read_report(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / REPORT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def log_tail(run_dir: Path, lines: int = 20) -> str:
    try:
        return "\n".join((run_dir / LOG_FILE).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Scheduler:
    """Take runs from ``queue`` and run them as packed processes until nothing is left for this machine.

    ``wait_for_others``: while runs of the queue run elsewhere (other workers), keep looking: a worker that dies
    has its runs put back in the queue (heartbeats), and this one takes them."""

    def __init__(self, queue: RunQueue, resources: Resources, console: Console, heartbeat_seconds: float = 0.0,
                 wait_for_others: bool = False) -> None:
        self.queue, self.resources, self.console = queue, resources, console
        self.heartbeat_seconds = heartbeat_seconds
        self.wait_for_others = wait_for_others
        self.running: list[Started] = []
        self.last_heartbeat = time.monotonic()

    def run(self) -> None:
        try:
            while True:
                self.queue.recover()
                waiting = self.start_what_fits()
                if not self.running and not waiting and (not self.wait_for_others or self.queue.open_runs() == 0):
                    break
                self.wait()
        except KeyboardInterrupt:
            self.stop_all()
            raise

    def start_what_fits(self) -> int:
        """Start the waiting runs that fit now; returns how many were waiting."""
        slots = self.resources.packing.at_once - len(self.running)
        if slots <= 0:
            return 1  # not looked at: the running ones come first
        waiting = self.queue.waiting()
        if not waiting:
            return 0
        gpu = self.resources.free_bytes is not None
        shares = [self.resources.share(r.config) for r in waiting] if gpu else None
        free = self.resources.free_bytes - sum(s.share for s in self.running) if gpu else None
        for index in to_start(shares, len(waiting), free, slots, len(self.running)):
            run = waiting[index]
            if not self.queue.claim(run):
                continue  # another worker took it first
            report = read_report(run.run_dir)
            if report is not None:  # finished before (its process or worker died before the queue heard): recorded
                self.queue.finished(run, report)
                self.console.print(f"{run.key}: finished before, recorded", highlight=False, markup=False)
                continue
            self.launch(run, min(shares[index], free) if gpu else None)
            if gpu:
                free -= self.running[-1].share
        return len(waiting)

    def launch(self, run: Run, share: int | None) -> None:
        threads = self.resources.packing.threads
        fraction = share / self.resources.total_bytes if share is not None else None
        run.run_dir.mkdir(parents=True, exist_ok=True)
        spec = {"key": run.key, "run_dir": str(run.run_dir), "config": config_to_dict(run.config), "threads": threads,
                "memory_fraction": fraction}
        spec_path = run.run_dir / SPEC_FILE
        atomic_write_text(spec_path, json.dumps(spec, indent=2))
        log = open(run.run_dir / LOG_FILE, "a")  # noqa: SIM115 - closed when the run is collected
        process = subprocess.Popen([sys.executable, "-m", "fitdqn.schedule.member", str(spec_path)], stdout=log,
                                   stderr=subprocess.STDOUT, env=worker_env(threads),
                                   preexec_fn=interrupt_with_parent)
        self.running.append(Started(run, process, log, share))
        self.queue.heartbeat([run])
        within = f", within {format_bytes(share)}" if share is not None else ""
        self.console.print(f"{run.key} started ({threads} thread(s){within}): {run.run_dir}", highlight=False,
                           markup=False, soft_wrap=True)

    def wait(self) -> None:
        time.sleep(POLL_SECONDS if self.running else IDLE_SECONDS)
        for started in list(self.running):
            if started.process.poll() is not None:
                self.running.remove(started)
                self.collect(started)
        if self.heartbeat_seconds and time.monotonic() - self.last_heartbeat >= self.heartbeat_seconds:
            self.queue.heartbeat([s.run for s in self.running])
            self.last_heartbeat = time.monotonic()

    def collect(self, started: Started) -> None:
        started.log.close()
        run, code = started.run, started.process.returncode
        report = read_report(run.run_dir)
        seconds = time.monotonic() - started.started
        if report is not None:
            self.queue.finished(run, report)
            self.console.print(f"{run.key} finished ({seconds:.0f} s)", highlight=False, markup=False)
        elif code in (EXIT_INTERRUPTED, -signal.SIGINT, -signal.SIGTERM):
            self.queue.released(run)
            self.console.print(f"{run.key} interrupted: its checkpoint is saved, back in the queue", highlight=False,
                               markup=False)
        else:
            error = f"its process exited with status {code}; last lines of {run.run_dir / LOG_FILE}:\n" \
                    f"{log_tail(run.run_dir)}"
            self.queue.failed(run, error)
            self.console.print(f"{run.key} failed: {error}", highlight=False, markup=False)

    def stop_all(self) -> None:
        """Ctrl-C: each run saves its checkpoint and stops; the unfinished go back to the queue."""
        grace = time.monotonic() + 2.0  # Ctrl-C in a terminal reaches the runs too: give them a moment first
        while time.monotonic() < grace and any(s.process.poll() is None for s in self.running):
            time.sleep(0.1)
        for started in self.running:
            if started.process.poll() is None:
                started.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_SECONDS
        for started in self.running:
            try:
                started.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                started.process.kill()
                started.process.wait()
        for started in self.running:
            started.log.close()
            report = read_report(started.run.run_dir)
            if report is not None:
                self.queue.finished(started.run, report)
            else:
                self.queue.released(started.run)
        self.running.clear()

