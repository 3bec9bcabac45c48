"""One trial in its own process: ``python -m fitdqn.tune.worker RUN_DIR/trial.json``.

The tune process writes ``trial.json`` (the trial's config, its thread count and memory share, the study) and
reads back ``result.json``; it alone tells the study how the trial ended. Here: cap this process's threads and,
on a GPU, its allocator (``torch.cuda.set_per_process_memory_fraction``, before anything is allocated: the probe
reads the cap into ``DeviceInfo.allocator_limit_bytes`` and the planner plans within it), then train the run with
an epoch hook that reports the validation objective to the study and stops the run when the pruner says so.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import optuna
import torch
from rich.console import Console

from fitdqn.config import Config, config_from_dict
from fitdqn.errors import UserError
from fitdqn.files import CHECKPOINT_NAME
from fitdqn.schedule.member import cap_memory
from fitdqn.train.checkpoint import atomic_write_text
from fitdqn.train.logs import read_jsonl
from fitdqn.train.run import train
from fitdqn.train.study import StudyMember, is_study, run_study
from fitdqn.tune.study import RESULT_FILE, make_pruner, open_storage

SPEC_FILE = "trial.json"
LOG_FILE = "train.log"


class EpochReporter:
    """``train(on_epoch=...)``: reports each validated epoch's objective to the trial; True (stop) when pruned."""

    def __init__(self, trial: optuna.trial.Trial, objective: str) -> None:
        self.trial, self.objective = trial, objective
        self.last: float | None = None
        self.pruned = False
        self.epochs: list[dict[str, Any]] = []  # per epoch: when it ended, its seconds, updates and batch

    def __call__(self, record: dict[str, Any]) -> bool:
        self.epochs.append({"epoch": record["epoch"], "end": time.time(), "seconds": record["seconds"],
                            "updates": record["updates"], "batch_size": record.get("batch_size")})
        value = record.get(self.objective)
        if value is None or not math.isfinite(float(value)):
            return False
        self.last = float(value)
        self.trial.report(self.last, step=int(record["epoch"]))
        if self.trial.should_prune():
            self.pruned = True
            return True
        return False


def run_trial(spec: dict[str, Any], console: Console) -> dict[str, Any]:
    """Train the trial's run; the result the tune process records (state, value and what the run measured)."""
    torch.set_num_threads(spec["threads"])
    config = config_from_dict(spec["config"])
    cap_memory(config.train.device, spec["memory_fraction"])
    storage = open_storage(spec["storage"])
    study = optuna.load_study(study_name=spec["study"], storage=storage, pruner=make_pruner(config.tune))
    trial = optuna.trial.Trial(study, spec["trial_id"])
    run_dir = Path(config.train.out)
    if is_study(config):
        return run_study_trial(config, run_dir, trial, console)
    reporter = EpochReporter(trial, config.tune.objective)
    held: dict[str, Any] = {}

    def keep_trainer(trainer) -> None:  # the plan beside the run from the start (train() rewrites it at the end)
        held["trainer"] = trainer
        atomic_write_text(run_dir / "plan.json", json.dumps(trainer.plan.to_json(), indent=2))

    train(config, run_dir, console=console, trainer_hook=keep_trainer, on_epoch=reporter)
    result = run_measurements(held["trainer"], reporter, run_dir)
    if reporter.last is None:
        return {**result, "state": "fail", "error": f"the run reported no {config.tune.objective}: validate at "
                f"least once (train.eval_every <= train.epochs, and no train.minutes limit before it)"}
    return {**result, "state": "pruned" if reporter.pruned else "complete", "value": reporter.last}


class LastValue:
    """``train(on_epoch=...)``: keeps the last validated ``objective`` of a run; never stops it."""

    def __init__(self, objective: str) -> None:
        self.objective, self.value = objective, None

    def __call__(self, record: dict[str, Any]) -> bool:
        value = record.get(self.objective)
        if value is not None and math.isfinite(float(value)):
            self.value = float(value)
        return False


class StudyPruned(Exception):
    """A walk-forward trial's running mean fell below the pruner's bar: its remaining members are not trained."""


def run_study_trial(config: Config, run_dir: Path, trial, console: Console) -> dict[str, Any]:
    """A trial that is itself a study (``evaluate.seeds``/``evaluate.folds`` > 1): its members train one after
    another in this process, within the trial's share (:func:`fitdqn.train.study.run_study`, which writes the
    study report). Each member's last validated objective counts; after each member the mean so far is reported
    to the trial at step = members done (the pruner compares trials of the same layout member by member), and the
    trial's value is the mean over its members."""
    objective = config.tune.objective
    values: list[float] = []
    pruned = False

    def run_members(todo: list[StudyMember], console: Console) -> None:
        nonlocal pruned
        for member in todo:
            last = LastValue(objective)
            train(member.config, member.run_dir, resume=(member.run_dir / CHECKPOINT_NAME).is_file(), console=console,
                  market=member.market, on_epoch=last)
            if last.value is not None:
                values.append(last.value)
                trial.report(sum(values) / len(values), step=len(values))
                if trial.should_prune():
                    pruned = True
                    raise StudyPruned

    try:
        run_study(config, run_dir, console, run_members=run_members)
    except StudyPruned:
        pass
    if not values:
        return {"state": "fail", "error": f"the study's members reported no {objective}: validate at least once "
                "(train.eval_every <= train.epochs)"}
    return {"state": "pruned" if pruned else "complete", "value": sum(values) / len(values),
            "epochs": config.train.epochs, "threads": torch.get_num_threads()}


def run_measurements(trainer, reporter: EpochReporter, run_dir: Path) -> dict[str, Any]:
    timed = [e for e in reporter.epochs if e["updates"]]
    samples = sum(e["updates"] * (e["batch_size"] or trainer.batch_size) for e in timed)
    seconds = sum(e["seconds"] for e in timed)
    result = {
        "epochs": trainer.epoch, "batch_size": trainer.batch_size, "threads": torch.get_num_threads(),
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "planned_bytes": trainer.plan.planned_bytes,
        "allocator_limit_bytes": trainer.device_info.allocator_limit_bytes,
        "ooms": sum(1 for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "oom"),
        "timeline": reporter.epochs,
    }
    if trainer.device.type == "cuda":
        result["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(trainer.device))
    return result


def error_text(error: BaseException) -> str:
    return str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    result_path = spec_path.parent / RESULT_FILE
    started = time.monotonic()
    console = Console()
    code = 0
    try:
        result = run_trial(spec, console)
    except KeyboardInterrupt:
        result, code = {"state": "interrupted"}, 130
    except Exception as error:  # the trial fails, the study goes on: its error is recorded
        traceback.print_exc()
        result, code = {"state": "fail", "error": error_text(error)}, 1
    result["seconds"] = time.monotonic() - started
    atomic_write_text(result_path, json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
