"""Config fields as command-line options: every field of :class:`fitdqn.config.Config` becomes
``--section.key`` with its help text; a few common ones get short aliases (``--batch-size``)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from fitdqn.config import Config, field_types, load_config, section_types, with_overrides

DEST_PREFIX = "cfg:"
ALIASES: dict[str, str] = {
    "budget.batch_size": "--batch-size",
    "market.data": "--data",
    "train.device": "--device",
    "train.epochs": "--epochs",
    "train.minutes": "--minutes",
    "train.seed": "--seed",
    "train.out": "--out",
    "evaluate.seeds": "--seeds",
    "evaluate.folds": "--folds",
}


def metavar_for(annotation: Any) -> str:
    if typing.get_origin(annotation) is tuple:
        return "A,B,..."
    return {int: "INT", float: "FLOAT", str: "TEXT", bool: "BOOL"}.get(annotation, "VALUE")


def add_config_arguments(parser: argparse.ArgumentParser, aliases: tuple[str, ...] = ()) -> None:
    """``--config FILE`` plus one option per config field (grouped by section)."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML config file (CLI options override it)")
    defaults = Config()
    for section_name, section_type in section_types().items():
        group = parser.add_argument_group(
            f"[{section_name}] {section_type.__doc__.splitlines()[0] if section_type.__doc__ else ''}"
        )
        section_default = getattr(defaults, section_name)
        help_of = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(section_type)}
        for key, annotation in field_types(section_type).items():
            dotted = f"{section_name}.{key}"
            flags = [f"--{dotted}"]
            if dotted in aliases and dotted in ALIASES:
                flags.insert(0, ALIASES[dotted])
            default = getattr(section_default, key)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            group.add_argument(
                *flags, dest=DEST_PREFIX + dotted, default=argparse.SUPPRESS, metavar=metavar_for(annotation),
                help=f"{help_of[key]} (default: {shown})".replace("%", "%%"),
            )


def config_from_args(args: argparse.Namespace, base: Config | None = None) -> Config:
    """``base`` (defaults), then ``--config FILE``, then the options given on the command line."""
    config = base or Config()
    if getattr(args, "config", None):
        config = load_config(args.config, base=config)
    overrides = {
        dest[len(DEST_PREFIX):]: value for dest, value in vars(args).items() if dest.startswith(DEST_PREFIX)
    }
    return with_overrides(config, overrides) if overrides else config
