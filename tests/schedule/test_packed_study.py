"""A study's members run as packed processes from the queue equal the same runs trained alone, one after another
in this process (on the CPU: the same figures), and the study continues where it was."""

import io
import json

from rich.console import Console
from support.queue_runs import TINY_RUN

from fitdqn.config import Config, with_overrides
from fitdqn.schedule.study import run_packed_study

STUDY = {**TINY_RUN, "evaluate.seeds": 1, "evaluate.folds": 2}


def member_figures(study_dir):
    figures = {}
    for m in json.loads((study_dir / "study.json").read_text()):
        report = json.loads((study_dir / m["dir"] / "report.json").read_text())
        losses = [r.get("loss") for r in map(json.loads, (study_dir / m["dir"] / "metrics.jsonl").read_text()
                                                              .splitlines()) if "loss" in r]
        figures[m["dir"]] = (report["selection"], report["test"]["agent"], losses)
    return figures


def test_packed_members_equal_the_same_runs_alone(tmp_path):
    console = Console(file=io.StringIO(), width=160)
    alone = with_overrides(Config(), {**STUDY, "train.parallel": 1, "train.out": str(tmp_path / "alone")})
    run_packed_study(alone, tmp_path / "alone", console)
    packed = with_overrides(Config(), {**STUDY, "train.parallel": 2, "train.out": str(tmp_path / "packed")})
    run_packed_study(packed, tmp_path / "packed", console)
    printed = console.file.getvalue()
    assert "2 run(s) at once" in printed and "seed_0/fold_1 started" in printed
    for name in ("seed_0/fold_0", "seed_0/fold_1"):  # each packed member ran in its own process
        assert (tmp_path / "packed" / name / "member.json").is_file()
        assert not (tmp_path / "alone" / name / "member.json").exists()
    assert member_figures(tmp_path / "packed") == member_figures(tmp_path / "alone")
    report = json.loads((tmp_path / "packed" / "report.json").read_text())
    assert report["pooled"] == json.loads((tmp_path / "alone" / "report.json").read_text())["pooled"]
    before = console.file.tell()
    run_packed_study(packed, tmp_path / "packed", console)  # the same study again: every member read back
    again = console.file.getvalue()[before:]
    assert again.count("finished, read back") == 2 and "started" not in again
