"""The queue of runs on Optuna's RDB storage (an SQLite file, PostgreSQL, any SQLAlchemy URL), shared by workers
on any number of machines (``fitdqn worker --storage URL``).

A workload is an Optuna study: each run is a trial enqueued with fixed params (``study.enqueue_trial``) whose user
attributes hold its name, its run directory (relative to the workload's) and its config. A worker claims a waiting
trial (WAITING -> RUNNING is one row update under the database's lock: two workers never hold the same trial), beats
its heartbeat while the run lives, and records how it ended. A worker that dies (killed, its machine gone) stops
beating: past the grace period any worker that looks fails the trial and Optuna's
``RetryHeartbeatStaleTrialCallback`` enqueues a copy of it, which the next free worker takes and resumes from the
run's checkpoint. The run directory decides what is done: a run whose report exists is recorded, never run again,
so a run is never run twice to completion; a run that fails with an error is recorded failed and not retried.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from fitdqn.config import Config, config_from_dict, config_to_dict
from fitdqn.errors import UserError
from fitdqn.schedule.queue import Run

QUEUE_ATTR = "fitdqn_queue"  # study user attribute: the workload's run directory (what marks a fitdqn queue)
CONFIG_ATTR = "config"  # study user attribute: the workload's config (JSON), to refuse mixing two workloads
FILES_ATTR = "files"  # run user attribute: files its run directory needs before it starts (name -> text)


def open_queue_storage(url: str, heartbeat_seconds: int, grace_seconds: int | None = None) -> RDBStorage:
    """The storage, with heartbeats (``heartbeat_seconds`` >= 1; a run silent for ``grace_seconds``, by default twice
    that, is failed and enqueued again by the next worker that looks)."""
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if heartbeat_seconds < 1:
        raise UserError(f"the queue's heartbeat must be at least 1 second (got {heartbeat_seconds}): a worker that "
                        "dies is found by its silence")
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # several writers
    try:
        return RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=int(heartbeat_seconds),
                          grace_period=grace_seconds,
                          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=None))
    except (ImportError, ValueError, optuna.exceptions.StorageInternalError) as error:
        raise UserError(f"cannot open the queue's storage '{url}': {error}; give an SQLAlchemy URL such as "
                        "sqlite:///runs/queue.db or postgresql+psycopg://user@host/db (--storage URL)") from None
    except Exception as error:  # sqlalchemy's own errors (bad URL, unreachable server)
        raise UserError(f"cannot open the queue's storage '{url}': {type(error).__name__}: {error}") from None


def queued_studies(storage: RDBStorage) -> list[str]:
    """The names of the fitdqn workloads in the storage."""
    return [s.study_name for s in storage.get_all_studies() if QUEUE_ATTR in s.user_attrs]


def enqueue(storage: RDBStorage, name: str, run_dir: Path, config: Config, runs: list[Run],
            files: dict[str, dict[str, str]] | None = None) -> optuna.Study:
    """The workload ``name`` with ``runs`` queued: each run not already waiting, running or complete in it (a
    workload queued again continues: its failed runs are queued again). ``files``: by run key, files to write
    into its run directory before it starts (a fold's fold.json)."""
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
    config_text = json_text(config_to_dict(config))
    if QUEUE_ATTR not in study.user_attrs:
        study.set_user_attr(QUEUE_ATTR, str(run_dir))
        study.set_user_attr(CONFIG_ATTR, config_text)
    elif study.user_attrs.get(CONFIG_ATTR) != config_text:
        raise UserError(f"the queue '{name}' in the storage holds the runs of another config: give the same config "
                        "to continue it, or another --out (each study directory is its own queue)")
    held = {t.user_attrs.get("key") for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)}
    for run in runs:
        if run.key in held:
            continue
        config_data = config_to_dict(run.config)
        study.enqueue_trial({"run": run.key}, user_attrs={
            "key": run.key, "dir": str(run.run_dir.relative_to(run_dir)), "config": config_data,
            FILES_ATTR: (files or {}).get(run.key, {})}, skip_if_exists=False)
    return study


