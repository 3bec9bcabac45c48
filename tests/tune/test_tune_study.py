import json
import socket
import subprocess
import sys
import time

import pytest

optuna = pytest.importorskip("optuna")

from optuna.pruners import MedianPruner  # noqa: E402
from optuna.trial import TrialState, create_trial  # noqa: E402
from tune_helpers import quiet  # noqa: E402

from fitdqn.cli import main  # noqa: E402
from fitdqn.config import Config, with_overrides  # noqa: E402
from fitdqn.errors import UserError  # noqa: E402
from fitdqn.tune.space import parse_search_space  # noqa: E402
from fitdqn.tune.study import (  # noqa: E402
    REQUEUED_FROM,
    count_trials,
    open_storage,
    open_study,
    recover_cut_off,
    storage_url,
)
from fitdqn.tune.worker import EpochReporter  # noqa: E402

SEARCH = {"learn.lr": {"low": 1e-5, "high": 1e-3, "log": True}, "learn.n_step": {"choices": [1, 3]}}


def base_config(tmp_path, **overrides):
    return with_overrides(Config(), {"tune.dir": str(tmp_path / "tune"), **overrides})


def epoch(number, **values):
    return {"epoch": number, "seconds": 0.5, "updates": 4, "batch_size": 64, **values}


def test_reporter_reports_validated_epochs_and_stops_when_pruned():
    study = optuna.create_study(direction="maximize", pruner=MedianPruner(n_startup_trials=1))
    study.add_trial(create_trial(value=3.0, intermediate_values={1: 1.0, 2: 3.0}))
    trial = study.ask()
    reporter = EpochReporter(trial, "validation_sharpe")
    assert reporter(epoch(1)) is False  # not validated this epoch: nothing reported
    assert reporter(epoch(1, validation_sharpe=1.5)) is False  # above the median of epoch 1
    assert reporter(epoch(2, validation_sharpe=2.0)) is True  # its best, 2.0, is below the median of epoch 2: stop
    assert reporter.pruned and reporter.last == 2.0
    assert study.trials[1].intermediate_values == {1: 1.5, 2: 2.0}
    assert [e["epoch"] for e in reporter.epochs] == [1, 1, 2]


def test_trials_are_packed_by_the_base_configs_plan_on_a_gpu_and_split_the_threads_on_a_cpu(tmp_path):
    from fitdqn.schedule.packing import packing
    from fitdqn.tune.runner import plan_resources

    config = base_config(tmp_path, **{"train.device": "cpu", "train.threads": 16})
    assert plan_resources(config).packing == packing(None, None, 16, 0)  # auto on a CPU: one at a time
    assert plan_resources(with_overrides(config, {"tune.parallel": 4})).packing.threads == 4
    assert plan_resources(config).fraction(None) is None


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_cut_off_trial_is_failed_and_queued_again(tmp_path):
    config = base_config(tmp_path)
    space = parse_search_space(SEARCH, config)
    (tmp_path / "tune").mkdir()
    storage = open_storage(storage_url(config.tune))
    study = open_study(config, space, storage)
    alive, cut = study.ask(space.distributions), study.ask(space.distributions)
    for trial, pid in ((alive, 0), (cut, dead_pid())):
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("tune_pid", pid or __import__("os").getpid())
    assert recover_cut_off(study, storage, "validation_sharpe") == [(cut.number, "queued again")]
    trials = study.get_trials()
    assert trials[alive.number].state == TrialState.RUNNING
    assert trials[cut.number].state == TrialState.FAIL and "cut off" in trials[cut.number].user_attrs["error"]
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs[REQUEUED_FROM] == cut.number
    assert count_trials(study) == (0, 1)  # the cut-off trial does not count as finished
    again = study.ask(space.distributions)
    assert again.params == cut.params


def cut_off_trial(study, space, run_dir):
    """A trial left RUNNING by a tune process that has ended (SIGKILL), with its run directory."""
    trial = study.ask(space.distributions)
    for key, value in (("host", socket.gethostname()), ("tune_pid", dead_pid()), ("worker_pid", dead_pid()),
                       ("run_dir", str(run_dir))):
        trial.set_user_attr(key, value)
    run_dir.mkdir(parents=True)
    return trial


def test_a_trial_that_finished_before_its_tune_process_was_killed_is_recorded_not_run_again(tmp_path):
    """SIGKILL of `fitdqn tune` after a trial's run finished but before the study heard: the same command again
    records the trial as it ended (its result.json; or, where the worker was interrupted after its run finished,
    the run's report.json and its last validated value) and never fails it or queues it again."""
    config = base_config(tmp_path)
    space = parse_search_space(SEARCH, config)
    (tmp_path / "tune").mkdir()
    storage = open_storage(storage_url(config.tune))
    study = open_study(config, space, storage)
    told = cut_off_trial(study, space, tmp_path / "told")
    (tmp_path / "told" / "result.json").write_text(json.dumps({"state": "complete", "value": 0.75, "epochs": 2}))
    late = cut_off_trial(study, space, tmp_path / "late")  # interrupted by its parent's death after the run ended
    (tmp_path / "late" / "result.json").write_text(json.dumps({"state": "interrupted"}))
    (tmp_path / "late" / "report.json").write_text("{}")
    (tmp_path / "late" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"epoch": 1, "validation_sharpe": 0.5}, {"epoch": 2, "validation_sharpe": 1.25}, {"epoch": 3},
        {"kind": "oom"})))
    cut = cut_off_trial(study, space, tmp_path / "cut")  # its run had not finished
    (tmp_path / "cut" / "result.json").write_text(json.dumps({"state": "interrupted"}))
    assert recover_cut_off(study, storage, "validation_sharpe") == [
        (told.number, "complete"), (late.number, "complete"), (cut.number, "queued again")]
    trials = study.get_trials()
    assert trials[told.number].state == TrialState.COMPLETE and trials[told.number].value == 0.75
    assert trials[told.number].user_attrs["epochs"] == 2
    assert trials[late.number].state == TrialState.COMPLETE and trials[late.number].value == 1.25
    assert trials[cut.number].state == TrialState.FAIL
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [t.user_attrs[REQUEUED_FROM] for t in waiting] == [cut.number]  # only the unfinished one runs again
    assert count_trials(study) == (2, 0)


