import json
import subprocess
import sys

import pytest

from fitdqn.cli import main


def plan_json(capsys, *args):
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "gpu, batch",
    [("h100", 8192), ("NVIDIA A100-SXM4-80GB", 2048), ("NVIDIA GeForce RTX 3050 Laptop GPU", 64),
     ("Some Unknown GPU", 256)],
)
def test_plan_batch_from_profile(capsys, gpu, batch):
    plan = plan_json(capsys, "--gpu", gpu)
    assert plan["batch_size"] == batch
    assert plan["batch_source"] == "profile"
    assert plan["device"]["name"] == gpu
    assert {"name", "total_bytes", "free_bytes"} <= set(plan["device"])


def test_plan_what_if_sizes(capsys):
    plan = plan_json(capsys, "--gpu", "rtx3050", "--free-memory", "1.7GiB")
    assert plan["device"]["free_bytes"] == int(1.7 * 2**30)
    assert plan["device"]["total_bytes"] == 4 * 2**30


def test_user_batch_source(capsys):
    assert plan_json(capsys, "--gpu", "h100", "--batch-size", "512")["batch_source"] == "user"


def test_plan_bad_size_is_an_error_not_a_traceback(capsys):
    assert main(["plan", "--gpu", "x", "--free-memory", "1.7Gx"]) == 2
    err = capsys.readouterr().err
    assert "cannot read the size" in err and "Traceback" not in err


def test_unknown_config_key_in_file(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("[budget]\nbatchsize = 3\n")
    assert main(["plan", "--config", str(path)]) == 2
    assert "'budget.batchsize'" in capsys.readouterr().err


def test_plan_table_and_profiles_list(capsys):
    assert main(["plan", "--gpu", "h100"]) == 0
    assert "8192" in capsys.readouterr().out
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("rtx3050", "a100", "h100", "default"))


def test_help_shows_every_config_field():
    out = subprocess.run([sys.executable, "-m", "fitdqn", "plan", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--budget.replay_buffer_vram_fraction" in out and "--batch-size" in out
    assert "share of probed free memory" in out
