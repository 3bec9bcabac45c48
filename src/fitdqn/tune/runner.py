"""`fitdqn tune`: ask the study for trials, run each in its own process (K at once), tell it how each ended.

This process samples every trial (so one sampler sees them all) and records every outcome, including a worker
that died without a word. Resources per trial, decided once before the first trial starts:

* threads: the thread budget (``OMP_NUM_THREADS`` if set, else the cores this process may use) // K, set as the
  worker's ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and ``torch.set_num_threads``;
* GPU memory (K > 1 on CUDA): free memory is probed once, by a separate process so this one holds no CUDA
  context, and each worker's allocator is capped at free / K (``set_per_process_memory_fraction``): its probe
  reports the cap and its plan stays within it (the driver's own bytes, outside the allocator, are planned
  inside the share too: the planner subtracts them from the capped free memory).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState
from rich.console import Console

from fitdqn.config import Config, config_to_dict
from fitdqn.device.sizes import format_bytes
from fitdqn.device.threads import cpu_threads
from fitdqn.errors import UserError
from fitdqn.market.loader import load_market
from fitdqn.schedule.packing import Packing, packing
from fitdqn.schedule.scheduler import (
    config_key,
    gpu_possible,
    interrupt_with_parent,
    log_tail,
    probe_shares,
    worker_env,
)
from fitdqn.train.checkpoint import atomic_write_text
from fitdqn.tune.space import SearchSpace
from fitdqn.tune.study import (
    FINISHED,
    TRIALS_DIR,
    check_tune_config,
    count_trials,
    open_storage,
    open_study,
    record_outcome,
    recover_cut_off,
    requeue,
    storage_url,
    trial_config,
    trial_outcome,
    write_best_config,
)
from fitdqn.tune.worker import LOG_FILE, RESULT_FILE, SPEC_FILE

POLL_SECONDS = 0.5  # how often running workers are checked
STOP_SECONDS = 60.0  # how long an interrupted worker may take to save its checkpoint


@dataclass(frozen=True)
class Resources:
    """What the trial processes get: the packing (trials at once, threads of each), the GPU probed once before the
    first trial (None on a CPU) and the shares planned so far, by config (``schedule.scheduler.config_key``)."""

    packing: Packing
    device: dict[str, Any] | None
    shares: dict[str, int]
    description: str

    @property
    def free_bytes(self) -> int | None:
        return None if self.device is None else int(self.device["free_bytes"])

    def fraction(self, share: int | None) -> float | None:
        """A trial's allocator cap as a fraction of the total; None (uncapped) on a CPU."""
        return None if share is None else share / int(self.device["total_bytes"])


@dataclass
class Worker:
    trial: optuna.trial.Trial
    run_dir: Path
    process: subprocess.Popen
    log: IO[str]
    params: dict[str, Any] = field(default_factory=dict)
    share: int | None = None


@dataclass
class Pending:
    """A trial asked of the study and planned, waiting for its share of the GPU to be free."""

    trial: optuna.trial.Trial
    run_dir: Path
    config: Config
    params: dict[str, Any]
    share: int | None


def plan_resources(config: Config) -> Resources:
    """The packing of the trials (``fitdqn.schedule.packing``): on a GPU, the base config's plan gives the share a
    trial is expected to need, and as many at once as those fit in the free memory, a core each (each trial's own
    share is planned when it is sampled); on a CPU, ``tune.parallel`` at once (auto: one), the threads split."""
    budget = cpu_threads(config.train.threads)  # all trials together: train.threads, OMP_NUM_THREADS or the cores
    cap, trials = config.tune.parallel, config.tune.trials
    if not gpu_possible(config.train.device):
        pack = packing(None, None, budget, cap)
        return Resources(pack, None, {}, f"{pack.at_once} trial(s) at once, {pack.threads} thread(s) each "
                         f"(of {budget})")
    info = probe_shares(config.train.device, [config])
    if info["device"]["kind"] != "cuda":
        pack = packing(None, None, budget, cap)
        return Resources(pack, None, {}, f"{pack.at_once} trial(s) at once, {pack.threads} thread(s) each "
                         f"(of {budget})")
    device, share = info["device"], info["shares"][0]
    pack = packing([share] * trials, device["free_bytes"], budget, cap)
    return Resources(pack, device, {config_key(config): share},
                     f"{device['name']}: {format_bytes(device['free_bytes'])} free; the base config plans within "
                     f"{format_bytes(share)}: up to {pack.at_once} trial(s) at once, each planned and capped within "
                     f"its own share, {pack.threads} thread(s) each (of {budget})")


def check_trials_dir(study: optuna.Study, tune_dir: Path) -> None:
    trials_dir = tune_dir / TRIALS_DIR
    if not study.get_trials(deepcopy=False) and trials_dir.is_dir() and any(trials_dir.iterdir()):
        raise UserError(f"'{trials_dir}' holds trials of another study (study '{study.study_name}' in the storage "
                        "is new): give another --out, or move that directory away")