def json_text(data: Any) -> str:
    return json.dumps(data, sort_keys=True)


class SharedQueue:
    """One workload's runs on the storage, as a :class:`fitdqn.schedule.queue.RunQueue`; ``root``: where this
    machine has the workload's run directory (``--out``; default: where it was queued)."""

    def __init__(self, storage: RDBStorage, name: str, root: Path | None = None) -> None:
        self.storage = storage
        self.study = optuna.load_study(study_name=name, storage=storage)
        self.root = Path(root) if root is not None else Path(self.study.user_attrs[QUEUE_ATTR])
        self.interval = storage.get_heartbeat_interval() or 1
        self.last_recovery = 0.0

    def run_of(self, trial: FrozenTrial) -> Run:
        run_dir = self.root / trial.user_attrs["dir"]
        config = config_from_dict(trial.user_attrs["config"])
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, out=str(run_dir)))
        return Run(trial.user_attrs["key"], run_dir, config, ticket=trial._trial_id)

    def waiting(self) -> list[Run]:
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        return [self.run_of(t) for t in sorted(trials, key=lambda t: t.number)]

    def claim(self, run: Run) -> bool:
        try:
            if not self.storage.set_trial_state_values(run.ticket, TrialState.RUNNING):
                return False
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        self.storage.record_heartbeat(run.ticket)
        self.storage.set_trial_user_attr(run.ticket, "host", socket.gethostname())
        self.storage.set_trial_user_attr(run.ticket, "pid", os.getpid())
        trial = self.storage.get_trial(run.ticket)
        for name, text in trial.user_attrs.get(FILES_ATTR, {}).items():
            path = run.run_dir / name
            if not path.exists():
                from fitdqn.train.checkpoint import atomic_write_text

                run.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, text)
        return True

    def finished(self, run: Run, report: dict[str, Any]) -> None:
        selection = report.get("selection", {}).get("validation_sharpe")
        value = [float(selection)] if isinstance(selection, int | float) and math.isfinite(selection) else None
        try:
            self.storage.set_trial_state_values(run.ticket, TrialState.COMPLETE, values=value)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # failed as stale meanwhile: its copy in the queue finds the report and is recorded instead

    def failed(self, run: Run, error: str) -> None:
        try:
            self.storage.set_trial_user_attr(run.ticket, "error", error[-4000:])
            self.storage.set_trial_state_values(run.ticket, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass

    def released(self, run: Run) -> None:
        """Interrupted: failed, and a copy queued again (the run resumes from its checkpoint)."""
        try:
            self.storage.set_trial_user_attr(run.ticket, "error", "interrupted; queued again")
            self.storage.set_trial_state_values(run.ticket, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # failed as stale meanwhile: already queued again
        RetryHeartbeatStaleTrialCallback(max_retry=None)(self.study, self.storage.get_trial(run.ticket))

    def heartbeat(self, runs: list[Run]) -> None:
        for run in runs:
            self.storage.record_heartbeat(run.ticket)

    def recover(self) -> None:
        if time.monotonic() - self.last_recovery >= self.interval:
            optuna.storages.fail_stale_trials(self.study)
            self.last_recovery = time.monotonic()

    def open_runs(self) -> int:
        return len(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)))

    def outcome(self) -> tuple[set[str], dict[str, str]]:
        """The keys of the complete runs, and the error of each run that failed with no complete run of its key."""
        trials = self.study.get_trials(deepcopy=False)
        complete = {t.user_attrs["key"] for t in trials if t.state == TrialState.COMPLETE}
        errors = {t.user_attrs["key"]: t.user_attrs.get("error", "failed") for t in trials
                  if t.state == TrialState.FAIL and t.user_attrs["key"] not in complete}
        return complete, errors