def test_a_study_refuses_another_space_or_base_config(tmp_path):
    config = base_config(tmp_path)
    (tmp_path / "tune").mkdir()
    storage = open_storage(storage_url(config.tune))
    open_study(config, parse_search_space(SEARCH, config), storage)
    open_study(with_overrides(config, {"tune.trials": 99}), parse_search_space(SEARCH, config), storage)  # [tune] ok
    with pytest.raises(UserError, match="another search space"):
        open_study(config, parse_search_space({"learn.lr": {"low": 1e-5, "high": 1e-2}}, config), storage)
    with pytest.raises(UserError, match=r"another base config \(changed: learn.gamma\)"):
        open_study(with_overrides(config, {"learn.gamma": 0.95}), parse_search_space(SEARCH, config), storage)


def test_missing_optuna_is_a_clean_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)
    assert main(["tune", "--report", "tune"]) == 2
    assert "pip install 'fitdqn[tune]'" in capsys.readouterr().err


def test_report_of_a_directory_without_a_study(tmp_path, capsys):
    assert main(["tune", "--report", str(tmp_path)]) == 2
    assert "no study.db" in capsys.readouterr().err
    assert not (tmp_path / "study.db").exists()


def test_objective_must_be_a_validation_metric(tmp_path):
    from fitdqn.tune.runner import TuneRun

    config = base_config(tmp_path, **{"tune.objective": "test_sharpe"})
    with pytest.raises(UserError, match="never chosen on the test split"):
        TuneRun(config, parse_search_space(SEARCH, config), console=None)


def test_a_trial_of_another_machine_gone_silent_is_queued_again(tmp_path):
    config = base_config(tmp_path, **{"tune.heartbeat_seconds": 1})
    space = parse_search_space(SEARCH, config)
    (tmp_path / "tune").mkdir()
    storage = open_storage(storage_url(config.tune), heartbeat_seconds=1)
    study = open_study(config, space, storage)
    trial = study.ask(space.distributions)
    trial.set_user_attr("host", "another-machine")
    storage.record_heartbeat(trial._trial_id)
    assert recover_cut_off(study, storage, "validation_sharpe") == [] and study.trials[0].state == TrialState.RUNNING
    time.sleep(3.5)  # past the grace period (twice the interval; SQLite keeps whole seconds) without a heartbeat
    recover_cut_off(study, storage, "validation_sharpe")
    assert study.trials[0].state == TrialState.FAIL
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs[REQUEUED_FROM] == 0
    assert study.ask(space.distributions).params == trial.params


def test_bars_that_do_not_load_stop_the_study_before_any_trial(tmp_path):
    from fitdqn.tune.runner import TuneRun

    config = base_config(tmp_path, **{"market.data": str(tmp_path / "missing.csv")})
    run = TuneRun(config, parse_search_space(SEARCH, config), console=quiet())
    with pytest.raises(UserError, match="missing.csv"):
        run.run()
    assert run.study.get_trials() == []


class FakeTrial:
    """What a trial's process tells the study: the values reported, and a pruner that prunes below ``bar``."""

    def __init__(self, bar: float | None = None) -> None:
        self.reports, self.bar = [], bar

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.bar is not None and self.reports[-1][1] < self.bar


def test_a_walk_forward_trial_is_its_members_mean_and_is_pruned_member_by_member(tmp_path):
    import json

    from tune_helpers import TINY, quiet

    from fitdqn.tune.study import last_value, trial_outcome
    from fitdqn.tune.worker import run_study_trial

    config = with_overrides(Config(), {**TINY, "train.epochs": 1, "evaluate.folds": 2,
                                       "evaluate.bootstrap_samples": 200, "train.out": str(tmp_path / "trial")})
    trial = FakeTrial()
    result = run_study_trial(config, tmp_path / "trial", trial, quiet())
    lasts = [last_value(tmp_path / "trial" / f"seed_0/fold_{k}", "validation_sharpe") for k in range(2)]
    assert result["state"] == "complete" and result["value"] == pytest.approx(sum(lasts) / 2)
    assert trial.reports == [(1, pytest.approx(lasts[0])), (2, pytest.approx(sum(lasts) / 2))]
    assert json.loads((tmp_path / "trial" / "report.json").read_text())["members"]  # the study report
    # killed after its study finished, before telling the study: the run directory gives the same value
    assert trial_outcome(tmp_path / "trial", "validation_sharpe")["value"] == pytest.approx(result["value"])
    pruned = FakeTrial(bar=float("inf"))  # below any bar: pruned after its first member
    result = run_study_trial(with_overrides(config, {"train.out": str(tmp_path / "pruned")}), tmp_path / "pruned",
                             pruned, quiet())
    assert result["state"] == "pruned" and len(pruned.reports) == 1
    assert not (tmp_path / "pruned" / "seed_0" / "fold_1" / "report.json").exists()
