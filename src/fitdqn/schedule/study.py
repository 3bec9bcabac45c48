"""``fitdqn train --seeds/--folds`` through the queue of runs, and ``fitdqn worker``.

A study's members still to train become runs of a queue: in this process (:class:`~fitdqn.schedule.queue.LocalQueue`)
or, with ``train.storage``, on Optuna's RDB storage where workers on other machines take them too
(:class:`~fitdqn.schedule.shared.SharedQueue`; this process is one of the workers, and writes the study report once
every run is done). Where one run at a time is all that fits (a CPU with ``--parallel`` auto, or a run that fills
the card) and the queue is this process's, the members train here one after another, as a single run does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from fitdqn.config import Config
from fitdqn.device.threads import cpu_threads
from fitdqn.errors import UserError
from fitdqn.evaluate.walk_forward import FOLD_NAME
from fitdqn.schedule.queue import LocalQueue, Run, RunQueue
from fitdqn.schedule.scheduler import Resources, Scheduler, plan_resources
from fitdqn.train.study import StudyMember, run_study, train_one_after_another


def first_error(errors: dict[str, str]) -> str:
    key, error = next(iter(errors.items()))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"member {key} failed{more}: {error}"


def run_members(config: Config, study_dir: Path) -> Any:
    """The study's ``run_members`` (:func:`fitdqn.train.study.run_study`): packed processes from a queue."""

    def run(todo: list[StudyMember], console: Console) -> None:
        runs = [Run(m.key, m.run_dir, m.config) for m in todo]
        cores = cpu_threads(config.train.threads)
        if config.train.storage:
            run_shared(config, study_dir, runs, console, cores)
            return
        if not runs:
            return
        resources = plan_resources(runs, config.train.device, cores, config.train.parallel)
        if resources.packing.at_once == 1:
            train_one_after_another(todo, console)
            return
        console.print(resources.description, highlight=False, markup=False, soft_wrap=True)
        queue = LocalQueue(runs)
        Scheduler(queue, resources, console).run()
        if queue.errors:
            raise UserError(first_error(queue.errors))

    return run


def run_shared(config: Config, study_dir: Path, runs: list[Run], console: Console, cores: int) -> None:
    try:  # Optuna is optional: looked for only when a queue lives in a database
        import optuna  # noqa: F401
    except ImportError:
        raise UserError("train.storage (--storage URL) needs Optuna, which is not installed: pip install "
                        "'fitdqn[workers]'") from None
    from fitdqn.schedule.shared import SharedQueue, enqueue, open_queue_storage

    storage = open_queue_storage(config.train.storage, config.tune.heartbeat_seconds)
    name = queue_name(study_dir)
    files = {r.key: {FOLD_NAME: (r.run_dir / FOLD_NAME).read_text()} for r in runs
             if (r.run_dir / FOLD_NAME).is_file()}
    enqueue(storage, name, study_dir.resolve(), config, [resolved(r) for r in runs], files)
    queue = SharedQueue(storage, name, study_dir.resolve())
    console.print(f"{len(runs)} run(s) queued in {config.train.storage} as '{name}': `fitdqn worker --storage URL` "
                  "on other machines takes runs too", highlight=False, markup=False, soft_wrap=True)
    serve(queue, config.train.device, cores, config.train.parallel, config.tune.heartbeat_seconds, console)
    _, errors = queue.outcome()
    if errors:
        raise UserError(first_error(errors))


def resolved(run: Run) -> Run:
    return Run(run.key, run.run_dir.resolve(), run.config, run.ticket)


def queue_name(study_dir: Path) -> str:
    """A study's queue in the storage: its directory's absolute path (one queue per study directory)."""
    return str(study_dir.resolve())


def serve(queue: RunQueue, device: str, cores: int, parallel: int, heartbeat: float, console: Console) -> None:
    """Take the queue's runs until none is waiting or running anywhere."""
    resources: Resources = plan_resources(queue.waiting(), device, cores, parallel)
    console.print(resources.description, highlight=False, markup=False, soft_wrap=True)
    Scheduler(queue, resources, console, heartbeat_seconds=heartbeat, wait_for_others=True).run()


def run_packed_study(config: Config, run_dir: Path, console: Console | None = None) -> dict[str, Any] | None:
    """:func:`fitdqn.train.study.run_study` with its members run from the queue."""
    return run_study(config, run_dir, console, run_members=run_members(config, run_dir))


def run_worker(url: str, out: Path | None, study: str | None, device: str, parallel: int, heartbeat: int,
               threads: int, console: Console) -> int:
    """``fitdqn worker``: serve the workloads queued in ``url`` (``study``: that one only) until none has a run
    waiting or running; returns how many workloads it served."""
    from fitdqn.schedule.shared import SharedQueue, open_queue_storage, queued_studies

    storage = open_queue_storage(url, heartbeat)
    names = [study] if study else queued_studies(storage)
    if study and study not in queued_studies(storage):
        raise UserError(f"no queue of runs named '{study}' in {url}: queued there are "
                        f"{json.dumps(queued_studies(storage))}")
    served = 0
    for name in names:
        queue = SharedQueue(storage, name, out)
        if queue.open_runs() == 0:
            continue
        console.print(f"serving '{name}' from {url} into {queue.root}", highlight=False, markup=False,
                      soft_wrap=True)
        serve(queue, device, cpu_threads(threads), parallel, heartbeat, console)
        served += 1
    return served
