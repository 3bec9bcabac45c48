"""The parser of every command, and the dispatch: parse, set torch's CPU threads, run the command, turn a user
mistake, a file error or a signal into one line and an exit status."""

from __future__ import annotations

import argparse
import difflib
import signal
import sys
from importlib import import_module, metadata

from fitdqn import __version__
from fitdqn.cli.common import set_threads
from fitdqn.config import REMOVED_KEYS
from fitdqn.errors import UserError
from fitdqn.files import describe_os_error

# the command modules of fitdqn.cli, in --help's order; imported when their parser is built
COMMANDS = ("plan", "gpu_profiles", "profile", "train", "evaluate", "bench", "tune", "worker", "act", "export")
# command name (and alias) -> its module
COMMAND_MODULES = {**{name: name for name in COMMANDS if "_" not in name}, "gpu-profiles": "gpu_profiles",
                   "profiles": "gpu_profiles"}
EXIT_USER_ERROR = 2
EXIT_FILE_ERROR = 1


class Version(argparse.Action):
    """``--version``: fitdqn's and torch's versions (torch's from its installed metadata: not imported)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    try:  # the installed distribution's version, read without importing torch (a second or more)
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"fitdqn {__version__} (torch {torch_version})"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with ``argv`` naming a command, that command's alone (a run parses only its own
    options: building all of them costs a tenth of a second)."""
    parser = argparse.ArgumentParser(
        prog="fitdqn",
        description="GPU-native distributional DQN for futures trading that plans every byte of GPU memory "
        "before it allocates, and picks the batch size last. `fitdqn COMMAND --help` for a command's common "
        "options, `--help-all` for every one.",
    )
    parser.add_argument("--version", action=Version, help="show fitdqn's and torch's versions and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.set_defaults(commands=commands.choices)  # command name -> its parser (for unknown_options)
    named = next((arg for arg in argv or () if not arg.startswith("-")), None)
    for command in (COMMAND_MODULES[named],) if named in COMMAND_MODULES else COMMANDS:
        import_module(f"fitdqn.cli.{command}").add_parser(commands)
    return parser


def unknown_options(unknown: list[str], command: argparse.ArgumentParser) -> str:
    """``unrecognized arguments: ...`` and, for each unknown option close to one of the command's (a typo in a
    config key), the one it probably meant."""
    known = [flag for action in command._actions for flag in action.option_strings]  # argparse has no public list
    hints = []
    for token in unknown:
        flag = token.split("=", 1)[0]
        removed = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if removed in REMOVED_KEYS:
            hints.append(f"{flag} was removed: {REMOVED_KEYS[removed]}")
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8) if flag.startswith("--") else []
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    text = f"unrecognized arguments: {' '.join(unknown)}"
    listing = "--help-all" if "--help-all" in known else "--help"
    return text + (f" ({'; '.join(hints)})" if hints else f" (`{command.prog} {listing}` lists every option)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's own message, with the options that were probably meant
        command = args.commands[args.command]
        command.error(unknown_options(unknown, command))
    if getattr(args, "uses_torch", True):  # gpu-profiles reads TOML files only: no torch to import
        set_threads(0)  # auto (OMP_NUM_THREADS, else the usable cores); train.threads re-sets it in config_for
    args.argv = argv  # for provenance (fitdqn profile writes it)
    try:
        return args.run(args)
    except UserError as error:
        print(f"fitdqn {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # `fitdqn plan --json | head`: the reader left; nothing is lost
        sys.stderr.close()
        return 0
    except OSError as error:  # a full disk, a read-only folder, no permission: one line, not a traceback
        doing = "file error at" if error.filename else "file error"
        print(f"fitdqn {args.command}: error: {describe_os_error(error, doing=doing)}", file=sys.stderr)
        return EXIT_FILE_ERROR
    except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM during a run (fitdqn.train.run.Interrupted)
        signum = getattr(error, "signum", signal.SIGINT)
        print(f"fitdqn {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
