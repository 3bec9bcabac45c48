"""A whole run: plan table, allocation check, epochs with a progress bar, evaluation, checkpoints, report.

Run directory::

    config.toml      the config used (resume reads it back)
    plan.json        the memory plan, plus what the device reported after allocating
    metrics.jsonl    one line per epoch / evaluation; tensorboard/ holds the same scalars
    checkpoint.pt    the latest checkpoint (atomic write; loads with weights_only=True)
    best.pt          the network with the best validation Sharpe so far (the one reported; atomic)
    report.json, report.md, test_pnl.csv, equity_test.png, learning_curves.png, vram.png


A new run needs a new or empty folder; a run is continued only by ``resume``. The first Ctrl-C (SIGINT) or
SIGTERM stops the run at the end of the current epoch, after saving a checkpoint; a second one stops at once
and leaves the last checkpoint as it was. A resume rolls the logs back to what its checkpoint covers, so the
resumed run's parameters and logs equal those of a run that was never stopped. A new run that fails or is
stopped before its first checkpoint leaves no folder behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from fitdqn.config import Config, TrainConfig, load_run_config, validate
from fitdqn.device.probe import probe, resolve_device
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.evaluate.compare import evaluate_split, time_text
from fitdqn.evaluate.plots import plot_equity, plot_learning_curves
from fitdqn.evaluate.report import TABLE_WIDTH, metrics_table, policy_label, run_markdown, split_verdict
from fitdqn.evaluate.walk_forward import fold_market, run_fold
from fitdqn.files import BEST_NAME, CHECKPOINT_NAME, FileWriteError, remove_stale_temp_files
from fitdqn.learn.learner import Learner
from fitdqn.market.env import STATE_DIM
from fitdqn.market.loader import Market, load_market
from fitdqn.plan.report import plot_plan, print_plan
from fitdqn.provenance import code_record
from fitdqn.run_lock import LOCK_NAME, check_not_in_use, run_lock
from fitdqn.train import distributed
from fitdqn.train.checkpoint import (
    BEST_NETWORK,
    atomic_write_text,
    best_network_weights,
    checkpoint_summary,
    load_checkpoint,
    restore_network,
    save_checkpoint,
    tensor_bytes,
)
from fitdqn.train.logs import METRICS_NAME, TENSORBOARD_DIR, RunLogger, read_jsonl
from fitdqn.train.memory_check import backtest_growth_note, format_rows, peak_memory_row
from fitdqn.train.oom import OomGuard
from fitdqn.train.trainer import Trainer, write_run_config

CONFIG_NAME = "config.toml"
RUN_FILES = ("config.toml", "plan.json", METRICS_NAME, TENSORBOARD_DIR, f"{TENSORBOARD_DIR}.rebuild", "*.pt",
             "report.json", "report.md", "*.png", "evaluate_*.json", ".*.tmp")  # what fitdqn writes into a run
# what `fitdqn tune` and the queue of runs put into a run's folder before it starts (fitdqn.tune.worker's and
# fitdqn.schedule.member's SPEC_FILE, LOG_FILE),
# and an evaluation study into a fold's (fold.json): a new run may start beside them, and keeps them when it
# ends before its first checkpoint
SETUP_FILES = ("trial.json", "member.json", "train.log", "fold.json", LOCK_NAME)


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (``signum``; the CLI exits with 128 + signum). ``saved``: at the end of an
    epoch, with a checkpoint of it; else at once, the last checkpoint left as it was."""

    def __init__(self, signum: int, message: str, saved: bool) -> None:
        super().__init__(message)
        self.signum, self.saved = signum, saved


