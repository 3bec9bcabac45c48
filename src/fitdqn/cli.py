"""The `fitdqn` command — the only door for people.

    fitdqn plan       where every byte of GPU memory will go, and the batch size that leaves
                      (--calibrate: measure the step on this GPU and plan with the measurement)
    fitdqn profiles   the GPU profiles and where their numbers came from
    fitdqn profile    measure step time across batch sizes on this GPU and write its profile TOML
    fitdqn train      plan, allocate, train, evaluate: the whole run, resumable
    fitdqn evaluate   backtest a run's checkpoint on a split beside buy-and-hold and random
    fitdqn bench      update, replay and collector throughput on this device (CPU too)
    fitdqn tune       hyperparameter trials with Optuna, K at once (each planned within its share of the GPU)

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
from fitdqn.tune.cli import add_parser as add_tune_parser

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
        "Examples: `fitdqn plan`; `fitdqn plan --gpu rtx3050 --free-memory 1.7GiB`; `fitdqn plan --gpu h100 --json`; "
        "`fitdqn plan --calibrate --batch-size 0` (on a CUDA GPU: measure the real step and plan with it).",
    )
    what_if_group = plan.add_argument_group("what-if device (plan for a GPU you do not have)")
    what_if_group.add_argument("--gpu", metavar="NAME", help="GPU name or profile name, e.g. h100, "
                               "'NVIDIA A100-SXM4-80GB', rtx3050")
    what_if_group.add_argument("--total-memory", metavar="SIZE", help="total device memory, e.g. 4GiB, 80GB")
    what_if_group.add_argument("--free-memory", metavar="SIZE", help="free device memory, e.g. 1.7GiB")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    plan.add_argument("--plot", metavar="FILE.png", help="also draw where the VRAM goes into this PNG")
    calibration = plan.add_argument_group("calibration (CUDA GPU only)")
    calibration.add_argument(
        "--calibrate", action="store_true",
        help="run the real training step on this GPU at two small batches, print measured vs traced bytes per "
        "sample per component, and plan with the measured per-sample total and driver-side overhead "
        "(the traced per-component figures are scaled to sum to the measured slope)")
    calibration.add_argument("--calibrate-batches", metavar="A,B", default="64,256",
                             help="the two batch sizes to measure the step at (default: 64,256)")
    add_config_arguments(plan, COMMON_ALIASES)
    plan.set_defaults(run=run_plan)

    profiles = commands.add_parser(
        "profiles", help="list the GPU profiles and where their numbers came from",
        description="List shipped GPU profiles (and yours, with --budget.profiles_dir DIR).",
    )
    add_config_arguments(profiles, COMMON_ALIASES)
    profiles.set_defaults(run=run_profiles)

    profile = commands.add_parser(
        "profile", help="measure step time across batch sizes on this GPU and write its profile",
        description="On the present CUDA GPU: plan with batch 0 to find the largest batch that fits, then for "
        "batch sizes = powers of two from budget.min_batch up to it (capped by budget.max_batch) time the graphed "
        "update alone (CUDA events, median of --update-iters replays after warm-up) and full epochs of collect "
        "+ updates (Trainer.run_epoch). The profile's batch is the smallest whose full-epoch training throughput "
        "(samples/s = updates x batch / s) is within 5 % of the best: bigger is not always faster. Writes a "
        "profile TOML with the measurements and where they came from. Unless you give "
        "--collect.steps_per_epoch, epochs are shortened to 16 env steps. Examples: `fitdqn profile`; "
        "`fitdqn profile --name h200 --out profiles/h200.toml`; `fitdqn profile --batches 256,1024,4096 "
        "--epochs-per-batch 3`. Use a written profile with --budget.profiles_dir DIR.",
    )
    profile.add_argument("--batches", metavar="A,B,...", help="batch sizes to measure instead of the powers of two")
    profile.add_argument("--epochs-per-batch", type=int, default=2, metavar="N",
                         help="timed full epochs per batch size (default: 2)")
    profile.add_argument("--update-iters", type=int, default=20, metavar="N",
                         help="timed update replays per batch size, after warm-up (default: 20)")
    profile.add_argument("--name", metavar="NAME", help="profile name (default: from the card, e.g. h200)")
    profile.add_argument("--out", metavar="FILE.toml", help="where to write the profile "
                         "(default: ./profiles/<name>.toml)")
    profile.add_argument("--json", action="store_true", help="print the measurements as JSON instead of tables")
    add_config_arguments(profile, COMMON_ALIASES)
    profile.set_defaults(run=run_profile)

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

    bench = commands.add_parser(
        "bench", help="update, replay and collector throughput on this device (CPU too)",
        description="Build the real Trainer for the config on the present device (CUDA or CPU) and time: the "
        "update at the planned batch (updates/s and samples/s; eager, and CUDA-graphed on a GPU), replay "
        "sampling + priority update (samples/s), and the collector with the policy in the loop (env steps/s). "
        "Examples: `fitdqn bench`; `fitdqn bench --json`; on a CPU: `fitdqn bench --collect.num_envs 64 "
        "--market.data synthetic`.",
    )
    bench.add_argument("--iters", type=int, default=20, metavar="N",
                       help="most timed iterations of the update and of the replay (default: 20)")
    bench.add_argument("--collect-steps", type=int, default=16, metavar="N",
                       help="most timed collector steps (each steps every env once; default: 16)")
    bench.add_argument("--seconds", type=float, default=3.0, metavar="S",
                       help="time budget per timed row: stop early once it has passed (default: 3)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    add_config_arguments(bench, COMMON_ALIASES)
    bench.set_defaults(run=run_bench)
    add_tune_parser(commands)
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
    if args.calibrate:
        return run_plan_calibrated(args, config)
    device = device_from_args(args, config)
    plan = plan_for_device(config, device)
    if args.plot:
        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        from fitdqn.config import for_device
        from fitdqn.learn.schedule import Schedule

        print_plan(plan, schedule=Schedule.from_config(for_device(config, device.kind), plan.batch_size))
        if args.plot:
            print(f"chart written to {args.plot}")
    return 0


def run_plan_calibrated(args: argparse.Namespace, config: Config) -> int:
    """``fitdqn plan --calibrate``: probe, plan, measure the real step, re-plan with the measurement."""
    from fitdqn.budget.build import PlanInputs, plan_for_device
    from fitdqn.budget.calibrate import calibrate, calibrated_plan, parse_batches, print_calibration, require_cuda
    from fitdqn.budget.report import plot_plan, print_plan
    from fitdqn.config import for_device

    if args.gpu or args.total_memory or args.free_memory:
        require_cuda(what_if(args.gpu or "what-if GPU", None, None))
    batches = parse_batches(args.calibrate_batches)
    device = probe(config.train.device)  # before anything runs on the GPU: the plan is for a fresh process
    require_cuda(device)
    config = for_device(config, device.kind)
    inputs = PlanInputs.from_config(config)
    traced = plan_for_device(config, device, inputs)
    calibration = calibrate(config, device, inputs.num_bars, batches)
    plan = calibrated_plan(traced, calibration, config)
    if args.plot:
        plot_plan(plan, args.plot)
    if args.json:
        from fitdqn.budget.calibrate import comparison_rows

        record = {**plan.to_json(), "traced_plan": {"batch_size": traced.batch_size,
                                                     "per_sample_bytes": traced.per_sample_bytes,
                                                     "components": [c.to_json() for c in traced.components]},
                  "calibration": {**calibration.to_json(),
                                  "rows": comparison_rows(traced, plan, calibration)}}
        print(json.dumps(record, indent=2))
    else:
        print_calibration(traced, plan, calibration)
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


def run_profile(args: argparse.Namespace) -> int:
    from fitdqn.train.profile import run_profile_command

    return run_profile_command(args, config_from_args(args))


def run_bench(args: argparse.Namespace) -> int:
    from fitdqn.train.bench import print_bench, run_bench_command

    result = run_bench_command(config_from_args(args), iters=args.iters, collect_steps=args.collect_steps,
                               seconds=args.seconds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_bench(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for provenance (fitdqn profile writes it)
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
