"""The `fitdqn` command — the only door for people.

    fitdqn plan       where every byte of GPU memory will go, and the batch size that leaves
    fitdqn profiles   the GPU profiles and where their numbers came from
    fitdqn train      plan, allocate, train, evaluate: the whole run, resumable
    fitdqn evaluate   backtest a run's checkpoint on a split beside buy-and-hold and random

Every option is documented in ``fitdqn <command> --help``; every default lives in ``fitdqn.config``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from fitdqn.cli_args import add_config_arguments, config_from_args
from fitdqn.config import Config
from fitdqn.device import DeviceInfo, load_profiles, match_profile, parse_size, probe, what_if
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError

COMMON_ALIASES = ("budget.batch_size", "market.data", "train.device", "train.seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fitdqn",
        description="GPU-native distributional DQN for futures trading that plans every byte of GPU memory "
        "before it allocates, and picks the batch size last.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = commands.add_parser(
        "plan", help="where every byte of GPU memory goes, and the batch size that leaves",
        description="Probe the device (or describe one you do not have) and print the memory plan. "
        "Examples: `fitdqn plan`; `fitdqn plan --gpu rtx3050 --free-memory 1.7GiB`; `fitdqn plan --gpu h100 --json`.",
    )
    what_if_group = plan.add_argument_group("what-if device (plan for a GPU you do not have)")
    what_if_group.add_argument("--gpu", metavar="NAME", help="GPU name or profile name, e.g. h100, "
                               "'NVIDIA A100-SXM4-80GB', rtx3050")
    what_if_group.add_argument("--total-memory", metavar="SIZE", help="total device memory, e.g. 4GiB, 80GB")
    what_if_group.add_argument("--free-memory", metavar="SIZE", help="free device memory, e.g. 1.7GiB")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    plan.add_argument("--plot", metavar="FILE.png", help="also draw where the VRAM goes into this PNG")
    add_config_arguments(plan, COMMON_ALIASES)
    plan.set_defaults(run=run_plan)

    profiles = commands.add_parser(
        "profiles", help="list the GPU profiles and where their numbers came from",
        description="List shipped GPU profiles (and yours, with --budget.profiles_dir DIR).",
    )
    add_config_arguments(profiles, COMMON_ALIASES)
    profiles.set_defaults(run=run_profiles)

    train = commands.add_parser(
        "train", help="plan, allocate, train and evaluate (the main job)",
        description="Probe the device, plan every byte, allocate in plan order, check the plan against the "
        "device, then train epochs of collect + update and backtest on held-out bars. With no options: "
        "a short run on the real S&P 500 daily bars. Writes config.toml, plan.json, metrics.jsonl, "
        "TensorBoard events, checkpoint.pt, report.json/.md and PNG plots into --out.",
    )
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint "
                       "(its config.toml is used; options given here override it)")
    add_config_arguments(train, COMMON_ALIASES + ("train.epochs", "train.minutes", "train.out"))
    train.set_defaults(run=run_train)

    evaluate = commands.add_parser(
        "evaluate", help="backtest a run's checkpoint on a split",
        description="Re-run the backtest of RUN_DIR's checkpoint on --split beside buy-and-hold and a random "
        "policy; prints the metrics and writes evaluate_<split>.json into RUN_DIR.",
    )
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fitdqn train")
    evaluate.add_argument("--split", choices=("train", "validation", "test"), default="test",
                          help="which bars to backtest on (default: test)")
    evaluate.add_argument("--device", default="auto", help="device to evaluate on (default: auto)")
    evaluate.set_defaults(run=run_evaluate)
    return parser


def device_from_args(args: argparse.Namespace, config: Config) -> DeviceInfo:
    """The real probed device, or a described one when any what-if option is given."""
    if not (args.gpu or args.total_memory or args.free_memory):
        return probe(config.train.device)
    name = args.gpu or "what-if GPU"
    total = parse_size(args.total_memory) if args.total_memory else None
    free = parse_size(args.free_memory) if args.free_memory else None
    if total is None:
        profile = match_profile(name, load_profiles(config.budget.profiles_dir or None))
        total = profile.total_memory_bytes
    return what_if(name, total, free)


def run_plan(args: argparse.Namespace) -> int:
    from fitdqn.budget.build import plan_for_device
    from fitdqn.budget.report import plot_plan, print_plan

    config = config_from_args(args)
    device = device_from_args(args, config)
    plan = plan_for_device(config, device)
    if args.plot:
        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print_plan(plan)
        if args.plot:
            print(f"chart written to {args.plot}")
    return 0


def run_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fitdqn.train.run import default_run_dir, resume_config, train

    if args.resume:
        run_dir = Path(args.resume)
        base = resume_config(run_dir)
        args.config = None
        config = config_from_args(args, base=base)
    else:
        config = config_from_args(args)
        run_dir = Path(config.train.out) if config.train.out else default_run_dir()
    train(config, run_dir, resume=bool(args.resume))
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fitdqn.train.run import evaluate_run

    evaluate_run(Path(args.run_dir), args.split, args.device)
    return 0


def run_profiles(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    profiles = load_profiles(config.budget.profiles_dir or None)
    table = Table(title="GPU profiles", title_justify="left")
    for column in ("name", "batch", "matches device names", "memory", "source", "date"):
        table.add_column(column)
    ordered = sorted(profiles.values(), key=lambda p: p.name)
    for profile in ordered:
        table.add_row(
            profile.name, str(profile.batch_size), ", ".join(profile.match) or "(any other GPU)",
            format_bytes(profile.total_memory_bytes) if profile.total_memory_bytes else "-",
            str(profile.source["kind"]), str(profile.source["date"]),
        )
    console = Console()
    console.print(table)
    for profile in ordered:
        line = f"{profile.name}: {profile.source['description']} ({profile.path})"
        console.print(line, highlight=False, markup=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except UserError as error:
        print(f"fitdqn {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fitdqn plan --json | head`: the reader left; nothing is lost
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"fitdqn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
