"""Every size and value a user types is bounded: absurd ones are one clear error before any work."""

import os

import pytest

from fitdqn.cli.app import EXIT_USER_ERROR, main
from fitdqn.errors import UserError


@pytest.mark.parametrize("args, says", [
    (["plan", "--total-memory", "99999999999999999999999TiB"], "--total-memory 99999999999999999999999TiB: more "
     "memory than any device has"),
    (["plan", "--total-memory", "0GiB"], "--total-memory 0GiB: no memory"),
    (["plan", "--free-memory", "2000TiB"], "--free-memory 2000TiB: more memory than any device has"),
    (["plan", "--net.trunk_hidden", "100000000"], "net.trunk_hidden must be in [1, 65536]"),
    (["plan", "--market.synthetic_bars", "100000000000"], "market.synthetic_bars must be in [2, 1e+08]"),
    (["plan", "--net.num_atoms", "99999999999"], "net.num_atoms must be in [2, 65536]"),
    (["plan", "--replay.tree_fanout", "99999999999"], "replay.tree_fanout must be in [2, 65536]"),
    (["act", "RUN", "--data", "synthetic", "--goal-unit", "nan"], "--goal-unit nan: the goal scale"),
    (["act", "RUN", "--data", "synthetic", "--goal-unit", "-1"], "--goal-unit -1: the goal scale"),
    (["act", "RUN", "--data", "synthetic", "--goal-unit", "inf"], "--goal-unit inf: the goal scale"),
    (["bench", "--seconds", "nan"], "--seconds a positive finite number"),
    (["train", "--device", "cpu", "--gpus", str((os.cpu_count() or 1) + 1)], "gloo processes on"),
])
def test_absurd_values_are_refused_by_name(args, says, capsys):
    assert main([*args, "--train.device", "cpu"] if args[0] == "plan" else args) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_damaged_study_database_says_the_fix_not_sql(tmp_path):
    from fitdqn.tune.study import open_storage

    path = tmp_path / "study.db"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(UserError) as error:
        open_storage(f"sqlite:///{path}")
    message = str(error.value)
    assert f"the study file '{path}' is damaged (file is not a database)" in message and "--dir NEW_DIR" in message
    assert "[SQL" not in message and "sqlalche.me" not in message
