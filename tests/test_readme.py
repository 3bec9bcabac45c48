"""README's commands, code and option names, and the shipped examples, as a new user meets them: every command
parses, every option and config key README names exists, every examples/*.toml loads through the real config
loader, every example a help text cites exists, and the commands that run on a CPU run (with options appended
that make them tiny: one short epoch of small nets) in the order README gives them, Python blocks included."""

from __future__ import annotations

import contextlib
import re
import shlex
import tomllib
from pathlib import Path

import pandas as pd
import pytest
from support.small_run import SMALL_RUN

from fitdqn.cli import build_parser, main
from fitdqn.cli.args import config_from_args
from fitdqn.cli.tune import config_and_search
from fitdqn.config import load_config, section_types

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
# appended to a command that trains: one epoch of 16 envs x 16 steps of tiny nets, a short evaluation (the data
# the command names)
TINY = {**{key: value for key, value in SMALL_RUN.items() if key != "market.data"}, "train.epochs": 1,
        "train.eval_every": 1, "train.sample_reuse": 1.0, "evaluate.bootstrap_samples": 100}
TINY_ARGS = [token for key, value in TINY.items() for token in (f"--{key}", str(value))]
TUNE_TINY_ARGS = ["--trials", "1", "--parallel", "1", *TINY_ARGS]
FILE_SUFFIXES = {"log", "toml", "json", "jsonl", "csv", "parquet", "png", "md", "pt", "pt2", "db"}
PLACEHOLDERS = {"FILE": "bars.csv"}  # RUN_DIR: the quickstart's run; bars.csv: its last 400 bars