class StopRequests:
    """SIGINT and SIGTERM during a run. While the epochs run (:meth:`graceful`) the first asks for a stop at the
    end of the epoch and the second stops at once; outside them (planning, the final report) the first stops at
    once (``Interrupted`` raised where the program is). Handlers are only installed in the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, console: Console) -> None:
        self.console = console
        self.signum: int | None = None
        self.saved_epoch: int | None = None  # the last checkpoint's epoch, for the messages
        self.in_epochs = False
        self.stopped_at_once: int | None = None  # a signal that raised Interrupted outside the epochs
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    @contextlib.contextmanager
    def graceful(self):
        if self.stopped_at_once is not None:  # its Interrupted was swallowed (raised inside a finalizer): now
            name = signal.Signals(self.stopped_at_once).name
            raise Interrupted(self.stopped_at_once, f"{name}: stopped at once", saved=False)
        self.in_epochs = True
        try:
            yield
        finally:
            self.in_epochs = False

    def handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None or not self.in_epochs:
            # Python swallows an exception raised while a finalizer runs (it prints "Exception ignored"): the
            # request is kept, and the epochs refuse to start after it (``graceful``)
            self.stopped_at_once = signum
            raise Interrupted(signum, f"{name}: stopped at once", saved=False)
        self.signum = signum
        self.console.print(
            f"{name}: stopping at the end of this epoch, after saving a checkpoint; "
            f"{'Ctrl-C again' if signum == signal.SIGINT else 'another SIGTERM or Ctrl-C'} stops at once and keeps "
            f"{self.last_checkpoint()} as it is", style="yellow",
            highlight=False, soft_wrap=True)

    def last_checkpoint(self) -> str:
        return "no checkpoint" if self.saved_epoch is None else f"the last checkpoint (epoch {self.saved_epoch})"


def default_run_dir() -> Path:
    """runs/<date>-<time>, with -2, -3, ... when that folder exists already (two runs started in one second)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def resume_config(run_dir: Path) -> Config:
    """The config of the run in ``run_dir``, less its time limit: a resume runs with a new one, or none."""
    path = run_dir / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"'{run_dir}' has no {CONFIG_NAME}: not a fitdqn run directory (fitdqn train --out writes "
                        "one)")
    config = load_run_config(path)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, minutes=TrainConfig().minutes))


def is_run_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_FILES)


