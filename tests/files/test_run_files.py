"""Every run file fitdqn reads back is checked on read: damaged, binary or edited, it is one clear line naming the
file and what to do (through the commands, as a user meets it)."""

import json
import re

import pytest

from fitdqn.cli.app import EXIT_USER_ERROR, main
from fitdqn.config import Config, dump_config
from fitdqn.evaluate.walk_forward import run_fold
from fitdqn.files import RunFileError
from fitdqn.train.logs import read_jsonl

GOOD_FOLD = {"index": 0, "train": [0, 100], "validation": [110, 150], "test": [160, 200]}


@pytest.mark.parametrize("text, cause", [
    ('{"index": 0, "train": [0, 1', "not JSON at line 1"),
    (json.dumps({**GOOD_FOLD, "test": None}), "NoneType"),
    (json.dumps({k: v for k, v in GOOD_FOLD.items() if k != "validation"}), "no 'validation'"),
    ("[1, 2]", "list indices"),
])
def test_a_damaged_fold_file_is_named_with_the_fix(tmp_path, text, cause):
    (tmp_path / "fold.json").write_text(text)
    with pytest.raises(RunFileError) as error:
        run_fold(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "fold.json") in message and cause in message and "run the study's command again" in message
    (tmp_path / "fold.json").write_text(json.dumps(GOOD_FOLD))
    assert run_fold(tmp_path).test.stop == 200


def run_dir_with(tmp_path, **files):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(dump_config(Config()))
    (run_dir / "checkpoint.pt").write_bytes(b"")
    for name, content in files.items():
        path = run_dir / name.replace("_", ".")
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return run_dir


def test_resume_with_a_damaged_fold_file_is_one_line(tmp_path, capsys):
    run_dir = run_dir_with(tmp_path, fold_json='{"index": 0}')
    assert main(["train", "--resume", str(run_dir)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "fold.json' is damaged or was edited (no 'train')" in err and "Traceback" not in err


def test_a_binary_config_is_named(tmp_path, capsys):
    run_dir = run_dir_with(tmp_path, config_toml=b"\x00\xff\xfe binary")
    assert main(["train", "--resume", str(run_dir)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "config.toml' is not text (byte 1 is 0xff)" in err and "restore the file" in err


def test_an_edited_config_names_the_key_and_the_file(tmp_path, capsys):
    run_dir = run_dir_with(tmp_path)
    (run_dir / "config.toml").write_text(re.sub(r"^lr = .*$", 'lr = "fast"', dump_config(Config()), flags=re.M))
    assert main(["train", "--resume", str(run_dir)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "config.toml': config key 'learn.lr'" in err and "the config a run wrote and reads back" in err


def test_evaluate_of_a_study_with_a_damaged_study_file(tmp_path, capsys):
    run_dir = run_dir_with(tmp_path, study_json='[{"seed": 0}]')
    assert main(["evaluate", str(run_dir), "--device", "cpu"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "study.json' is damaged or was edited (no 'dir')" in err and "written anew" in err


def test_a_binary_metrics_log_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\x00')
    with pytest.raises(RunFileError, match=r"metrics.jsonl' is not text \(byte 12 is 0xff\).*delete it"):
        read_jsonl(tmp_path / "metrics.jsonl")
