"""`fitdqn tune --report DIR`: the trials as a table, the best trial's Sharpe deflated for the tries (the deflated
Sharpe ratio, :mod:`fitdqn.evaluate.significance`), and PNGs of the optimisation history and the parameters'
importances (Optuna's matplotlib plots; importances need at least two complete trials)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.table import Table

from fitdqn.config import TuneConfig
from fitdqn.errors import UserError
from fitdqn.evaluate.significance import deflated_sharpe
from fitdqn.files import atomic_savefig
from fitdqn.tune.study import BEST_FILE, STUDY_FILE, open_storage, requeued_numbers, tried_values

HISTORY_PNG = "history.png"
IMPORTANCES_PNG = "importances.png"


def load_study_of(tune_dir: Path, tune: TuneConfig) -> optuna.Study:
    """The study of a tune directory (its study.db, or tune.storage), by tune.study or the only one there."""
    if tune.storage:
        url = tune.storage
    else:
        path = tune_dir / STUDY_FILE
        if not path.is_file():
            raise UserError(f"'{tune_dir}' has no {STUDY_FILE}: not a tune directory (fitdqn tune --out DIR makes "
                            "one), or give the study's --storage URL")
        url = f"sqlite:///{path.resolve()}"
    storage = open_storage(url)
    names = optuna.get_all_study_names(storage)
    if tune.study in names:
        name = tune.study
    elif len(names) == 1:
        name = names[0]
    else:
        raise UserError(f"no study '{tune.study}' in {url}; studies there: {', '.join(names) or 'none'} "
                        "(choose one with --tune.study NAME)")
    return optuna.load_study(study_name=name, storage=storage)


def state_of(trial: FrozenTrial, replaced: set[int]) -> str:
    if trial.number in replaced:
        return "cut off"
    return trial.state.name.lower()


def note_of(trial: FrozenTrial) -> str:
    attrs = trial.user_attrs
    if "error" in attrs:
        return str(attrs["error"]).strip().splitlines()[0][:100] if str(attrs["error"]).strip() else ""
    if "requeued_from" in attrs:
        return f"again: trial {attrs['requeued_from']}"
    return ""


def trials_table(study: optuna.Study) -> Table:
    trials = study.get_trials(deepcopy=False)
    objective = study.user_attrs.get("objective", "value")
    keys = list(dict.fromkeys(k for t in trials for k in t.params))
    best = best_number(study)
    table = Table(title=f"study '{study.study_name}': {len(trials)} trials, maximising {objective}",
                  title_justify="left")
    for column in ("trial", "state", "value", *short_names(keys), "epochs", "batch", "samples/s", "s", "note"):
        table.add_column(column, justify="left" if column in ("state", "note") else "right", overflow="fold")
    replaced = requeued_numbers(trials)
    for trial in trials:
        attrs = trial.user_attrs
        cells = [f"{trial.number}{' *' if trial.number == best else ''}", state_of(trial, replaced),
                 "-" if trial.value is None else f"{trial.value:.4f}"]
        cells += [format_value(trial.params.get(k), ".3g") for k in keys]
        cells += [format_value(attrs.get("epochs")), format_value(attrs.get("batch_size")),
                  format_value(attrs.get("samples_per_s"), ",.0f"), format_value(attrs.get("seconds"), ".0f"),
                  note_of(trial)]
        table.add_row(*cells)
    return table


def short_names(keys: list[str]) -> list[str]:
    """Param columns by field name ('lr'), by the whole key where two sections share a field name."""
    fields = [k.partition(".")[2] for k in keys]
    return [f if fields.count(f) == 1 else k for k, f in zip(keys, fields, strict=True)]


def best_number(study: optuna.Study) -> int | None:
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max(complete, key=lambda t: t.value).number if complete else None


def format_value(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def tries_counted(study: optuna.Study) -> dict[str, Any] | None:
    """The best trial's validation Sharpe deflated for the tries: every trial tried on validation (complete or
    pruned) and the variance of their Sharpes; the returns' length, skew and kurtosis from the best trial's run
    (its report.json's validation split; normal returns over its validation bars where the report predates
    them). None unless the objective is the validation Sharpe and at least two trials were tried."""
    best = best_number(study)
    values = tried_values(study)
    if study.user_attrs.get("objective") != "validation_sharpe" or best is None or len(values) < 2:
        return None
    trial = study.trials[best]
    try:
        report = json.loads((Path(trial.user_attrs["run_dir"]) / "report.json").read_text())
        validation = report["validation"]
    except (KeyError, OSError, json.JSONDecodeError):
        return None
    moments = validation["agent"].get("return_moments") or {"bars": validation["bars"], "skew": 0.0,
                                                            "kurtosis": 3.0}
    return {**deflated_sharpe(float(trial.value), float(validation["periods_per_year"]), moments, len(values),
                              float(np.var(values, ddof=1))), "trial": best}


def deflated_line(deflated: dict[str, Any]) -> str:
    value = deflated["deflated_sharpe"]
    return (f"deflated Sharpe: trial {deflated['trial']}'s validation Sharpe {deflated['sharpe']:.2f} is the best of "
            f"{deflated['trials']} tried (their Sharpes' variance {deflated['trials_sharpe_variance']:.3g}); luck "
            f"alone gives a best of {deflated['expected_max_sharpe']:.2f}, so the probability that its true Sharpe is "
            f"above that is {'-' if value is None else f'{value:.2f}'} (the deflated Sharpe ratio, over "
            f"{deflated['bars']} validation bars of skew {deflated['skew']:.2f} and kurtosis "
            f"{deflated['kurtosis']:.2f}). A run trained from best.toml deflates its test Sharpe the same way.")


def write_plots(study: optuna.Study, out_dir: Path) -> tuple[list[Path], list[str]]:
    """history.png always (with any finished trial); importances.png with >= 2 complete trials."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization.matplotlib import plot_optimization_history, plot_param_importances

    written, notes = [], []
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    # Optuna's plots set a matplotlib style for the whole process (plt.style.use): kept to these plots, so a run's
    # plots drawn later in the same process look as they do anywhere else
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if complete:
            path = out_dir / HISTORY_PNG
            save(plot_optimization_history(study, target_name=study.user_attrs.get("objective", "value")), path, plt)
            written.append(path)
        else:
            notes.append("no complete trial yet: no optimisation history plot")
        if len(complete) >= 2 and any(len(t.distributions) for t in complete):
            path = out_dir / IMPORTANCES_PNG
            save(plot_param_importances(study, evaluator=optuna.importance.PedAnovaImportanceEvaluator()), path,
                 plt)
            written.append(path)
        else:
            notes.append(f"{len(complete)} complete trial(s): parameter importances need at least 2")
    return written, notes