def check_new_run_dir(run_dir: Path) -> None:
    """A new run goes into a new or empty folder only; anything else is refused with what to do instead."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UserError(f"--out '{run_dir}' is a file, not a folder: give a new folder for the run")
    names = sorted(p.name for p in run_dir.iterdir() if p.name not in SETUP_FILES)
    if not names:
        return
    if CHECKPOINT_NAME in names and CONFIG_NAME in names:
        raise UserError(f"'{run_dir}' already holds a run ({CHECKPOINT_NAME}): continue it with --resume "
                        f"{run_dir}, or give another --out")
    foreign = [n for n in names if not is_run_file(n)]
    if CONFIG_NAME in names and not foreign:
        raise UserError(f"'{run_dir}' holds a run that stopped before its first checkpoint: there is nothing to "
                        "resume and fitdqn does not write over it; delete that folder or give another --out")
    shown = ", ".join((foreign or names)[:5]) + (", ..." if len(foreign or names) > 5 else "")
    raise UserError(f"'{run_dir}' is not empty and holds no fitdqn run ({shown}): a new run goes into a new or "
                    "empty folder, so nothing there is written over; give another --out")


def discard_new_run(run_dir: Path, created: list[Path], before: set[str], console: Console) -> None:
    """A new run that ends before its first checkpoint leaves nothing: its files, and the folders it made, go
    (what was in the folder before it started, ``before``, stays)."""
    if not run_dir.is_dir():
        return
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in created[1:]:  # e.g. runs/, when this run made it and nothing else is in it
            with contextlib.suppress(OSError):
                parent.rmdir()
    else:  # the folder was empty but for SETUP_FILES: everything else in it is this run's
        for path in run_dir.iterdir():
            if path.name in before:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    console.print(f"no checkpoint was written: removed what the run had put in '{run_dir}'", style="dim",
                  highlight=False, soft_wrap=True)


def save(trainer: Trainer, run_dir: Path, logger: RunLogger, replay: bool = True) -> dict[str, Any]:
    """The latest checkpoint, at an epoch boundary, noting how many log records it covers."""
    state = trainer.state_dict()
    if not replay:
        state.pop("replay")
    state["logs"] = {"records": logger.records}
    state[distributed.WORLD_SIZE_KEY] = distributed.world_size_of()
    save_or_say_what_is_lost(run_dir, CHECKPOINT_NAME, state, f"the checkpoint of epoch {trainer.epoch}",
                             trainer.epoch)
    return state


def save_or_say_what_is_lost(run_dir: Path, name: str, state: dict[str, Any], what: str, epoch: int) -> None:
    """``save_checkpoint`` into ``run_dir / name``; a write that fails (a full disk) says what is kept or lost."""
    had_one = (run_dir / CHECKPOINT_NAME).is_file()
    try:
        save_checkpoint(run_dir / name, state)
    except FileWriteError as error:
        raise FileWriteError(checkpoint_not_saved(error, what, epoch, tensor_bytes(state), run_dir, had_one)) \
            from None


def checkpoint_not_saved(error: FileWriteError, what: str, epoch: int, size: int, run_dir: Path,
                         had_one: bool) -> str:
    """What a checkpoint that could not be written costs: nothing but the epochs since the previous one, or (a run
    with none yet) every epoch trained."""
    head = f"{what} (about {format_bytes(size)}) could not be saved: {error}"
    if had_one:
        return (f"{head}; the previous checkpoint is kept, so only the epochs after it are lost: free space and "
                f"continue with fitdqn train --resume {run_dir}")
    return (f"{head}; the run had no checkpoint yet, so its {epoch} epoch(s) of training are lost: free space "
            "and start it again")


def logs_covered(state: dict[str, Any], run_dir: Path) -> int:
    """How many metrics.jsonl records the checkpoint covers (older checkpoints: the records up to its epoch)."""
    if "logs" in state:
        return int(state["logs"]["records"])
    records = read_jsonl(run_dir / METRICS_NAME)
    epoch = int(state["epoch"])
    kept = 0
    for record in records:
        if record.get("step", 0) > epoch or (record.get("kind") != "epoch" and record.get("step", 0) == epoch):
            break
        kept += 1
    return kept


def checked_resume_state(config: Config, run_dir: Path, device: torch.device) -> dict[str, Any]:
    """The checkpoint to resume from, refused early (before planning) when it cannot be continued."""
    if not (run_dir / CHECKPOINT_NAME).is_file():
        raise UserError(f"cannot resume: no {CHECKPOINT_NAME} in '{run_dir}'; start a new run without --resume")
    remove_stale_temp_files(run_dir)  # a write killed midway: it never replaced anything
    state = load_checkpoint(run_dir / CHECKPOINT_NAME, map_location=device)
    distributed.check_world_size(state, distributed.world_size_of(), run_dir)
    epoch = int(state["epoch"])
    if config.train.epochs < epoch:
        raise UserError(f"the checkpoint in '{run_dir}' is at epoch {epoch} but train.epochs is "
                        f"{config.train.epochs}: give --epochs above {epoch} to train on")
    if "replay" not in state and config.train.epochs > epoch:
        raise UserError(f"the checkpoint in '{run_dir}' was saved without its replay buffer (train.keep_replay = "
                        "false): the run can be evaluated but not trained on; start a new run to train longer")
    return state


def train(config: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
          trainer_hook=None, on_epoch=None, market: Market | None = None) -> dict[str, Any]:
    """Train (or resume) a run in ``run_dir``; returns the report. ``on_epoch(record) -> bool`` sees each epoch's
    record after it is logged; True ends the run there (saved and reported as if its epochs were done).
    ``market``: bars already loaded (a walk-forward fold's splits), else loaded from ``config.market``.

    Raises :class:`Interrupted` (a ``KeyboardInterrupt``) when SIGINT or SIGTERM stopped the run: during the
    epochs the first signal stops at the end of the epoch, with a checkpoint; else, or at a second signal, at once.
    """
    validate(config)
    job = distributed.setup(config.train)  # under torchrun: this process's rank of the job; else None
    if job is not None and not job.main:  # rank 0 alone prints and writes the run directory
        config = job.rank_config(config)
        with StopRequests(Console(quiet=True)) as stop:
            return run_epochs(config, run_dir, resume, Console(quiet=True), None, None, stop, market, job)
    if job is not None:
        config = job.rank_config(config)
    console = console or Console()
    console.print(f"run directory: {run_dir}", highlight=False, markup=False, soft_wrap=True)
    if not resume:
        check_not_in_use(run_dir)  # a writer at work: named, not its files
        check_new_run_dir(run_dir)
    created = missing_folders(run_dir)
    lock_file_before = (run_dir / LOCK_NAME).exists()  # a new run that leaves nothing takes its lock file too
    with run_lock(run_dir, notify=lambda note: console.print(note, style="yellow", highlight=False, markup=False,
                                                             soft_wrap=True)):
        if not resume:  # again under the lock: another writer may have started between the check and the lock
            check_new_run_dir(run_dir)
        before = set() if created or resume else {  # a new run's: SETUP_FILES
            p.name for p in run_dir.iterdir() if p.name != LOCK_NAME or lock_file_before}
        return train_locked(config, run_dir, resume, console, trainer_hook, on_epoch, market, job, created, before)


def train_locked(config: Config, run_dir: Path, resume: bool, console: Console, trainer_hook, on_epoch,
                 market: Market | None, job: distributed.Distributed | None, created: list[Path],
                 before: set[str]) -> dict[str, Any]:
    """:func:`train` once this process holds the run directory's lock."""
    stop = StopRequests(console)
    try:
        with stop:
            return run_epochs(config, run_dir, resume, console, trainer_hook, on_epoch, stop, market, job)
    except BaseException as error:
        if isinstance(error, Interrupted) and error.saved:
            console.print(f"{error}: checkpoint saved; resume with --resume {run_dir}",
                          highlight=False, soft_wrap=True)
        elif isinstance(error, KeyboardInterrupt) and stop.saved_epoch is not None:
            console.print(f"stopped at once: {stop.last_checkpoint()} is intact; resume with --resume {run_dir}",
                          highlight=False, soft_wrap=True)
        if not resume and not (run_dir / CHECKPOINT_NAME).exists():
            discard_new_run(run_dir, created, before, console)
        raise


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet (deepest first): what a run would create."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def run_epochs(config: Config, run_dir: Path, resume: bool, console: Console, trainer_hook, on_epoch,
               stop: StopRequests, market: Market | None, job: distributed.Distributed | None = None
               ) -> dict[str, Any]:
    main = job is None or job.main
    device_info = probe(config.train.device)
    state = checked_resume_state(config, run_dir, device_info.torch_device) if resume else None
    trainer = Trainer(config, device_info, market=market)
    if job is not None:
        job.attach(trainer)  # the agreed batch, rank 0's learner, the gradient all-reduce
    print_plan(trainer.plan, console, trainer.schedule, trainer.reward_info)
    for note in trainer.market.notes:  # the contract traded, "volume features off (...)", bars per year
        console.print(note, highlight=False, markup=False, soft_wrap=True)
    if state is not None:
        trainer.load_state_dict(state)
        if job is not None:
            job.learning_batch(trainer)
            job.reseed(trainer)
        stop.saved_epoch = trainer.epoch
        console.print(f"resumed from {run_dir / CHECKPOINT_NAME} at epoch {trainer.epoch}"
                      + (f", at batch {trainer.batch_size} (the OOM guard's)" if trainer.oom_batch_size else "")
                      + (f"; time limit {config.train.minutes:g} min" if config.train.minutes > 0 else ""),
                      highlight=False, soft_wrap=True)
    config = trainer.config  # with the device's auto values resolved: what a resume must use
    if not main:
        guard = single_try(OomGuard(trainer, console, distributed.NullLogger()), job)
        run_loop(trainer, config, run_dir, console, distributed.NullLogger(), stop, None, guard, job)
        job.barrier("waiting for rank 0's final checkpoint and report")
        return {"rank": job.rank, "epochs": trainer.epoch, "updates": trainer.updates_done}
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(run_dir, config)
    plan_record = {**trainer.plan.to_json(),
                   "allocated": trainer.ledger.compare(trainer.plan, trainer.persistent_bytes())}
    for line in format_rows(plan_record["allocated"]):
        console.print(line, highlight=False)
    if trainer.device.type != "cuda":
        console.print("memory check: the CPU has no allocator statistics; the plan is checked on CUDA devices",
                      style="dim")
    plot_plan(trainer.plan, run_dir / "vram.png")
    if trainer_hook is not None:
        trainer_hook(trainer)

    logger = RunLogger(run_dir, tensorboard=True, keep=None if state is None else logs_covered(state, run_dir))
    if logger.dropped:
        console.print(f"metrics.jsonl and tensorboard/ rolled back to the checkpoint: {logger.dropped} record(s) "
                      "of epochs after it dropped (they are run again)", highlight=False, soft_wrap=True)
    has_replay = state is None or "replay" in state
    try:
        guard = single_try(OomGuard(trainer, console, logger), job)
        run_loop(trainer, config, run_dir, console, logger, stop, on_epoch, guard, job)
        finished = trainer.epoch >= config.train.epochs
        final = guard.run("checkpoint", save, trainer, run_dir, logger,
                          replay=has_replay and (config.train.keep_replay or not finished))
        stop.saved_epoch = trainer.epoch
        console.print(checkpoint_summary(run_dir / CHECKPOINT_NAME, final) + (
            "; train.keep_replay = false leaves the replay out of a finished run's checkpoint" if "replay" in final
            else "; without the replay buffer: it can be evaluated, not trained on"),
            highlight=False, soft_wrap=True)
        if trainer.device.type == "cuda":
            plan_record["peak"] = peak_memory_row(trainer.plan, torch.cuda.max_memory_reserved(trainer.device))
            for line in format_rows([plan_record["peak"]]):
                console.print(line, highlight=False)
        atomic_write_text(run_dir / "plan.json", json.dumps(plan_record, indent=2))
        report = guard.run("evaluation", final_report, trainer, run_dir, console)
        logger.log(trainer.epoch, "test", {"sharpe": report["test"]["agent"]["sharpe"]})
        if trainer.backtests is not None:
            plan_record["backtest_pool_growth_bytes"] = trainer.backtests.grown_bytes
            atomic_write_text(run_dir / "plan.json", json.dumps(plan_record, indent=2))
            note = backtest_growth_note(trainer.backtests.grown_bytes)
            if note:
                console.print(note, highlight=False, soft_wrap=True)
    finally:
        logger.close()
    if job is not None:
        job.barrier("the end of the run")
    return report


