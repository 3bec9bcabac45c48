"""A run can be repeated from its own folder: config.toml holds every value the run settled (the widths of
``net.size = small``, the CPU threads it ran with, the reward scale), and a run of that file gives the same figures;
``--print-config`` prints that config before the run."""

import io
import json
import tomllib

import torch
from rich.console import Console

from fitdqn.cli import main
from fitdqn.config import SMALL_NET, Config, load_run_config, with_overrides
from fitdqn.train.logs import read_jsonl
from fitdqn.train.run import train

TIMINGS = ("seconds", "env_steps_per_s", "updates_per_s")  # wall-clock: the only figures allowed to differ


def figures(run_dir) -> list[dict]:
    """metrics.jsonl less its timings, and the report's test and validation results."""
    records = [{k: v for k, v in r.items() if k not in TIMINGS and k != "time"} for r in read_jsonl(
        run_dir / "metrics.jsonl")]
    report = json.loads((run_dir / "report.json").read_text())
    return [*records, report["test"], report["validation"]]


def test_a_run_made_again_from_its_config_toml_gives_the_same_figures(small_config, tmp_path):
    config = small_config(**{"train.epochs": 1, "train.eval_every": 1})
    quiet = Console(file=io.StringIO())
    train(config, tmp_path / "run", console=quiet)
    written = load_run_config(tmp_path / "run" / "config.toml")
    assert written.train.threads == torch.get_num_threads() >= 1  # the count used, not 0 (auto)
    assert written.market.reward_scale > 0  # settled from the training split
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["threads"] == written.train.threads
    assert f"with {written.train.threads} CPU thread(s)" in (tmp_path / "run" / "report.md").read_text()
    train(with_overrides(written, {"train.out": str(tmp_path / "again")}), tmp_path / "again", console=quiet)
    assert figures(tmp_path / "again") == figures(tmp_path / "run")


def test_print_config_prints_the_widths_and_threads_the_run_uses(capsys):
    assert Config().net.size == "small"
    try:
        main(["train", "--device", "cpu", "--train.threads", "1", "--print-config"])
    except SystemExit as done:
        assert done.code == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert {k: printed["net"][k] for k in SMALL_NET} == SMALL_NET  # trunk_hidden 128, d_model 64, ...
    assert printed["train"]["threads"] == 1 and printed["collect"]["num_envs"] > 0  # no 0 = auto left
    assert printed["learn"]["precision"] != "auto" and printed["learn"]["lr_base_batch"] > 0