def save(axes, path: Path, plt) -> None:
    figure = axes.figure
    figure.set_size_inches(8, 4.5)
    figure.tight_layout()
    atomic_savefig(figure, path, dpi=110)  # a full disk or a kill keeps the previous plot
    plt.close(figure)


def print_report(tune_dir: Path, tune: TuneConfig, console: Console | None = None, plots: bool = True
                 ) -> optuna.Study:
    console = console or Console()
    if not console.is_terminal:  # a log or a pipe: room for every column instead of 80 characters
        console.width = max(console.width, 160)
    study = load_study_of(tune_dir, tune)
    console.print(trials_table(study))
    best = best_number(study)
    if best is not None:
        trial = study.trials[best]
        console.print(f"best: trial {best}, {study.user_attrs.get('objective', 'value')} {trial.value:.4f}; "
                      f"run {trial.user_attrs.get('run_dir', '?')}; config {tune_dir / BEST_FILE}", highlight=False)
        deflated = tries_counted(study)
        if deflated is not None:
            console.print(deflated_line(deflated), highlight=False, markup=False)
    if plots:
        written, notes = write_plots(study, tune_dir)
        for note in notes:
            console.print(note, style="dim")
        if written:
            console.print("plots: " + ", ".join(str(p) for p in written), highlight=False)
    return study