def single_try(guard: OomGuard, job: distributed.Distributed | None) -> OomGuard:
    """In a job of several ranks an out-of-memory error ends the job: a re-plan on one rank alone would leave it
    at another batch, and so another number of updates, than the others."""
    if job is not None and job.world_size > 1:
        guard.max_retries = 0
    return guard


def run_loop(trainer: Trainer, config: Config, run_dir: Path, console: Console, logger: RunLogger,
             stop: StopRequests, on_epoch, guard: OomGuard, job: distributed.Distributed | None = None) -> None:
    """The epochs, until train.epochs, the time limit, ``on_epoch`` saying so, or a stop request (then after
    saving this epoch's checkpoint). In a data-parallel job rank 0 alone validates and checkpoints, and the ranks
    agree at each epoch's end on whether to stop (so all stop at the same epoch)."""
    main = job is None or job.main
    deadline = time.monotonic() + 60 * config.train.minutes if config.train.minutes > 0 else None
    started, first_epoch = time.monotonic(), trainer.epoch
    with stop.graceful(), progress_bar(console) as progress, updates_bar(trainer, progress):
        task = progress.add_task("epoch", total=config.train.epochs, completed=trainer.epoch, status="")
        while trainer.epoch < config.train.epochs:
            stats = guard.run_epoch()
            record = {"epoch": stats.epoch, "updates": stats.updates, "seconds": stats.seconds, **stats.values}
            if main and (stats.epoch % config.train.eval_every == 0 or stats.epoch == config.train.epochs):
                validation = guard.run("evaluation", evaluate_split, trainer.learner, trainer.market_on_device,
                                       config, "validation", baselines=False, progress=progress,
                                       graphs=trainer.backtests).results
                record["validation_sharpe"] = validation["agent"]["sharpe"]
                record["validation_return"] = validation["agent"]["total_return"]
                keep_best(trainer, run_dir, record)
            trainer.history.append(record)
            logger.log(stats.epoch, "epoch", record)
            progress.update(task, completed=stats.epoch, status=status_line(record))
            if not console.is_terminal:  # logs and pipes get one line per epoch instead of a live bar
                left = (time.monotonic() - started) / (stats.epoch - first_epoch) * (config.train.epochs - stats.epoch)
                console.print(f"epoch {stats.epoch}/{config.train.epochs}  {status_line(record)}  "
                              f"ETA {time_text_of(left)}", highlight=False)
            last = stats.epoch == config.train.epochs  # the final checkpoint follows the loop
            signalled = stop.signum is not None
            ended = on_epoch is not None and on_epoch(record)
            stale = main and patience_ran_out(config, trainer.history)
            if stale and not last:
                console.print(f"early stop at epoch {stats.epoch}: {config.train.patience} validation backtest(s) "
                              "in a row without a better Sharpe (train.patience); --resume with --train.patience 0 "
                              "trains on", highlight=False, soft_wrap=True)
            ended = ended or stale
            late = deadline is not None and time.monotonic() > deadline
            if job is not None:  # every rank ends at the same epoch (the others wait here for rank 0)
                signalled, ended, late = job.agree(signalled, ended, late)
            if main and not last and (stats.epoch % config.train.checkpoint_every == 0 or signalled):
                guard.run("checkpoint", save, trainer, run_dir, logger)
                stop.saved_epoch = stats.epoch
            if ended or last:
                break
            if signalled:
                signum = stop.signum or signal.SIGTERM
                name = signal.Signals(signum).name
                raise Interrupted(signum, f"{name}: stopped at the end of epoch {stats.epoch}", saved=True)
            if late:
                console.print(f"time limit of {config.train.minutes:g} min reached at epoch {stats.epoch}; "
                              f"--resume {run_dir} continues (with a new --minutes, or none)",
                              highlight=False, soft_wrap=True)
                break


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), MofNCompleteColumn(), BarColumn(bar_width=20), TimeElapsedColumn(),
        TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=console,
        transient=False,
    )