def format_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


class TuneRun:
    """One `fitdqn tune` invocation over a study: launch, watch and record trials until the study has enough."""

    def __init__(self, base: Config, space: SearchSpace, console: Console) -> None:
        check_tune_config(base.tune)
        self.base, self.space, self.console = base, space, console
        self.tune = base.tune
        self.tune_dir = Path(self.tune.dir)
        self.tune_dir.mkdir(parents=True, exist_ok=True)
        self.url = storage_url(self.tune)
        self.storage: RDBStorage = open_storage(self.url, self.tune.heartbeat_seconds)
        self.study = open_study(base, space, self.storage)
        check_trials_dir(self.study, self.tune_dir)
        self.workers: dict[int, Worker] = {}
        self.pending: Pending | None = None  # a trial waiting for its share of the GPU
        self.resources: Resources | None = None  # decided when the run starts
        self.last_heartbeat = time.monotonic()

    def run(self) -> optuna.Study:
        for number, done in recover_cut_off(self.study, self.storage, self.tune.objective, STOP_SECONDS):
            if done == "queued again":
                self.console.print(f"trial {number} was cut off by an ended tune process: failed, and queued again")
            else:
                self.console.print(f"trial {number} had ended ({done}) before its tune process did: recorded")
        finished, _ = count_trials(self.study)
        self.console.print(f"study '{self.study.study_name}' in {self.url}: {finished} of {self.tune.trials} trials "
                           f"finished; maximising {self.tune.objective}")
        for line in self.space.describe():
            self.console.print(f"  search {line}", highlight=False)
        self.preflight()
        self.resources = plan_resources(self.base)
        self.console.print(self.resources.description, highlight=False)
        try:
            while True:
                finished, running = count_trials(self.study)
                if self.pending is None and len(self.workers) < self.resources.packing.at_once \
                        and finished + running < self.tune.trials:
                    self.pending = self.ask()
                    continue
                if self.pending is not None and self.fits(self.pending):
                    self.launch(self.pending)
                    self.pending = None
                    continue
                if not self.workers and self.pending is None:
                    break
                self.wait()
        except KeyboardInterrupt:
            self.stop_all()
            raise
        write_best_config(self.base, self.study, self.tune_dir)
        return self.study

    def preflight(self) -> None:
        """The base config's bars load here once: a wrong --data is one error, not a study of failed trials."""
        load_market(self.base.market, window=self.base.net.window, device="cpu")

    # ------------------------------------------------------------------ trials
    def ask(self) -> Pending | None:
        """The next trial, sampled, with its config and its share of the GPU (None: its params were refused)."""
        if self.storage.get_heartbeat_interval() is not None:
            optuna.storages.fail_stale_trials(self.study)
        trial = self.study.ask(fixed_distributions=self.space.distributions)
        run_dir = self.tune_dir / TRIALS_DIR / f"{trial.number:04d}"
        for key, value in (("run_dir", str(run_dir)), ("host", socket.gethostname()), ("tune_pid", os.getpid())):
            trial.set_user_attr(key, value)
        if self.storage.get_heartbeat_interval() is not None:  # from now on a silent tune process makes it stale
            self.storage.record_heartbeat(trial._trial_id)
        params = dict(trial.params)
        try:
            config = trial_config(self.base, params, run_dir)
            share = self.share_of(config)
        except UserError as error:
            self.fail(trial, str(error), params)
            return None
        return Pending(trial, run_dir, config, params, share)

    def share_of(self, config: Config) -> int | None:
        """The trial's share of the GPU, from its own plan (planned once per distinct config; None on a CPU)."""
        if self.resources.device is None:
            return None
        key = config_key(config)
        if key not in self.resources.shares:
            info = probe_shares(config.train.device, [config], described=self.resources.device)
            self.resources.shares[key] = info["shares"][0]
        return self.resources.shares[key]

    def fits(self, pending: Pending) -> bool:
        """Whether the trial's share fits in the free memory less the running trials' shares (a trial alone always
        starts: within the whole free memory)."""
        if pending.share is None or not self.workers:
            return True
        used = sum(w.share or 0 for w in self.workers.values())
        return pending.share <= self.resources.free_bytes - used

    def launch(self, pending: Pending) -> None:
        trial, run_dir, params = pending.trial, pending.run_dir, pending.params
        share = None if pending.share is None else min(pending.share, self.resources.free_bytes)
        threads = self.resources.packing.threads
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = {"storage": self.url, "study": self.study.study_name, "trial_id": trial._trial_id,
                "number": trial.number, "config": config_to_dict(pending.config), "threads": threads,
                "memory_fraction": self.resources.fraction(share) if self.resources.packing.at_once > 1 else None}
        spec_path = run_dir / SPEC_FILE
        atomic_write_text(spec_path, json.dumps(spec, indent=2))
        (run_dir / RESULT_FILE).unlink(missing_ok=True)
        log = open(run_dir / LOG_FILE, "w")  # noqa: SIM115 - closed when the worker is collected
        process = subprocess.Popen([sys.executable, "-m", "fitdqn.tune.worker", str(spec_path)], stdout=log,
                                   stderr=subprocess.STDOUT, env=worker_env(threads),
                                   preexec_fn=interrupt_with_parent)
        trial.set_user_attr("worker_pid", process.pid)
        self.workers[trial.number] = Worker(trial, run_dir, process, log, params, share)
        within = f", within {format_bytes(share)}" if share is not None and spec["memory_fraction"] else ""
        self.console.print(f"trial {trial.number} started: {format_params(params)}  ({run_dir}{within})",
                           highlight=False)

    def wait(self) -> None:
        time.sleep(POLL_SECONDS)
        for number, worker in list(self.workers.items()):
            if worker.process.poll() is not None:
                del self.workers[number]
                self.collect(worker)
        interval = self.storage.get_heartbeat_interval()
        if interval is not None and time.monotonic() - self.last_heartbeat >= interval:
            for worker in self.workers.values():
                self.storage.record_heartbeat(worker.trial._trial_id)
            if self.pending is not None:
                self.storage.record_heartbeat(self.pending.trial._trial_id)
            self.last_heartbeat = time.monotonic()

    def collect(self, worker: Worker) -> None:
        """Record how a worker's trial ended (its result.json, or its exit status and log if it wrote none)."""
        worker.log.close()
        trial, number = worker.trial, worker.trial.number
        result = trial_outcome(worker.run_dir, self.tune.objective)
        state = result.get("state")
        if state == "interrupted":
            requeue(self.study, self.storage, self.storage.get_trial(trial._trial_id),
                    "interrupted before it finished; queued again")
            self.console.print(f"trial {number} interrupted: queued again", highlight=False)
            return
        if state not in FINISHED:
            result = {**result, "state": "fail", "error": result.get("error") or (
                f"the trial process exited with status {worker.process.returncode} without a result; last lines "
                f"of its log:\n{log_tail(worker.run_dir)}")}
        record_outcome(self.study, self.storage, self.storage.get_trial(trial._trial_id), result)
        if result["state"] == "fail":
            first = result["error"].strip().splitlines()[0] if result["error"].strip() else "(no message)"
            self.console.print(f"trial {number} failed: {first}  ({format_params(worker.params)}); the study goes "
                               "on", highlight=False, markup=False)
            return
        if result["state"] == "complete":
            line = f"trial {number} complete: {self.tune.objective} {result['value']:.4f}"
        else:
            line = f"trial {number} pruned at epoch {result.get('epochs')}: {self.tune.objective} {result['value']:.4f}"
        seconds = result.get("seconds", 0.0)
        self.console.print(f"{line}  ({format_params(worker.params)}; {result.get('epochs')} epochs, {seconds:.0f} s)",
                           highlight=False)
        write_best_config(self.base, self.study, self.tune_dir)

    def fail(self, trial: optuna.trial.Trial, error: str, params: dict[str, Any]) -> None:
        trial.set_user_attr("error", error[-4000:])
        self.study.tell(trial, state=TrialState.FAIL)
        first = error.strip().splitlines()[0] if error.strip() else "(no message)"
        self.console.print(f"trial {trial.number} failed: {first}  ({format_params(params)}); the study goes on",
                           highlight=False, markup=False)

    def stop_all(self) -> None:
        """Ctrl-C: each worker saves its checkpoint and stops; its trial is queued again for the next run."""
        if self.pending is not None:  # sampled, never started
            requeue(self.study, self.storage, self.storage.get_trial(self.pending.trial._trial_id),
                    "interrupted before it started; queued again")
            self.pending = None
        grace = time.monotonic() + 2.0  # Ctrl-C in a terminal reaches the workers too: give them a moment first
        while time.monotonic() < grace and any(w.process.poll() is None for w in self.workers.values()):
            time.sleep(0.1)
        for worker in self.workers.values():
            if worker.process.poll() is None:
                worker.process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_SECONDS
        for worker in self.workers.values():
            try:
                worker.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        for worker in list(self.workers.values()):
            del self.workers[worker.trial.number]
            if trial_outcome(worker.run_dir, self.tune.objective).get("state") in FINISHED:
                self.collect(worker)
            else:
                worker.log.close()
                requeue(self.study, self.storage, self.storage.get_trial(worker.trial._trial_id),
                        "interrupted before it finished; queued again")
        self.console.print("interrupted: finished trials are saved in the study; run the same command to continue")


def run_tune(base: Config, space: SearchSpace, console: Console | None = None) -> optuna.Study:
    """Run (or continue) the study of ``base.tune`` until it has ``tune.trials`` finished trials."""
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # the heartbeat is recorded here, for the trials this process runs (Optuna's own thread is optimize()'s)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return TuneRun(base, space, console or Console()).run()
