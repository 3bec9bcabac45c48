"""`fitdqn tune`: hyperparameter trials with Optuna (:func:`fitdqn.tune.runner.run_tune`), its report
(:func:`fitdqn.tune.report.print_report`)."""

from __future__ import annotations

import argparse
import copy
import tomllib
from pathlib import Path
from typing import Any

from fitdqn.cli.args import add_config_arguments, config_from_args
from fitdqn.cli.common import Commands
from fitdqn.config import Config, ConfigError, config_from_dict, with_overrides
from fitdqn.errors import UserError

TUNE_ALIASES = ("market.data", "train.device", "train.seed", "train.epochs")
INSTALL_HINT = "pip install 'fitdqn[tune]' (or: pip install optuna)"
OPTIONS = {"trials": "tune.trials", "parallel": "tune.parallel", "dir": "tune.dir", "storage": "tune.storage"}


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    """Register `fitdqn tune` on the CLI's subcommands."""
    defaults = Config().tune
    tune = commands.add_parser(
        "tune", help="hyperparameter trials with Optuna (packed on the GPU by their own plans)",
        description="Search hyperparameters: each trial is a whole `fitdqn train` run of the base config with "
        "params drawn from the search space (a [search] table: config keys -> {low, high, log, step} or "
        "{choices}), in its own process and run directory (DIR/trials/NNNN with its plan.json). The objective, "
        "maximised, is the validation Sharpe (tune.objective) the run reports at its last validated epoch; the "
        "per-epoch values prune poor trials (median pruner). The study lives in DIR/study.db (or --storage URL); "
        "re-running the same command continues it without repeating finished trials; the best trial's config is "
        "written to DIR/best.toml for `fitdqn train --config`. Examples: `fitdqn tune --config tune.toml "
        "--trials 20`; `fitdqn tune --config base.toml --space search.toml --parallel 4`; `fitdqn tune --report "
        f"tune`. Needs Optuna: {INSTALL_HINT}.",
    )
    tune.add_argument("--space", metavar="FILE.toml", help="TOML file whose [search] table is the search space "
                      "(default: the [search] table of --config)")
    tune.add_argument("--trials", type=int, metavar="N", help="trials of the study in all; a re-run continues "
                      f"until N have finished (default: {defaults.trials})")
    tune.add_argument("--parallel", type=int, metavar="K", help="trials at once, each its own process: 0 = auto "
                      "(on a GPU as many as their own plans fit in the free memory, each capped at its share; on a "
                      f"CPU one at a time); K caps it, threads split K ways (default: {defaults.parallel})")
    tune.add_argument("--out", "--dir", dest="dir", metavar="DIR", help="tune directory, the folder this writes "
                      f"to (default: {defaults.dir}; --dir is its old name)")
    tune.add_argument("--storage", metavar="URL", help="Optuna storage URL of a shared study, e.g. "
                      "postgresql://user@host/db (default: sqlite file DIR/study.db)")
    tune.add_argument("--report", metavar="DIR", help="run no trial: print the trials of the study in DIR and write "
                      "DIR/history.png and DIR/importances.png")
    add_config_arguments(tune, TUNE_ALIASES)
    tune.set_defaults(run=run)
    return tune


def require_optuna() -> None:
    try:  # Optuna is optional (fitdqn[tune]): looked for only when the command runs
        import optuna  # noqa: F401
    except ImportError:
        raise UserError(f"fitdqn tune needs Optuna, which is not installed: {INSTALL_HINT}") from None


def read_toml(path: str, what: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{what} '{file}' not found")
    try:
        return tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{what} '{file}' is not valid TOML: {error}") from None


def config_and_search(args: argparse.Namespace) -> tuple[Config, Any]:
    """Defaults, then --config (less its [search] table), then the options; the [search] table of --space or
    of --config."""
    base, search = Config(), None
    if args.config:
        data = read_toml(args.config, "config file")
        search = data.pop("search", None)
        base = config_from_dict(data)
    rest = copy.copy(args)
    rest.config = None
    config = config_from_args(rest, base=base)
    given = {key: getattr(args, name) for name, key in OPTIONS.items() if getattr(args, name, None) is not None}
    if getattr(args, "report", None):
        given["tune.dir"] = args.report
    config = with_overrides(config, given) if given else config
    if args.space:
        data = read_toml(args.space, "search space file")
        if "search" not in data:
            raise ConfigError(f"'{args.space}' has no [search] table: add one, e.g. "
                              '[search] "learn.lr" = {low = 1e-5, high = 1e-3, log = true}')
        search = data["search"]
    return config, search


def run(args: argparse.Namespace) -> int:
    require_optuna()
    # Optuna (optional) and torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.tune.report import print_report
    from fitdqn.tune.runner import run_tune
    from fitdqn.tune.space import parse_search_space

    config, search = config_and_search(args)
    if args.report:
        print_report(Path(config.tune.dir), config.tune)
        return 0
    if search is None:
        raise ConfigError("no search space: add a [search] table to the --config file or give --space FILE.toml, "
                          'e.g. [search] "learn.lr" = {low = 1e-5, high = 1e-3, log = true}')
    space = parse_search_space(search, config)
    run_tune(config, space)
    print_report(Path(config.tune.dir), config.tune)
    return 0