@contextlib.contextmanager
def updates_bar(trainer: Trainer, progress: Progress):
    """The run's updates as a second bar, moved after every update: the ETA within an epoch (removed at the end:
    the epochs' bar is the one left on the screen or in the log)."""
    task = progress.add_task("update", total=trainer.schedule.updates, completed=trainer.updates_done, status="")
    trainer.on_update = lambda: progress.update(task, completed=trainer.updates_done,
                                                total=max(trainer.schedule.updates, trainer.updates_done))
    try:
        yield
    finally:
        trainer.on_update = None
        progress.remove_task(task)


def time_text_of(seconds: float) -> str:
    """``1:02:03`` / ``2:03``: a duration for a log line."""
    minutes, second = divmod(int(round(seconds)), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}" if hours else f"{minute}:{second:02d}"


def status_line(record: dict[str, Any]) -> str:
    parts = [
        f"env {record.get('env_steps_per_s', 0):,.0f}/s",
        f"upd {record.get('updates_per_s', 0):,.1f}/s",
        f"loss {record['loss']:.3f}" if "loss" in record else "filling replay",
    ]
    if "validation_sharpe" in record:  # None: no Sharpe (a ruined account, or no returns)
        sharpe = record["validation_sharpe"]
        parts.append("val Sharpe -" if sharpe is None else f"val Sharpe {sharpe:.2f}")
    if "gpu_memory_gib" in record:
        parts.append(f"mem {record['gpu_memory_gib']:.2f} GiB")
    return "  ".join(parts)


