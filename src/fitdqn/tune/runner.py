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

import fitdqn
from fitdqn.config import Config, config_to_dict
from fitdqn.device.sizes import format_bytes
from fitdqn.device.threads import cpu_threads
from fitdqn.errors import UserError
from fitdqn.market.loader import load_market
from fitdqn.train.checkpoint import atomic_write_text
from fitdqn.tune.space import SearchSpace
from fitdqn.tune.study import (
    TRIALS_DIR,
    check_tune_config,
    count_trials,
    open_storage,
    open_study,
    recover_cut_off,
    requeue,
    storage_url,
    trial_config,
    write_best_config,
)
from fitdqn.tune.worker import LOG_FILE, RESULT_FILE, SPEC_FILE

POLL_SECONDS = 0.5  # how often running workers are checked
STOP_SECONDS = 60.0  # how long an interrupted worker may take to save its checkpoint
MEASURED = ("epochs", "batch_size", "threads", "samples_per_s", "planned_bytes", "allocator_limit_bytes",
            "peak_reserved_bytes", "ooms", "seconds", "timeline")


@dataclass(frozen=True)
class Resources:
    """What each trial process gets."""

    threads: int
    memory_fraction: float | None  # of the GPU's total memory; None: uncapped (one trial at a time, or a CPU)
    description: str


@dataclass
class Worker:
    trial: optuna.trial.Trial
    run_dir: Path
    process: subprocess.Popen
    log: IO[str]
    params: dict[str, Any] = field(default_factory=dict)


def threads_per_trial(budget: int, parallel: int) -> int:
    return max(1, budget // parallel)


def memory_fraction(free_bytes: int, total_bytes: int, parallel: int) -> float | None:
    """Each of ``parallel`` trials' share of the free memory, as a fraction of the total; None for one trial."""
    if parallel <= 1:
        return None
    return free_bytes / parallel / total_bytes


def probe_in_subprocess(device_spec: str) -> dict[str, Any]:
    """The device as a fresh process sees it (no CUDA context stays in this one)."""
    done = subprocess.run([sys.executable, "-m", "fitdqn.tune.worker", "--probe", device_spec], env=worker_env(1),
                          capture_output=True, text=True)
    try:
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise UserError(f"probing device '{device_spec}' in a new process failed: {done.stderr.strip()[-2000:]}"
                        ) from None
    if "error" in info:
        raise UserError(info["error"])
    return info


def plan_resources(config: Config) -> Resources:
    parallel = config.tune.parallel
    budget = cpu_threads(config.train.threads)  # all trials together: train.threads, OMP_NUM_THREADS or the cores
    threads = threads_per_trial(budget, parallel)
    text = f"{parallel} trial(s) at once, {threads} thread(s) each (of {budget})"
    if parallel == 1 or config.train.device == "cpu":
        return Resources(threads, None, text)
    device = probe_in_subprocess(config.train.device)
    if device["kind"] != "cuda":
        return Resources(threads, None, text)
    fraction = memory_fraction(device["free_bytes"], device["total_bytes"], parallel)
    share = int(fraction * device["total_bytes"])
    text += (f"; {device['name']}: each planned within {format_bytes(share)} of {format_bytes(device['free_bytes'])}"
             f" free (memory fraction {fraction:.4f})")
    return Resources(threads, fraction, text)


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    source = str(Path(fitdqn.__file__).resolve().parents[1])  # the same fitdqn as this process
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p)
    return env


