"""`fitdqn evaluate` through the CLI: the result is printed before any file is written, so a full disk or a
read-only folder loses nothing the user can read (a run and a study alike)."""

import errno
import io

import pytest
from rich.console import Console
from support.small_run import SMALL_RUN

import fitdqn.train.run as run_module
import fitdqn.train.study as study_module
from fitdqn.cli import main
from fitdqn.config import Config, with_overrides
from fitdqn.train.study import run_study

# two seeds of one epoch (validated at its end, so each member has its best.pt)
STUDY = {**SMALL_RUN, "train.epochs": 1, "train.eval_every": 1, "evaluate.seeds": 2,
         "evaluate.bootstrap_samples": 200}


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("evaluate") / "study"
    run_study(with_overrides(Config(), STUDY), path, console=Console(file=io.StringIO()))
    return path


def full_disk_for(full, monkeypatch):
    """``atomic_write_text`` of the run and study modules fails with ENOSPC on the paths where ``full(path)``."""
    for module in (run_module, study_module):
        real = module.atomic_write_text

        def failing(path, text, real=real):
            if full(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, text)

        monkeypatch.setattr(module, "atomic_write_text", failing)


def test_evaluate_prints_the_run_result_before_a_failed_write(study_dir, capsys, monkeypatch):
    member = study_dir / "seed_0"
    full_disk_for(lambda path: path.name.startswith("evaluate_"), monkeypatch)
    assert main(["evaluate", str(member), "--device", "cpu", "--split", "validation"]) == 1
    out, err = capsys.readouterr()
    assert "validation split of synthetic" in out and "Sharpe" in out  # the verdict and the metrics table
    assert err.startswith("fitdqn evaluate: error: file error at") and "evaluate_validation" in err
    assert "Traceback" not in err and not (member / "evaluate_validation.json").exists()


def test_evaluate_prints_the_study_result_before_a_failed_write(study_dir, capsys, monkeypatch):
    study_file = study_dir / "evaluate_test.json"
    full_disk_for(lambda path: path == study_file, monkeypatch)
    assert main(["evaluate", str(study_dir), "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert "Across 2 seeds" in out  # the joint verdict was printed
    assert f"'{study_file}'" in err and "Traceback" not in err and not study_file.exists()
    assert all((study_dir / f"seed_{s}" / "evaluate_test_pnl.csv").is_file() for s in (0, 1))  # members kept