def validations_since_best(history: list[dict[str, Any]]) -> int:
    """Validation backtests after the best one of ``history`` (the first of equal bests, as :func:`keep_best`
    keeps it; a Sharpe of None beats nothing); 0 when there is no validation yet."""
    scores = [r.get("validation_sharpe") for r in history if "validation_sharpe" in r]
    best = None
    for index, score in enumerate(scores):
        if score is not None and (best is None or score > scores[best]):
            best = index
    return len(scores) - 1 - best if best is not None else len(scores)


def patience_ran_out(config: Config, history: list[dict[str, Any]]) -> bool:
    """``train.patience`` (> 0) validation backtests in a row have not beaten the best: the run ends (early stop)."""
    return 0 < config.train.patience <= validations_since_best(history)


def keep_best(trainer: Trainer, run_dir: Path, record: dict[str, Any]) -> None:
    """Write best.pt (atomically) when ``record``'s validation Sharpe beats every earlier one in the history
    (the history is part of the checkpoint, so a resumed run keeps the same best)."""
    score = record.get("validation_sharpe")
    earlier = [r.get("validation_sharpe") for r in trainer.history if "validation_sharpe" in r]
    if score is not None and all(e is None or score > e for e in earlier):
        save_or_say_what_is_lost(run_dir, BEST_NAME, {"epoch": record["epoch"], "validation_sharpe": score,
                                                      BEST_NETWORK: trainer.learner.evaluated.state_dict()},
                                 f"{BEST_NAME}, the best network so far (epoch {record['epoch']})", record["epoch"])