def interrupt_with_parent() -> None:
    """In the worker, before it runs: on Linux, a SIGINT when this tune process dies (even by SIGKILL), so no
    orphaned trial keeps its share of the GPU while a re-run starts new ones (it saves its checkpoint and stops)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)


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
        self.resources: Resources | None = None  # decided when the run starts
        self.last_heartbeat = time.monotonic()

    def run(self) -> optuna.Study:
        for number in recover_cut_off(self.study, self.storage):
            self.console.print(f"trial {number} was cut off by an ended tune process: failed, and queued again")
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
                if len(self.workers) < self.tune.parallel and finished + running < self.tune.trials:
                    self.launch()
                    continue
                if not self.workers:
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
    def launch(self) -> None:
        if self.storage.get_heartbeat_interval() is not None:
            optuna.storages.fail_stale_trials(self.study)
        trial = self.study.ask(fixed_distributions=self.space.distributions)
        run_dir = self.tune_dir / TRIALS_DIR / f"{trial.number:04d}"
        for key, value in (("run_dir", str(run_dir)), ("host", socket.gethostname()), ("tune_pid", os.getpid())):
            trial.set_user_attr(key, value)
        params = dict(trial.params)
        try:
            config = trial_config(self.base, params, run_dir)
        except UserError as error:
            self.fail(trial, str(error), params)
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        spec = {"storage": self.url, "study": self.study.study_name, "trial_id": trial._trial_id,
                "number": trial.number, "config": config_to_dict(config), "threads": self.resources.threads,
                "memory_fraction": self.resources.memory_fraction}
        spec_path = run_dir / SPEC_FILE
        atomic_write_text(spec_path, json.dumps(spec, indent=2))
        (run_dir / RESULT_FILE).unlink(missing_ok=True)
        log = open(run_dir / LOG_FILE, "w")  # noqa: SIM115 - closed when the worker is collected
        process = subprocess.Popen([sys.executable, "-m", "fitdqn.tune.worker", str(spec_path)], stdout=log,
                                   stderr=subprocess.STDOUT, env=worker_env(self.resources.threads),
                                   preexec_fn=interrupt_with_parent)
        trial.set_user_attr("worker_pid", process.pid)
        if self.storage.get_heartbeat_interval() is not None:  # from now on a silent tune process makes it stale
            self.storage.record_heartbeat(trial._trial_id)
        self.workers[trial.number] = Worker(trial, run_dir, process, log, params)
        self.console.print(f"trial {trial.number} started: {format_params(params)}  ({run_dir})", highlight=False)

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
            self.last_heartbeat = time.monotonic()

    def collect(self, worker: Worker) -> None:
        """Record how a worker's trial ended (its result.json, or its exit status and log if it wrote none)."""
        worker.log.close()
        trial, number = worker.trial, worker.trial.number
        result = read_result(worker.run_dir)
        for key in MEASURED:
            if result.get(key) is not None:
                trial.set_user_attr(key, result[key])
        state = result.get("state")
        if state == "complete":
            self.study.tell(trial, result["value"])
            line = f"trial {number} complete: {self.tune.objective} {result['value']:.4f}"
        elif state == "pruned":
            self.study.tell(trial, state=TrialState.PRUNED)
            line = f"trial {number} pruned at epoch {result.get('epochs')}: {self.tune.objective} {result['value']:.4f}"
        elif state == "interrupted":
            requeue(self.study, self.storage, self.storage.get_trial(trial._trial_id),
                    "interrupted before it finished; queued again")
            self.console.print(f"trial {number} interrupted: queued again", highlight=False)
            return
        else:
            error = result.get("error") or (f"the trial process exited with status {worker.process.returncode} "
                                            f"without a result; last lines of its log:\n{log_tail(worker.run_dir)}")
            self.fail(trial, error, worker.params)
            return
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
            if read_result(worker.run_dir).get("state") in ("complete", "pruned", "fail"):
                self.collect(worker)
            else:
                worker.log.close()
                requeue(self.study, self.storage, self.storage.get_trial(worker.trial._trial_id),
                        "interrupted before it finished; queued again")
        self.console.print("interrupted: finished trials are saved in the study; run the same command to continue")


def read_result(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RESULT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def log_tail(run_dir: Path, lines: int = 20) -> str:
    try:
        return "\n".join((run_dir / LOG_FILE).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_tune(base: Config, space: SearchSpace, console: Console | None = None) -> optuna.Study:
    """Run (or continue) the study of ``base.tune`` until it has ``tune.trials`` finished trials."""
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # the heartbeat is recorded here, for the trials this process runs (Optuna's own thread is optimize()'s)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return TuneRun(base, space, console or Console()).run()
