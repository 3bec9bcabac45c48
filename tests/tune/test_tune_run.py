"""Whole studies on the CPU: trial processes of a tiny config (2 epochs of 16 env steps, tiny nets)."""

import json
import math
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from optuna.trial import TrialState  # noqa: E402
from tune_helpers import SEARCH, TINY, quiet, tiny_config, toml_of  # noqa: E402

from fitdqn.cli import main  # noqa: E402
from fitdqn.config import load_config, with_overrides  # noqa: E402
from fitdqn.device.threads import cpu_threads  # noqa: E402
from fitdqn.evaluate.significance import deflated_sharpe  # noqa: E402
from fitdqn.train.logs import read_jsonl  # noqa: E402
from fitdqn.tune.report import print_report  # noqa: E402
from fitdqn.tune.runner import run_tune  # noqa: E402
from fitdqn.tune.space import parse_search_space  # noqa: E402
from fitdqn.tune.study import BEST_FILE, open_storage, open_study, storage_url  # noqa: E402

FAILING = {"learn.lr": -1.0, "learn.n_step": 1}  # outside the range, queued by hand: its config is refused


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A 3-trial study, 2 at once: trial 0 is the failing one queued by hand, trials 1 and 2 are sampled."""
    tune_dir = tmp_path_factory.mktemp("tune")
    config = tiny_config(tune_dir, trials=3, parallel=2)
    space = parse_search_space(SEARCH, config)
    study = open_study(config, space, open_storage(storage_url(config.tune)))
    study.enqueue_trial(FAILING)
    console = quiet()
    study = run_tune(config, space, console)
    return config, space, study, console.file.getvalue()


def test_a_three_trial_study_completes(tuned):
    config, _space, study, _output = tuned
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    for trial in trials[1:]:
        run_dir = Path(trial.user_attrs["run_dir"])
        epochs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "epoch"]
        assert len(epochs) == config.train.epochs
        # the objective is the validation Sharpe the run reported at its last epoch, never a test figure
        assert trial.value == pytest.approx(epochs[-1]["validation_sharpe"])
        assert trial.intermediate_values == pytest.approx({r["epoch"]: r["validation_sharpe"] for r in epochs})
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["batch_size"] == 64 and "allocated" in plan
        assert load_config(run_dir / "config.toml").learn.lr == pytest.approx(trial.params["learn.lr"])
        assert trial.user_attrs["threads"] == max(cpu_threads(0) // 2, 1)
        assert trial.user_attrs["ooms"] == 0 and trial.user_attrs["samples_per_s"] > 0
        # a finished trial keeps what evaluate, act and export need, not its replay (tune.keep_replay = false)
        checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
        assert "replay" not in checkpoint and "learner" in checkpoint
        assert load_config(run_dir / "config.toml").train.keep_replay is False


def test_a_trial_that_raises_is_recorded_as_failed(tuned):
    _config, _space, study, output = tuned
    failed = study.trials[0]
    assert failed.params == FAILING
    assert "learn.lr must be in (0, 1], got -1.0" in failed.user_attrs["error"]
    assert "trial 0 failed: " in output and "the study goes on" in output
    assert all(math.isfinite(t.value) for t in study.trials[1:])


def test_the_best_config_loads_for_train(tuned, tmp_path):
    config, _space, study, _output = tuned
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    best = max(complete, key=lambda t: t.value)
    loaded = load_config(Path(config.tune.dir) / BEST_FILE)
    # where it came from: the trials tried on validation (the failed one never was) and their Sharpes' variance
    tries = {"evaluate.tried_configs": 2, "evaluate.tried_sharpe_variance": float(np.var([t.value for t in complete],
                                                                                         ddof=1)),
             "evaluate.tried_in": f"tune study 'tiny' of {config.tune.dir}"}
    assert loaded == with_overrides(config, {**best.params, **tries})
    assert loaded.train.out == ""  # a new run directory, not the trial's
    # a run trained from best.toml deflates its test Sharpe for the two tries, in its report and its verdict
    run_dir = tmp_path / "again"
    assert main(["train", "--config", str(Path(config.tune.dir) / BEST_FILE), "--out", str(run_dir), "--device",
                 "cpu"]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    test = report["test"]["agent"]
    expected = deflated_sharpe(test["sharpe"], report["test"]["periods_per_year"], test["return_moments"], 2,
                               tries["evaluate.tried_sharpe_variance"])
    assert test["deflated_sharpe"] == {**expected, "tried_in": tries["evaluate.tried_in"]}
    assert "This configuration is the best of 2 tried in tune study 'tiny'" in report["verdict"]


def test_the_report_lists_trials_and_plots(tuned):
    import matplotlib

    config, _space, _study, _output = tuned
    console = quiet()
    def style():  # the drawing settings (the report chooses the Agg backend for good)
        return {k: v for k, v in matplotlib.rcParams.items() if not k.startswith("backend")}

    before = style()
    print_report(Path(config.tune.dir), config.tune, console)
    # Optuna's plots set their style for the process: the report keeps it to its own plots (a run plotted later in
    # the same process draws as anywhere else, byte for byte)
    assert style() == before
    text = console.file.getvalue()
    assert "fail" in text and "learn.lr must be in (0, 1]" in text and text.count("complete") == 2
    assert "deflated Sharpe: trial " in text and "is the best of 2 tried" in text
    assert (Path(config.tune.dir) / "history.png").stat().st_size > 0
    assert (Path(config.tune.dir) / "importances.png").stat().st_size > 0


def test_a_rerun_continues_without_repeating(tuned, tmp_path):
    config, space, study, _output = tuned
    before = [(t.number, t.state, t.value, t.params) for t in study.get_trials()]
    again = run_tune(config, space, quiet())  # the same command: the study already has its 3 trials
    assert [(t.number, t.state, t.value, t.params) for t in again.get_trials()] == before
    # one more trial, through the command line (the same base config and search space as a TOML file)
    file = tmp_path / "tune.toml"
    file.write_text(toml_of(TINY, SEARCH))
    assert main(["tune", "--config", str(file), "--dir", config.tune.dir, "--tune.study", "tiny", "--trials", "4",
                 "--parallel", "2"]) == 0
    trials = optuna.load_study(study_name="tiny", storage=storage_url(config.tune)).get_trials()
    assert [(t.number, t.state, t.value, t.params) for t in trials[:3]] == before
    assert len(trials) == 4 and trials[3].state == TrialState.COMPLETE
    assert trials[3].params not in [t.params for t in trials[:3]]
    # trial 0's config is refused before it runs, so it leaves no folder
    assert sorted(p.name for p in (Path(config.tune.dir) / "trials").iterdir()) == ["0001", "0002", "0003"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_parallel_trials_share_the_gpu(tmp_path):
    config = with_overrides(tiny_config(tmp_path / "tune", trials=2, parallel=2), {"train.device": "cuda"})
    study = run_tune(config, parse_search_space(SEARCH, config), quiet())
    total = torch.cuda.get_device_properties(0).total_memory
    for trial in study.get_trials():
        assert trial.state == TrialState.COMPLETE, trial.user_attrs.get("error")
        limit = trial.user_attrs["allocator_limit_bytes"]
        assert limit is not None and limit <= total / 2
        assert trial.user_attrs["planned_bytes"] <= limit and trial.user_attrs["peak_reserved_bytes"] <= limit
        assert trial.user_attrs["ooms"] == 0