def fenced(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def fitdqn_argv(line: str) -> list[str] | None:
    """The arguments after ``fitdqn`` (``.venv/bin/fitdqn``, ``-m fitdqn``) in one shell command, else None."""
    tokens = shlex.split(line, comments=True)
    for index, token in enumerate(tokens):
        if token == "fitdqn" or token.endswith("/fitdqn"):
            return tokens[index + 1:]
    return None


def shell_commands() -> list[str]:
    """README's shell lines (fenced ``bash`` blocks), each ``&&`` chain split into its commands."""
    return [part.strip() for block in fenced("bash") for line in block.splitlines() if line.strip()
            for part in line.split("&&")]


def table_commands() -> list[str]:
    """The first column of README's command table."""
    return re.findall(r"^\| `(fitdqn [^`]*)` \|", README, re.MULTILINE)


def example_commands() -> list[str]:
    """The command each examples/*.toml names in its header comment."""
    return [line.lstrip("# ").strip() for path in EXAMPLES for line in path.read_text().splitlines()
            if line.startswith("# fitdqn ")]


def readme_commands() -> tuple[list[list[str]], list[list[str]]]:
    """Every fitdqn command of README and the examples, in order, once each; and those started by torchrun (each
    rank runs `fitdqn train`: parsed here, not run)."""
    commands: list[list[str]] = []
    launched: list[list[str]] = []
    for line in shell_commands() + table_commands() + example_commands():
        argv = fitdqn_argv(line)
        if argv and argv not in commands:
            commands.append(argv)
            if not line.startswith("fitdqn") and "/fitdqn " not in line:
                launched.append(argv)
    return commands, launched


COMMANDS, LAUNCHED = readme_commands()


def code_spans() -> list[str]:
    prose = re.sub(r"```.*?```", "", README, flags=re.DOTALL)
    return re.findall(r"`([^`\n]+)`", prose)


def test_readme_names_its_commands():
    """What the other tests read is there: a change to README's layout must not leave them checking nothing."""
    assert ["train"] in COMMANDS and len(table_commands()) >= 7 and len(fenced("python")) >= 2
    assert any(argv[:1] == ["tune"] for argv in COMMANDS) and EXAMPLES and LAUNCHED


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_readme_command_parses(argv):
    """Every command README and the examples show: its options exist and its values pass the config's checks
    (a renamed key fails here); placeholders stand for a path."""
    argv = [token for token in argv if token != "..."]
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    assert unknown == [], f"README's `fitdqn {' '.join(argv)}`: unknown {unknown}"
    if not hasattr(args, "print_config") or (args.config or "").startswith("tune/"):  # no config, or one made by
        return  # an earlier command (test_readme_commands_run runs that)
    with contextlib.chdir(ROOT):  # examples/... as README's reader types it, from the clone
        config_and_search(args) if argv[0] == "tune" else config_from_args(args)


def test_every_option_and_key_readme_names_exists():
    """Every ``--option`` README spells in code is an option of some command, every ``section.key`` a config key."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    options = {flag for command in commands.values() for action in command._actions for flag in action.option_strings}
    keys = {f"{name}.{field}" for name, section in section_types().items() for field in section.__dataclass_fields__}
    sections = "|".join(section_types())
    spans = code_spans()
    flags = {span.split()[0].split("=")[0] for span in spans if span.startswith("--")}
    assert flags and flags <= options, sorted(flags - options)
    named = {m.group(0) for span in spans for m in re.finditer(rf"(?<![\w.])(?:{sections})\.\w+", span)
             if m.group(0).rsplit(".", 1)[1] not in FILE_SUFFIXES}  # train.log is a file
    assert named and named <= keys, sorted(named - keys)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads(path):
    """Through the loader `fitdqn train --config` and `fitdqn tune --config` use; a [search] table is a search
    space the tune command accepts."""
    data = tomllib.loads(path.read_text())
    search = data.pop("search", None)
    if search is None:
        load_config(path)
        return
    pytest.importorskip("optuna")
    from fitdqn.tune.space import parse_search_space

    args = build_parser(["tune"]).parse_args(["tune", "--config", str(path)])
    config, search = config_and_search(args)
    assert parse_search_space(search, config)


def test_every_example_a_help_or_readme_cites_exists():
    cited = set(re.findall(r"examples/[\w.-]+\.toml", README))
    for source in (ROOT / "src" / "fitdqn").rglob("*.py"):
        cited |= set(re.findall(r"examples/[\w.-]+\.toml", source.read_text()))
    assert cited and all((ROOT / path).is_file() for path in cited), sorted(cited)


def runs_on_a_cpu(argv: list[str]) -> bool:
    """Commands run here: not those that need GPUs (--gpus, torchrun), that measure a GPU (profile), a study of
    many runs (--seeds/--folds), a database (--storage URL: a queue and its workers), or `tune` without a search
    space (it says so and exits)."""
    needs_more = {"--gpus", "--seeds", "--folds", "...", "URL", "--storage"}
    return not needs_more & set(argv) and argv[:1] != ["profile"] and argv != ["tune"] and argv not in LAUNCHED


def test_readme_commands_run(tmp_path, capsys):
    """README's commands, tiny, in README's order (the quickstart first: the table's RUN_DIR is its run), then
    its Python blocks (the Gymnasium env, the exported program), then the examples' own commands."""
    pytest.importorskip("optuna")  # README's tune commands
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bars = pd.read_csv(ROOT / "src" / "fitdqn" / "market" / "datasets" / "sp500.csv.gz")
    bars.tail(400).to_csv(tmp_path / PLACEHOLDERS["FILE"], index=False)  # a user's file of new bars
    ran: list[list[str]] = []

    def run(argv: list[str]) -> str:
        tiny = TUNE_TINY_ARGS if argv[:1] == ["tune"] and "--report" not in argv else \
            TINY_ARGS if argv[:1] == ["train"] else []
        with contextlib.chdir(tmp_path):
            code = main(argv + tiny)
        out = capsys.readouterr()
        assert code == 0, f"`fitdqn {' '.join(argv)}` exited {code}: {out.err[-2000:]}"
        ran.append(argv)
        return out.out

    run(["train"])  # the quickstart
    (run_dir,) = (tmp_path / "runs").iterdir()
    for argv in COMMANDS:
        argv = [str(run_dir) if t == "RUN_DIR" else PLACEHOLDERS.get(t, t) for t in argv]
        if runs_on_a_cpu(argv) and argv not in ran:
            run(argv)
            if argv[:1] == ["export"]:  # the Python blocks: the env, and the program just exported
                for block in fenced("python"):
                    with contextlib.chdir(tmp_path):
                        exec(compile(block, "README.md", "exec"), {})
    assert {"train", "plan", "gpu-profiles", "evaluate", "act", "export", "tune"} <= {argv[0] for argv in ran}
    assert ["tune", "--report", "tune/synthetic"] in ran


def test_readme_test_command_installs_what_it_runs():
    """The test command (not run here: it is this suite) installs the extra that holds ruff and pytest."""
    (line,) = [line for line in shell_commands() if "pytest" in line]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = " ".join(command for command in shell_commands() if "pip install" in command and "[test]" in command)
    assert "-e '.[test]'" in installs and {"pytest", "ruff"} <= {re.split(r"[<>=]", d)[0] for d in extras["test"]}
    assert line.endswith(".venv/bin/pytest")
