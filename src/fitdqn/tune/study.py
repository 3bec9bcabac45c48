"""The Optuna study of a tune directory: storage, sampler, pruner, what a re-run continues, the best config.

A study remembers the base config, the search space and the objective it was made with (study user attributes);
a re-run with a different one is refused, so every trial of a study is comparable. Trials are counted in all:
``tune.trials`` finished trials (complete, pruned or failed), not counting one that was cut off (its tune process
ended) and queued again with the same params.
"""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.pruners import BasePruner, MedianPruner, NopPruner
from optuna.samplers import BaseSampler, RandomSampler, TPESampler
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from fitdqn import run_lock
from fitdqn.config import Config, ConfigError, TuneConfig, config_to_dict, dump_config, with_overrides
from fitdqn.errors import UserError
from fitdqn.files import STUDY_NAME
from fitdqn.train.checkpoint import atomic_write_text
from fitdqn.train.logs import METRICS_NAME, read_jsonl
from fitdqn.tune.space import SearchSpace, space_json

STUDY_FILE = "study.db"
BEST_FILE = "best.toml"
TRIALS_DIR = "trials"
RESULT_FILE = "result.json"  # what a trial's worker writes when it ends (fitdqn.tune.worker)
REPORT_FILE = "report.json"  # what a run writes last (fitdqn.train.run): its run has finished
REQUEUED_FROM = "requeued_from"  # user attribute of a trial queued again in place of a cut-off one
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")


