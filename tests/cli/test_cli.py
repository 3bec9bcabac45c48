import json
import re
import subprocess
import sys
import tomllib

import pytest
import torch

from fitdqn import __version__
from fitdqn.cli import build_parser, main
from fitdqn.cli.args import config_from_args
from fitdqn.config import Config, config_from_dict, field_types, load_config, section_types
from fitdqn.device.threads import cpu_threads, omp_num_threads, usable_cpus
from fitdqn.errors import UserError


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


def test_help_all_shows_every_config_field():
    out = subprocess.run([sys.executable, "-m", "fitdqn", "plan", "--help-all"], capture_output=True, text=True,
                         check=True).stdout
    assert "--budget.replay_buffer_vram_fraction" in out and "--batch-size" in out
    assert "share of probed free memory" in out
    for section, section_type in section_types().items():
        for key in field_types(section_type):
            assert f"--{section}.{key}" in out, key
    assert "--no-replay.prioritized" in out  # booleans say how to turn them off


def subcommand(name: str):
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return commands.choices[name]


def parsed_config(*argv: str) -> Config:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fitdqn {__version__} (torch {torch.__version__})"


def test_version_and_gpu_profiles_do_not_import_torch():
    """`fitdqn --version` reads torch's version from its installed metadata and `fitdqn gpu-profiles` reads TOML
    files: neither imports torch (seconds on a loaded machine)."""
    script = ("import sys\nfrom fitdqn.cli import main\n"
              "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
              "assert main(['gpu-profiles']) == 0\n"
              "print(sorted(m for m in sys.modules if m == 'torch'), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stderr.strip() == "[]" and "torch" in done.stdout and "GPU profiles" in done.stdout


def test_print_config_prints_the_resolved_toml_and_exits(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("[learn]\nlr = 0.003\nn_step = 2\n[market]\ndata = 'synthetic'\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(path), "--learn.n_step", "5", "--epochs", "7", "--print-config",
              "--out", str(tmp_path / "never")])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    config = config_from_dict(tomllib.loads(printed))
    assert (config.learn.lr, config.learn.n_step, config.train.epochs, config.market.data) == (0.003, 5, 7,
                                                                                               "synthetic")
    assert config.replay == Config().replay  # the rest: defaults
    assert not (tmp_path / "never").exists()  # nothing ran


def test_print_config_of_a_resume_shows_the_runs_config(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[train]\nepochs = 3\nseed = 9\n")
    with pytest.raises(SystemExit):
        main(["train", "--resume", str(run), "--epochs", "6", "--print-config"])
    config = load_config_text(capsys.readouterr().out, tmp_path)
    assert (config.train.epochs, config.train.seed) == (6, 9)


def load_config_text(text: str, tmp_path) -> Config:
    path = tmp_path / "printed.toml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("argv, her", [
    ((), False), (("--replay.her",), True), (("--no-replay.her",), False), (("--replay.her", "false"), False),
    (("--replay.her", "no"), False), (("--no-replay.her", "--replay.her", "true"), True),
])
def test_boolean_flags(argv, her):
    assert parsed_config("train", *argv).replay.her is her


def test_boolean_flag_with_underscores_and_hyphens():
    assert parsed_config("plan", "--no-train.cuda_graphs").train.cuda_graphs is False
    assert parsed_config("plan", "--no-train.cuda-graphs").train.cuda_graphs is False
    assert parsed_config("plan", "--train.cuda-graphs", "false").train.cuda_graphs is False


def test_bad_boolean_is_a_clear_error(capsys):
    assert main(["plan", "--replay.her", "maybe", "--gpu", "h100"]) == 2
    assert "'replay.her': expected bool" in capsys.readouterr().err


def test_a_mistyped_option_names_the_one_meant(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--learn.gammma", "0.5", "--gpu", "h100"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fitdqn plan: error: unrecognized arguments: --learn.gammma 0.5" in err
    assert "did you mean --learn.gamma?" in err
    with pytest.raises(SystemExit):
        main(["plan", "--batchsize=0"])
    assert "--batchsize: did you mean --batch-size?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--zzzzzz"])
    err = capsys.readouterr().err
    assert "did you mean" not in err and "`fitdqn plan --help-all` lists every option" in err


def test_hyphenated_option_names():
    config = parsed_config("train", "--learn.n-step", "4", "--budget.replay-buffer-vram-fraction", "0.5",
                           "--train.sample-reuse", "2")
    assert (config.learn.n_step, config.budget.replay_buffer_vram_fraction, config.train.sample_reuse) == (4, 0.5, 2.0)
    assert parsed_config("train", "--learn.n_step", "4").learn.n_step == 4


def test_free_memory_without_a_unit_is_refused(capsys):
    assert main(["plan", "--gpu", "rtx3050", "--free-memory", "1.7"]) == 2
    err = capsys.readouterr().err
    assert "give a unit (GiB, MB, ...)" in err and "1.7GiB" in err and "Traceback" not in err


def test_gpu_profiles_and_its_old_name(capsys):
    assert main(["gpu-profiles"]) == 0
    listed = capsys.readouterr().out
    assert main(["profiles"]) == 0
    assert capsys.readouterr().out == listed
    top = build_parser().format_help()
    assert "gpu-profiles (profiles)" in top
    assert "fitdqn profile" in subcommand("gpu-profiles").format_help()  # says which command measures
    assert "fitdqn gpu-profiles" in subcommand("profile").format_help()  # says which command lists


