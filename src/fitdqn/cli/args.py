"""Config fields as command-line options: every field of :class:`fitdqn.config.Config` becomes
``--section.key`` with its help text; a few common ones get short aliases (``--batch-size``).

Habits: ``--learn.n-step 3`` is ``--learn.n_step 3``; a boolean is ``--replay.her`` / ``--no-replay.her`` or
``--replay.her false``; ``--print-config`` prints the resolved config as TOML and exits. ``--help`` lists the
command's own options and its common config options, then the config sections; ``--help-all`` every option.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import typing
from typing import Any

from fitdqn.config import Config, dump_config, field_types, load_config, section_types, with_overrides

DEST_PREFIX = "cfg:"
ALIASES: dict[str, str] = {
    "budget.batch_size": "--batch-size",
    "market.data": "--data",
    "train.device": "--device",
    "train.epochs": "--epochs",
    "train.minutes": "--minutes",
    "train.seed": "--seed",
    "train.out": "--out",
    "train.gpus": "--gpus",
    "evaluate.seeds": "--seeds",
    "evaluate.folds": "--folds",
    "train.parallel": "--parallel",
    "train.storage": "--storage",
}
FULL_HELP = "_fitdqn_full_help"  # attribute of an action whose help shows only under --help-all


def metavar_for(annotation: Any) -> str:
    if typing.get_origin(annotation) is tuple:
        return "A,B,..."
    return {int: "INT", float: "FLOAT", str: "TEXT", bool: "BOOL"}.get(annotation, "VALUE")


class HelpAll(argparse.Action):
    """``--help-all``: the help with every config option, then exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if hasattr(action, FULL_HELP):
                action.help = getattr(action, FULL_HELP)
        parser.epilog = None
        parser.print_help()
        parser.exit()


class PrintConfig(argparse.Action):
    """``--print-config``: noted here, acted on by :func:`config_from_args` once the config is resolved."""

    def __init__(self, option_strings, dest, default=False, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


def hyphenated(flag: str) -> str | None:
    """``--learn.n_step`` -> ``--learn.n-step`` (None when there is no underscore)."""
    return flag.replace("_", "-") if "_" in flag else None


def add_config_arguments(parser: argparse.ArgumentParser, common: tuple[str, ...] = ()) -> None:
    """``--config FILE``, ``--print-config``, ``--help-all`` and one option per config field, grouped by section.

    ``common`` (dotted names) are shown by ``--help`` (with their short alias from :data:`ALIASES`, if any);
    the other fields only by ``--help-all``. Every field is accepted either way."""
    prog = parser.prog
    if not any(action.option_strings == [] for action in parser._actions):
        parser.usage = "%(prog)s [options]"  # one usage line, not the hundred options (they are listed below)
    group = parser.add_argument_group("config files")
    group.add_argument("--config", metavar="FILE.toml", help="TOML config file (options given here override it)")
    group.add_argument("--print-config", action=PrintConfig, dest="print_config",
                       help="print the config as it will run (defaults < --config < options; net.size's widths, "
                       "threads) as TOML and exit")
    group.add_argument("--help-all", action=HelpAll, help="show every config option, by section, and exit")
    defaults = Config()
    sections = []
    for section_name, section_type in section_types().items():
        title = section_type.__doc__.splitlines()[0].rstrip(".") if section_type.__doc__ else ""
        group = parser.add_argument_group(f"[{section_name}] {title}")
        section_default = getattr(defaults, section_name)
        help_of = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(section_type)}
        hidden = 0
        for key, annotation in field_types(section_type).items():
            dotted = f"{section_name}.{key}"
            dest = DEST_PREFIX + dotted
            flags = [f"--{dotted}"]
            if dotted in common and dotted in ALIASES:
                flags.insert(0, ALIASES[dotted])
            default = getattr(section_default, key)
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default if default != "" else "''"
            text = f"{help_of[key]} (default: {shown}"
            if annotation is bool:
                text += f"; --no-{dotted} sets it false"
            text = (text + ")").replace("%", "%%")
            options = dict(dest=dest, default=argparse.SUPPRESS, metavar=metavar_for(annotation))
            if annotation is bool:  # --flag, --flag true|false, --no-flag
                options.update(nargs="?", const="true")
            action = group.add_argument(*flags, help=text if dotted in common else argparse.SUPPRESS, **options)
            setattr(action, FULL_HELP, text)
            hidden += dotted not in common
            spelled = [hyphenated(flag) for flag in flags if hyphenated(flag)]
            if spelled:
                group.add_argument(*spelled, help=argparse.SUPPRESS, **options)
            if annotation is bool:
                negated = [f"--no-{dotted}"] + ([f"--no-{dotted.replace('_', '-')}"] if "_" in dotted else [])
                group.add_argument(*negated, dest=dest, action="store_const", const="false",
                                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sections.append((f"[{section_name}]", title, len(help_of), hidden))
    width = max(len(name) for name, *_ in sections)
    lines = [f"  {name:<{width}}  {count:>2} options ({count - hidden} above)  {title}"
             for name, title, count, hidden in sections]
    parser.epilog = "\n".join([
        *textwrap.wrap(f"config sections: each field is an option --section.key VALUE (--learn.n-step = "
                       f"--learn.n_step; booleans: --replay.her, --no-replay.her, --replay.her false) and a TOML "
                       f"key; `{prog} --help-all` lists every one.", width=100, break_on_hyphens=False),
        *lines,
    ])


def config_from_args(args: argparse.Namespace, base: Config | None = None) -> Config:
    """``base`` (defaults), then ``--config FILE``, then the options given on the command line.

    With ``--print-config`` the result is printed as TOML and the command exits (status 0)."""
    config = base or Config()
    if getattr(args, "config", None):
        config = load_config(args.config, base=config)
    overrides = {
        dest[len(DEST_PREFIX):]: value for dest, value in vars(args).items() if dest.startswith(DEST_PREFIX)
    }
    config = with_overrides(config, overrides) if overrides else config
    if getattr(args, "print_config", False):
        print(dump_config(as_it_will_run(config, args)), end="")
        raise SystemExit(0)
    return config


def as_it_will_run(config: Config, args: argparse.Namespace) -> Config:
    """``--print-config``'s config: every 'auto' the device settles, settled (:func:`fitdqn.resolve.resolve_for_device`:
    ``net.size = small``'s widths, envs, precision, the learning rate's base batch) for the device the
    command runs on (``args.device_for(args, config)``, e.g. plan's what-if card; else ``train.device``), and the
    CPU threads it sets. What the data settles (``market.reward_scale = 0``) is settled when the run starts."""
    # torch and the planner's tables: imported only for --print-config, so --help stays fast
    from fitdqn.device.probe import probe
    from fitdqn.device.threads import cpu_threads
    from fitdqn.resolve import resolve_for_device

    device_for = getattr(args, "device_for", None)
    device = device_for(args, config) if device_for else probe(config.train.device)
    config = resolve_for_device(config, device)
    return dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                 threads=cpu_threads(config.train.threads)))