def check_tune_config(tune: TuneConfig) -> None:
    checks = [
        (tune.trials >= 1, "tune.trials must be at least 1 (--trials N)"),
        (tune.parallel >= 0, "tune.parallel must be 0 (auto) or more (--parallel K)"),
        (tune.sampler in SAMPLERS, f"tune.sampler must be one of {', '.join(SAMPLERS)}"),
        (tune.pruner in PRUNERS, f"tune.pruner must be one of {', '.join(PRUNERS)}"),
        (tune.startup_trials >= 0 and tune.warmup_epochs >= 0,
         "tune.startup_trials and tune.warmup_epochs must be 0 or more"),
        (tune.heartbeat_seconds >= 0, "tune.heartbeat_seconds must be 0 (off) or more"),
        (tune.objective.startswith("validation_"),
         f"tune.objective must be a validation metric of the epoch records (validation_sharpe, validation_return), "
         f"got '{tune.objective}': trials are never chosen on the test split"),
        (bool(tune.study), "tune.study must name the study"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def storage_url(tune: TuneConfig) -> str:
    """tune.storage, or the SQLite file in tune.dir."""
    return tune.storage or f"sqlite:///{(Path(tune.dir) / STUDY_FILE).resolve()}"


def open_storage(url: str, heartbeat_seconds: int = 0) -> RDBStorage:
    """An RDB storage (SQLite, PostgreSQL, MySQL URL); with a heartbeat, a trial whose tune process went silent
    for twice the interval is failed by the next process that looks, and queued again (:func:`requeue`)."""
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # K writers at once
    heartbeat = {"heartbeat_interval": heartbeat_seconds, "heartbeat_stale_trial_callback": requeue_stale
                 } if heartbeat_seconds > 0 else {}
    try:
        return RDBStorage(url, engine_kwargs=engine_kwargs, **heartbeat)
    except (ImportError, ValueError, optuna.exceptions.StorageInternalError) as error:
        raise UserError(f"cannot open the Optuna storage '{url}': {error}; give an SQLAlchemy URL such as "
                        "sqlite:///tune/study.db or postgresql://user@host/db (--storage URL)") from None
    except Exception as error:  # sqlalchemy's own errors (bad URL, unreachable server, a damaged file)
        cause = getattr(error, "orig", None) or error  # the database's own words, without sqlalchemy's SQL and link
        if url.startswith("sqlite:///") and type(cause).__name__ == "DatabaseError":
            path = url.removeprefix("sqlite:///")
            raise UserError(f"the study file '{path}' is damaged ({cause}): restore it from a copy, or start the "
                            "study anew in a new tune directory (--dir NEW_DIR); the trials' run directories beside "
                            "it keep their runs") from None
        raise UserError(f"cannot open the Optuna storage '{url}': {type(cause).__name__}: "
                        f"{str(cause).splitlines()[0] if str(cause) else ''}") from None


def make_sampler(tune: TuneConfig, offset: int) -> BaseSampler:
    """A seeded sampler; ``offset`` (trials already in the study) keeps a re-run from drawing the same params."""
    seed = tune.seed + offset
    if tune.sampler == "random":
        return RandomSampler(seed=seed)
    return TPESampler(seed=seed, constant_liar=tune.parallel != 1)  # running trials count as pending results


def make_pruner(tune: TuneConfig) -> BasePruner:
    if tune.pruner == "none":
        return NopPruner()
    return MedianPruner(n_startup_trials=tune.startup_trials, n_warmup_steps=tune.warmup_epochs)


def study_identity(base: Config, space: SearchSpace) -> dict[str, str]:
    """What makes trials comparable: the base config (less [tune]), the search space, the objective."""
    config = {k: v for k, v in config_to_dict(base).items() if k != "tune"}
    return {"base_config": json.dumps(config, sort_keys=True), "search": space_json(space),
            "objective": base.tune.objective}


def open_study(base: Config, space: SearchSpace, storage: RDBStorage) -> optuna.Study:
    """Create the study, or load it to continue; refuse one made with another config, space or objective."""
    tune = base.tune
    study = optuna.create_study(study_name=tune.study, storage=storage, direction="maximize",
                                pruner=make_pruner(tune), load_if_exists=True)
    identity = study_identity(base, space)
    if not study.user_attrs:
        for key, value in identity.items():
            study.set_user_attr(key, value)
    else:
        check_same_study(study, identity)
    study.sampler = make_sampler(tune, len(study.get_trials(deepcopy=False)))
    return study


def check_same_study(study: optuna.Study, identity: dict[str, str]) -> None:
    saved = study.user_attrs
    hint = "give a new --out (or --tune.study NAME) for a new study"
    if saved.get("objective") != identity["objective"]:
        raise UserError(f"study '{study.study_name}' maximises {saved.get('objective')}, not "
                        f"{identity['objective']}: {hint}")
    if saved.get("search") != identity["search"]:
        raise UserError(f"study '{study.study_name}' was made with another search space ({saved.get('search')}): "
                        f"give the same [search] to continue it, or {hint}")
    if saved.get("base_config") != identity["base_config"]:
        before, now = json.loads(saved.get("base_config", "{}")), json.loads(identity["base_config"])
        changed = sorted(f"{section}.{key}" for section in now for key in now[section]
                         if before.get(section, {}).get(key) != now[section][key])
        raise UserError(f"study '{study.study_name}' was made with another base config (changed: "
                        f"{', '.join(changed) or 'sections'}): give the same config to continue it, or {hint}")


def requeued_numbers(trials: list[FrozenTrial]) -> set[int]:
    return {t.user_attrs[REQUEUED_FROM] for t in trials if REQUEUED_FROM in t.user_attrs}


def count_trials(study: optuna.Study) -> tuple[int, int]:
    """(finished, running) trials of the study; a cut-off trial queued again is not counted as finished."""
    trials = study.get_trials(deepcopy=False)
    replaced = requeued_numbers(trials)
    finished = sum(1 for t in trials if t.state.is_finished() and t.number not in replaced)
    running = sum(1 for t in trials if t.state == TrialState.RUNNING)
    return finished, running


def requeue(study: optuna.Study, storage: RDBStorage, trial: FrozenTrial, reason: str) -> None:
    """Fail a running trial that was cut off (recording why) and queue its params again as a new trial."""
    storage.set_trial_user_attr(trial._trial_id, "error", reason)
    study.tell(trial.number, state=TrialState.FAIL)
    study.enqueue_trial(trial.params, user_attrs={REQUEUED_FROM: trial.number})


def requeue_stale(study: optuna.Study, trial: FrozenTrial) -> None:
    """Optuna's callback for a trial its heartbeat found stale (already failed): queue its params again."""
    study.enqueue_trial(trial.params, user_attrs={REQUEUED_FROM: trial.number})


def pid_alive(pid: Any) -> bool:
    """Whether ``pid`` (a trial's recorded pid: anything) is a process alive on this host."""
    return isinstance(pid, int) and run_lock.pid_alive(pid)


FINISHED = ("complete", "pruned", "fail")  # a trial's result state that the study records as it is
MEASURED = ("epochs", "batch_size", "threads", "samples_per_s", "planned_bytes", "allocator_limit_bytes",
            "peak_reserved_bytes", "ooms", "seconds", "timeline")  # what a trial's result tells beyond its state


def trial_outcome(run_dir: Path, objective: str) -> dict[str, Any]:
    """How a trial's run ended, from its run directory: its worker's ``result.json``; where that says nothing
    finished (the worker was interrupted, or died, after its run had finished), the run's ``report.json`` decides:
    a finished run is complete with its last validated ``objective`` (metrics.jsonl), never run again."""
    try:
        result = json.loads((run_dir / RESULT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        result = {}
    if not isinstance(result, dict):
        result = {}
    if result.get("state") in FINISHED or not (run_dir / REPORT_FILE).is_file():
        return result
    if (run_dir / STUDY_NAME).is_file():  # a walk-forward trial: the mean over its members
        members = json.loads((run_dir / STUDY_NAME).read_text())
        lasts = [last_value(run_dir / m["dir"], objective) for m in members]
        value = sum(lasts) / len(lasts) if lasts and None not in lasts else None
    else:
        value = last_value(run_dir, objective)
    if value is None:
        return {**result, "state": "fail", "error": f"the run finished without reporting {objective}"}
    return {**result, "state": "complete", "value": value}


def last_value(run_dir: Path, objective: str) -> float | None:
    """A run's last validated ``objective`` (its metrics.jsonl), None if it reported none."""
    values = [float(r[objective]) for r in read_jsonl(run_dir / METRICS_NAME)
              if isinstance(r.get(objective), int | float) and math.isfinite(r[objective])]
    return values[-1] if values else None


def record_outcome(study: optuna.Study, storage: RDBStorage, trial: FrozenTrial, result: dict[str, Any]) -> None:
    """Tell the study how a trial ended (``result``'s state is one of FINISHED) with what it measured."""
    for key in MEASURED:
        if result.get(key) is not None:
            storage.set_trial_user_attr(trial._trial_id, key, result[key])
    if result["state"] == "complete":
        study.tell(trial.number, result["value"])
    elif result["state"] == "pruned":
        study.tell(trial.number, state=TrialState.PRUNED)
    else:
        storage.set_trial_user_attr(trial._trial_id, "error", str(result.get("error", "failed"))[-4000:])
        study.tell(trial.number, state=TrialState.FAIL)


def wait_for_exit(pid: Any, seconds: float) -> None:
    """Until process ``pid`` (a cut-off trial's worker, saving its checkpoint) has ended, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def recover_cut_off(study: optuna.Study, storage: RDBStorage, objective: str,
                    stop_seconds: float = 60.0) -> list[tuple[int, str]]:
    """Trials left RUNNING by a tune process of this machine that has ended: once its worker has ended too (at most
    ``stop_seconds``), the run directory decides (:func:`trial_outcome`): a trial whose run finished is recorded
    as it ended, one that did not is failed and queued again. Returns (trial number, what was done) of each.

    Trials of other machines are left to the heartbeat (``tune.heartbeat_seconds``)."""
    host, done = socket.gethostname(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.user_attrs.get("host") == host and not pid_alive(trial.user_attrs.get("tune_pid")):
            wait_for_exit(trial.user_attrs.get("worker_pid"), stop_seconds)
            run_dir = trial.user_attrs.get("run_dir")
            result = trial_outcome(Path(run_dir), objective) if run_dir else {}
            if result.get("state") in FINISHED:
                record_outcome(study, storage, trial, result)
                done.append((trial.number, result["state"]))
            else:
                requeue(study, storage, trial, "cut off: its tune process ended before the trial finished; "
                        "queued again")
                done.append((trial.number, "queued again"))
    if storage.get_heartbeat_interval() is not None:
        optuna.storages.fail_stale_trials(study)
    return done


def best_config(base: Config, study: optuna.Study) -> tuple[Config, FrozenTrial] | None:
    """The base config with the best complete trial's params, or None while no trial is complete."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return None
    best = max(complete, key=lambda t: t.value)
    return with_overrides(base, dict(best.params)), best


def tried_values(study: optuna.Study) -> list[float]:
    """The objective of every trial that was tried on validation: a complete trial's value, a pruned trial's last
    reported one (failed trials never reached validation)."""
    values = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if trial.state == TrialState.COMPLETE:
            values.append(float(trial.value))
        elif trial.intermediate_values:
            values.append(float(trial.intermediate_values[max(trial.intermediate_values)]))
    return values


def tries_of(base: Config, study: optuna.Study, tune_dir: Path) -> dict[str, Any]:
    """What a report needs to deflate the best trial's Sharpe for the tries (``evaluate.tried_*``): their number and
    the variance of their validation Sharpes (none unless the objective is the validation Sharpe)."""
    values = tried_values(study)
    if base.tune.objective != "validation_sharpe" or len(values) < 2:
        return {}
    return {"evaluate.tried_configs": len(values), "evaluate.tried_sharpe_variance": float(np.var(values, ddof=1)),
            "evaluate.tried_in": f"tune study '{study.study_name}' of {tune_dir}"}


def write_best_config(base: Config, study: optuna.Study, tune_dir: Path) -> Path | None:
    """``best.toml``: what ``fitdqn train --config`` takes to train the best trial's config again, with where it came
    from (``evaluate.tried_*``: the study, its trials and their Sharpes' variance, so that run's report deflates its
    Sharpe for them)."""
    found = best_config(base, study)
    if found is None:
        return None
    config, trial = found
    config = with_overrides(config, tries_of(base, study, tune_dir))
    header = (f"# best trial {trial.number} of study '{study.study_name}': {base.tune.objective} = {trial.value:.4f}"
              f"\n# run: {trial.user_attrs.get('run_dir', '?')}\n# train it again: fitdqn train --config "
              f"{tune_dir / BEST_FILE}\n")
    path = tune_dir / BEST_FILE
    atomic_write_text(path, header + dump_config(config))
    return path


def trial_config(base: Config, params: dict[str, Any], run_dir: Path) -> Config:
    """A trial's config: the base with its params, writing into its own run directory; its finished checkpoint
    keeps the replay only where ``tune.keep_replay`` asks."""
    try:
        return with_overrides(base, {**params, "train.out": str(run_dir), "train.keep_replay": base.tune.keep_replay})
    except ConfigError as error:
        raise UserError(f"params {params} make an invalid config: {error}") from None