@pytest.mark.parametrize("name", ["plan", "train", "profile", "bench"])
def test_short_help_groups_the_common_options_first(name):
    short = subcommand(name).format_help()
    lines = short.splitlines()
    assert lines[2] == "examples:" and lines[3].startswith(f"  fitdqn {name}")  # examples at the top
    assert "--batch-size" in short and "--data" in short and "--print-config" in short and "--help-all" in short
    assert "--net.trunk_hidden" not in short and "--replay.her_k" not in short  # only with --help-all
    for section in section_types():
        assert f"[{section}]" in short  # every section is named, with how many options it has
    assert len(lines) < 110


def test_help_all_lists_more_than_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    full = capsys.readouterr().out
    assert "--net.trunk_hidden" in full and "--replay.her_k" in full and "--resume" in full
    assert full.count("\n") > subcommand("train").format_help().count("\n") + 100


def test_cpu_threads_rules(tmp_path):
    assert cpu_threads(3, environ={"OMP_NUM_THREADS": "5"}) == 3  # train.threads wins
    assert cpu_threads(0, environ={"OMP_NUM_THREADS": "5"}) == 5  # then OMP_NUM_THREADS
    assert cpu_threads(0, environ={}, root=tmp_path, load=0.0) == usable_cpus(tmp_path)  # then the idle cores
    cores = __import__("os").cpu_count()
    assert cpu_threads(0, environ={}, root=tmp_path, load=cores + 3.0) == 1  # a busy machine: one thread
    assert cpu_threads(0, environ={}, root=tmp_path, load=cores - 1.0) == 1  # one core idle: one thread
    assert omp_num_threads({"OMP_NUM_THREADS": "4,2"}) == 4 and omp_num_threads({}) is None
    with pytest.raises(UserError, match="OMP_NUM_THREADS"):
        omp_num_threads({"OMP_NUM_THREADS": "lots"})


@pytest.mark.parametrize("cpu_max, cap", [("150000 100000", 2), ("50000 100000", 1), ("max 100000", None)])
def test_usable_cpus_respects_a_cgroup_quota(tmp_path, cpu_max, cap):
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    affinity = len(__import__("os").sched_getaffinity(0))
    assert usable_cpus(tmp_path) == (min(affinity, cap) if cap else affinity)


def test_cli_sets_torch_threads_once_at_start(capsys):
    before = torch.get_num_threads()
    try:
        assert main(["plan", "--gpu", "h100", "--train.threads", "2"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def test_too_little_memory_says_how_much_is_needed(capsys):
    assert main(["plan", "--gpu", "rtx3050", "--free-memory", "20MiB"]) == 2
    err = capsys.readouterr().err
    found = re.search(r"too little for this config: it needs about .* free \(at that, `fitdqn plan --free-memory "
                      r"(\d+)MiB` shows its plan\)", err)
    assert found and "replay" in err, err
    needed = int(found.group(1))
    assert main(["plan", "--gpu", "rtx3050", "--free-memory", f"{needed}MiB", "--json"]) == 0  # enough
    capsys.readouterr()
    assert main(["plan", "--gpu", "rtx3050", "--free-memory", f"{needed - 2}MiB"]) == 2  # and no more than needed
    # the same figure, to the MiB: the step is traced at the replay's capacity for each free memory (a few bytes
    # of the sum tree's descent move with it)
    again = re.search(r"--free-memory (\d+)MiB", capsys.readouterr().err)
    assert again and abs(int(again.group(1)) - needed) <= 1, again


def test_help_does_not_import_torch():
    """`fitdqn --help` and a command's --help stay fast: torch and the library load only when a command runs."""
    script = ("import sys\nfrom fitdqn.cli import main\n"
              "for argv in (['--help'], ['train', '--help'], ['plan', '--help-all'], ['tune', '--help']):\n"
              "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('fitdqn.train', 'fitdqn.plan'))),"
              " file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stderr.strip() == "[]" and "usage: fitdqn" in done.stdout


def test_only_the_cli_parses_arguments():
    """Library functions take typed arguments: no module of fitdqn outside fitdqn.cli imports argparse."""
    import pathlib

    import fitdqn

    root = pathlib.Path(fitdqn.__file__).parent
    leaks = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p.relative_to(root).parts[0] != "cli" and re.search(r"^\s*(import|from) argparse", p.read_text(),
                                                                     re.MULTILINE)]
    assert leaks == []


def test_the_console_script_is_the_cli_main():
    import importlib
    import pathlib

    import fitdqn.cli

    pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    module, _, name = pyproject["project"]["scripts"]["fitdqn"].partition(":")
    assert getattr(importlib.import_module(module), name) is fitdqn.cli.main is main


def test_a_command_named_on_the_line_builds_its_parser_alone():
    """`fitdqn plan ...` builds only plan's parser (building every command's costs a tenth of a second) and
    parses the same options as the whole parser; no command named: every command is there."""
    alone = build_parser(["plan", "--gpu", "h100"])
    commands = next(a for a in alone._actions if a.dest == "command")
    assert sorted(commands.choices) == ["plan"]
    argv = ["plan", "--gpu", "h100", "--batch-size", "512", "--learn.n-step", "5"]
    assert vars(alone.parse_args(argv)).keys() == vars(build_parser().parse_args(argv)).keys()
    assert config_from_args(alone.parse_args(argv)) == config_from_args(build_parser().parse_args(argv))
    assert sorted(next(a for a in build_parser(["profiles"])._actions if a.dest == "command").choices) == [
        "gpu-profiles", "profiles"]
    assert len(next(a for a in build_parser(["--version"])._actions if a.dest == "command").choices) > 9
