"""What the command modules share: how a subcommand is registered and described, which config options its short
``--help`` shows, and how its config is built from the parsed options."""

from __future__ import annotations

import argparse
import contextlib
import textwrap
from pathlib import Path

from fitdqn.cli.args import config_from_args
from fitdqn.config import Config
from fitdqn.files import NETWORKS

HELP_WIDTH = 100
# config options every command's --help shows (the rest: --help-all)
COMMON_KNOBS = ("budget.batch_size", "market.data", "market.contract", "train.device", "train.seed", "train.threads")
TRAIN_KNOBS = ("train.epochs", "train.minutes", "train.out", "train.sample_reuse", "collect.num_envs", "learn.lr",
               "learn.risk", "train.gpus")

Commands = argparse._SubParsersAction  # what `add_subparsers` returns: each command module registers on it


def set_threads(threads: int) -> None:
    """Torch's CPU threads (:func:`fitdqn.device.threads.set_torch_threads`; 0: auto)."""
    from fitdqn.device.threads import set_torch_threads  # imports torch: only once a command runs (fast --help)

    set_torch_threads(threads)


def config_for(args: argparse.Namespace, base: Config | None = None) -> Config:
    """The command's config (:func:`config_from_args`; ``--print-config`` exits there), with torch's CPU threads
    set for it (``train.threads``)."""
    config = config_from_args(args, base=base)
    set_threads(config.train.threads)
    return config


def describe(examples: tuple[str, ...], *paragraphs: str) -> str:
    """A subcommand's description: its examples first, then its prose (wrapped; kept as written by the formatter)."""
    lines = ["examples:", *(f"  {example}" for example in examples), ""]
    for paragraph in paragraphs:
        lines += [*textwrap.wrap(paragraph, width=HELP_WIDTH), ""]
    return "\n".join(lines).rstrip()


def add_command(commands: Commands, name: str, summary: str, examples: tuple[str, ...], *paragraphs: str,
                aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=summary, aliases=list(aliases), description=describe(examples, *paragraphs),
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def add_network_option(parser: argparse.ArgumentParser) -> None:
    """``--network best|last``: which of a run's networks a command loads (:data:`fitdqn.files.NETWORKS`)."""
    parser.add_argument("--network", choices=NETWORKS, default="best",
                        help="best: the network with the best validation Sharpe (best.pt, the one the run's report "
                        "is about); last: the latest checkpoint's (default: %(default)s)")


def writing_into(run_dir: str | Path, out: str | Path) -> contextlib.AbstractContextManager:
    """The run directory's lock (:func:`fitdqn.run_lock.run_lock`) when ``out`` is inside ``run_dir`` (a command
    writing into a run); nothing to hold when it writes elsewhere. A missing ``run_dir`` is left to the
    command's own message."""
    from fitdqn.run_lock import run_lock

    run_dir, out = Path(run_dir), Path(out)
    inside = out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents
    return run_lock(run_dir, create=False) if inside else contextlib.nullcontext()