def select_network(trainer: Trainer, run_dir: Path) -> dict[str, Any]:
    """Load the network the report is about into ``trainer.learner``: best.pt when its validation Sharpe beats
    the final network's, else the final network (then written as best.pt). Chosen on validation only."""
    config = trainer.config
    candidates = [(r["epoch"], r.get("validation_sharpe")) for r in trainer.history if "validation_sharpe" in r]
    if not candidates or candidates[-1][0] != trainer.epoch:  # the final network was not validated yet
        final = evaluate_split(trainer.learner, trainer.market_on_device, config, "validation", baselines=False,
                               graphs=trainer.backtests)
        candidates.append((trainer.epoch, final.results["agent"]["sharpe"]))
    final_score = candidates[-1][1]
    best = load_checkpoint(run_dir / BEST_NAME, map_location=trainer.device) if (run_dir / BEST_NAME).is_file() \
        else None
    if best is not None and best["validation_sharpe"] is not None and (  # a tie keeps the earlier network
            final_score is None or best["validation_sharpe"] >= final_score):
        trainer.learner.evaluated.load_state_dict(best_network_weights(best))
        epoch, score = int(best["epoch"]), float(best["validation_sharpe"])
    else:
        save_checkpoint(run_dir / BEST_NAME, {"epoch": trainer.epoch, "validation_sharpe": final_score,
                                              BEST_NETWORK: trainer.learner.evaluated.state_dict()})
        epoch, score = trainer.epoch, final_score
    scored = [s for _, s in candidates if s is not None]
    reason = (f"the highest validation Sharpe ({score:.2f}) of {len(candidates)} validation backtest(s)"
              if score is not None and len(scored) > 1 else
              "the final network (no validation backtest had a Sharpe to compare)" if score is None else
              f"the only validated network (validation Sharpe {score:.2f})")
    stopped = (f"training stopped early after {config.train.patience} validation backtest(s) without a better "
               "Sharpe (train.patience)" if patience_ran_out(config, trainer.history)
               and trainer.epoch < config.train.epochs else "")
    return {"epoch": epoch, "epochs": trainer.epoch, "validation_sharpe": score, "reason": reason,
            "candidates": candidates, "stopped_early": stopped}


def final_report(trainer: Trainer, run_dir: Path, console: Console) -> dict[str, Any]:
    """Choose the network on validation (:func:`select_network`; the trainer holds it afterwards), backtest it
    on validation and test beside the baselines; report.json, report.md, test_pnl.csv and plots."""
    config = trainer.config
    market = trainer.market_on_device
    console.print(f"final evaluation: the chosen network and the baselines on validation and test, "
                  f"{config.evaluate.bootstrap_samples} bootstrap resamples for the intervals, the plots",
                  style="dim", highlight=False, soft_wrap=True)
    selection = select_network(trainer, run_dir)
    bars = market.bars["timestamp"]
    report: dict[str, Any] = {
        "run_dir": str(run_dir), "data": config.market.data, "bars": market.num_bars,
        "first_time": time_text(bars.iloc[0]), "last_time": time_text(bars.iloc[-1]),
        "train_bars": [time_text(bars.iloc[market.first_bar("train", config.net.window)]),
                       time_text(bars.iloc[market.splits["train"].stop - 1])],
        "contract": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(market.contract).items()},
        "epochs": trainer.epoch, "updates": trainer.updates_done, "batch_size": trainer.batch_size,
        "env_steps": trainer.env_steps_done, "samples": trainer.samples_done,
        "schedule": trainer.schedule.to_json(), "reward": trainer.reward_info.describe(),
        "batch_source": trainer.plan.batch_source, "device": trainer.device_info.name, "threads": config.train.threads,
        "planned_memory": f"{format_bytes(trainer.plan.planned_bytes)} of "
                          f"{format_bytes(trainer.plan.device.free_bytes or 0)} free",
        "selection": selection, "code": code_record(),
    }
    fold = run_fold(run_dir)  # a walk-forward member (fitdqn.train.study)
    if fold is not None:
        report["fold"] = fold.to_json()
    results = {}
    for split in ("validation", "test"):
        results[split] = evaluate_split(trainer.learner, market, config, split, progress=console,
                                        graphs=trainer.backtests)
        report[split] = results[split].results
    report["verdict"] = split_verdict(report["test"], config)
    test = results["test"]
    curves = {policy_label(k, config): v for k, v in test.equity_curves().items()}
    plot_equity(curves, run_dir / "equity_test.png", f"test split: {config.market.data} "
                f"({test.results['currency']}, capital {test.results['capital']:,.0f})", test.agent.timestamp)
    plot_learning_curves([r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"],
                         run_dir / "learning_curves.png", chosen_epoch=selection["epoch"])
    atomic_write_text(run_dir / "test_pnl.csv", test.pnl_frame().to_csv(index=False))
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2))
    markdown = run_markdown(report, config)
    atomic_write_text(run_dir / "report.md", markdown)
    print_report(console, markdown)
    return report


def print_report(console: Console, markdown: str) -> None:
    """Print a report's markdown as written: no wrapping at the console's width (80 in a pipe)."""
    wide = Console(file=console.file, width=max(console.width, TABLE_WIDTH), soft_wrap=True, highlight=False,
                   markup=False, force_terminal=console.is_terminal, color_system=None)
    wide.print(markdown.rstrip("\n"), soft_wrap=True)


def load_network(run_dir: Path, device, which: str = "best"):
    """(config, learner, market, state) of a run directory: the best-by-validation network (best.pt), or ``which
    = 'last'``: the latest checkpoint's (:func:`fitdqn.train.checkpoint.restore_network`)."""
    config = resume_config(run_dir)
    learner = Learner(config, STATE_DIM, device)
    state = restore_network(learner, run_dir, which, device)
    market = load_market(config.market, window=config.net.window, device=device)
    return config, learner, market, state


def evaluate_run(run_dir: Path, split: str, device_spec: str = "auto", console: Console | None = None,
                 network: str = "best") -> dict[str, Any]:
    """Backtest a run's network (``best`` by validation, or ``last``) on ``split`` beside the baselines;
    writes ``evaluate_<split>.json``. A walk-forward fold's run uses its fold's ranges (fold.json). The result is
    printed first, so a failed write loses nothing the user can read."""
    with run_lock(run_dir, create=False):  # one writer per run (re-entrant: `fitdqn evaluate` holds it already)
        console = console or Console()
        device = resolve_device(device_spec)
        config, learner, market, state = load_network(run_dir, device, network)
        fold = run_fold(run_dir)
        if fold is not None:  # a walk-forward member: its own fold's ranges
            market = fold_market(market, fold, config)
        result = evaluate_split(learner, market, config, split, progress=console)
        results = {**result.results, "network": network, "epoch": int(state["epoch"]),
                   "verdict": split_verdict(result.results, config)}
        text = "\n".join([f"{split} split of {config.market.data}, {results['bars']} bars, {network} network (epoch "
                          f"{state['epoch']})", "", results["verdict"], "", *metrics_table(result.results, config), ""])
        print_report(console, text)
        atomic_write_text(run_dir / f"evaluate_{split}_pnl.csv", result.pnl_frame().to_csv(index=False))
        atomic_write_text(run_dir / f"evaluate_{split}.json", json.dumps(results, indent=2))
        return results
