"""The `fitdqn` command — the only door for people.

    fitdqn plan          where every byte of GPU memory will go, and the batch size that leaves
                         (--calibrate: measure the step on this GPU and plan with the measurement)
    fitdqn gpu-profiles  list the GPU profiles and where their numbers came from (old name: profiles)
    fitdqn profile       measure step time across batch sizes on this GPU and write its profile TOML
    fitdqn train         plan, allocate, train, evaluate: the whole run, resumable
    fitdqn evaluate      backtest a run's checkpoint on a split beside buy-and-hold and random
    fitdqn bench         update, replay and collector throughput on this device (CPU too)
    fitdqn tune          hyperparameter trials with Optuna, K at once (each planned within its share of the GPU)
    fitdqn act           a run's policy on new bars: target position and bracket per bar (CSV/Parquet)
    fitdqn export        a run's acting network as a torch.export program (.pt2)

``fitdqn <command> --help`` shows the command's common options and the config sections, ``--help-all`` every
option; every default lives in ``fitdqn.config``. Torch's CPU threads are set once at start
(:mod:`fitdqn.device.threads`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import textwrap
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from fitdqn import __version__
from fitdqn.cli_args import add_config_arguments, config_from_args
from fitdqn.config import Config
from fitdqn.device import DeviceInfo, load_profiles, parse_size, probe, what_if
from fitdqn.device.probe import what_if_device
from fitdqn.device.sizes import format_bytes
from fitdqn.device.threads import set_torch_threads
from fitdqn.errors import UserError
from fitdqn.files import describe_os_error
from fitdqn.tune.cli import add_parser as add_tune_parser

HELP_WIDTH = 100
# config options every command's --help shows (the rest: --help-all)
COMMON_KNOBS = ("budget.batch_size", "market.data", "market.contract", "train.device", "train.seed", "train.threads")
COMMON_ALIASES = COMMON_KNOBS  # the older name, for commands written against it
TRAIN_KNOBS = ("train.epochs", "train.minutes", "train.out", "train.replay_ratio", "collect.num_envs", "learn.lr",
               "learn.risk", "train.gpus")


def config_for(args: argparse.Namespace, base: Config | None = None) -> Config:
    """The command's config (:func:`config_from_args`; ``--print-config`` exits there), with torch's CPU threads
    set for it (``train.threads``)."""
    config = config_from_args(args, base=base)
    set_torch_threads(config.train.threads)
    return config


def describe(examples: tuple[str, ...], *paragraphs: str) -> str:
    """A subcommand's description: its examples first, then its prose (wrapped; kept as written by the formatter)."""
    lines = ["examples:", *(f"  {example}" for example in examples), ""]
    for paragraph in paragraphs:
        lines += [*textwrap.wrap(paragraph, width=HELP_WIDTH), ""]
    return "\n".join(lines).rstrip()


def add_command(commands, name: str, summary: str, examples: tuple[str, ...], *paragraphs: str,
                aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    return commands.add_parser(name, help=summary, aliases=list(aliases), description=describe(examples, *paragraphs),
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fitdqn",
        description="GPU-native distributional DQN for futures trading that plans every byte of GPU memory "
        "before it allocates, and picks the batch size last. `fitdqn COMMAND --help` for a command's common "
        "options, `--help-all` for every one.",
    )
    parser.add_argument("--version", action="version", version=version_text())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = add_command(
        commands, "plan", "where every byte of GPU memory goes, and the batch size that leaves",
        ("fitdqn plan", "fitdqn plan --gpu rtx3050 --free-memory 1.7GiB", "fitdqn plan --gpu h100 --json",
         "fitdqn plan --calibrate --batch-size 0   # on a CUDA GPU: measure the real step and plan with it"),
        "Probe the device (or describe one you do not have) and print the memory plan: every consumer's fixed and "
        "per-sample bytes, and the batch size that leaves.",
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
    add_config_arguments(plan, COMMON_KNOBS)
    plan.set_defaults(run=run_plan)

    profiles = add_command(
        commands, "gpu-profiles", "list the GPU profiles (tested batch sizes) and where their numbers came from",
        ("fitdqn gpu-profiles", "fitdqn gpu-profiles --budget.profiles_dir profiles   # yours beside the shipped ones"),
        "List the GPU profiles: the batch size each card trains fastest at, and where that number came from. "
        "Lists only; to measure a new profile on this GPU, run `fitdqn profile`. (`fitdqn profiles` is the old "
        "name of this command.)",
        aliases=("profiles",),
    )
    add_config_arguments(profiles, ("budget.profiles_dir",))
    profiles.set_defaults(run=run_profiles)

    profile = add_command(
        commands, "profile", "measure step time across batch sizes on this GPU and write its profile",
        ("fitdqn profile", "fitdqn profile --name h200 --out profiles/h200.toml",
         "fitdqn profile --batches 256,1024,4096 --epochs-per-batch 3"),
        "Measures; to list the profiles there are, run `fitdqn gpu-profiles`.",
        "On the present CUDA GPU: plan with batch 0 to find the largest batch that fits, then for "
        "batch sizes = powers of two from budget.min_batch up to it (capped by budget.max_batch) time the graphed "
        "update alone (CUDA events, median of --update-iters replays after warm-up) and full epochs of collect "
        "+ updates (Trainer.run_epoch). The profile's batch is the smallest whose full-epoch training throughput "
        "(samples/s = updates x batch / s) is within 5 % of the best: bigger is not always faster. Writes a "
        "profile TOML with the measurements and where they came from. Unless you give "
        "--collect.steps_per_epoch, epochs are shortened to 16 env steps. Use a written profile with "
        "--budget.profiles_dir DIR.",
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
    add_config_arguments(profile, COMMON_KNOBS + ("collect.steps_per_epoch", "budget.profiles_dir"))
    profile.set_defaults(run=run_profile)

    train = add_command(
        commands, "train", "plan, allocate, train and evaluate (the main job)",
        ("fitdqn train", "fitdqn train --data synthetic --epochs 10 --out runs/synthetic",
         "fitdqn train --config examples/synthetic_cpu.toml", "fitdqn train --resume runs/synthetic --epochs 20",
         "fitdqn train --learn.n-step 5 --no-replay.her --print-config   # check the config, run nothing"),
        "Probe the device, plan every byte, allocate in plan order, check the plan against the "
        "device, then train epochs of collect + update and backtest on held-out bars. With no options: "
        "a short run on the real S&P 500 daily bars. Writes config.toml, plan.json, metrics.jsonl, "
        "TensorBoard events, checkpoint.pt, report.json/.md and PNG plots into --out.",
    )
    train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint "
                       "(its config.toml is used; options given here override it)")
    add_config_arguments(train, COMMON_KNOBS + TRAIN_KNOBS + ("evaluate.seeds", "evaluate.folds"))
    train.set_defaults(run=run_train)

    evaluate = commands.add_parser(
        "evaluate", help="backtest a run's checkpoint on a split",
        description="Re-run the backtest of RUN_DIR's network (the best by validation, or --network last) on "
        "--split beside buy-and-hold, the rule baselines and a random policy, with bootstrap intervals on Sharpe; "
        "prints the verdict and the metrics and writes evaluate_<split>.json into RUN_DIR. On a study (trained "
        "with --seeds or --folds) every seed and fold is evaluated on its own bars and reported together.",
    )
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fitdqn train")
    evaluate.add_argument("--split", choices=("train", "validation", "test"), default="test",
                          help="which bars to backtest on (default: test)")
    evaluate.add_argument("--device", default="auto", help="device to evaluate on (default: auto)")
    evaluate.add_argument("--network", choices=("best", "last"), default="best",
                          help="best: the network with the best validation Sharpe (best.pt, what the report "
                          "shows); last: the latest checkpoint's (default: best)")
    evaluate.set_defaults(run=run_evaluate)

    bench = add_command(
        commands, "bench", "update, replay and collector throughput on this device (CPU too)",
        ("fitdqn bench", "fitdqn bench --json", "fitdqn bench --collect.num_envs 64 --data synthetic   # on a CPU"),
        "Build the real Trainer for the config on the present device (CUDA or CPU) and time: the "
        "update at the planned batch (updates/s and samples/s; eager, and CUDA-graphed on a GPU), replay "
        "sampling + priority update (samples/s), and the collector with the policy in the loop (env steps/s).",
    )
    bench.add_argument("--iters", type=int, default=20, metavar="N",
                       help="most timed iterations of the update and of the replay (default: 20)")
    bench.add_argument("--collect-steps", type=int, default=16, metavar="N",
                       help="most timed collector steps (each steps every env once; default: 16)")
    bench.add_argument("--seconds", type=float, default=3.0, metavar="S",
                       help="time budget per timed row: stop early once it has passed (default: 3)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    add_config_arguments(bench, COMMON_KNOBS)
    bench.set_defaults(run=run_bench)
    add_tune_parser(commands)
    add_deploy_commands(commands)
    return parser


def add_deploy_commands(commands) -> None:
    """``act`` and ``export``: use what a run trained."""
    act = add_command(
        commands, "act", "the trained policy's target position and bracket for every bar of new data",
        ("fitdqn act runs/sp500 --data new_bars.csv",
         "fitdqn act runs/sp500 --data new_bars.parquet --start 2024-01-02 --out decisions.parquet"),
        "Run RUN_DIR's trained policy over the bars of --data (CSV or Parquet, the columns `fitdqn train` "
        "reads) through the same features and the same env as the run's backtests: one row per bar from --start "
        "(or the end of the features' warm-up: give at least 141 bars of history) to the last bar, with the "
        "contracts held, the target position to hold after the next open, and the bracket: stop and take-profit "
        "in ATR(14) multiples and in price (measured from the next bar's open; for the last bar, from its close). "
        "The agent state is built as in the backtests: episodes of market.episode_length decisions, the "
        "position liquidated at each episode's end. The last row is the decision to trade at the next open.",
    )
    act.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fitdqn train")
    act.add_argument("--data", required=True, metavar="FILE", help="bars to act on: a CSV or Parquet file")
    act.add_argument("--out", metavar="FILE.csv|FILE.parquet",
                     help="where to write the decisions (default: RUN_DIR/actions.csv)")
    act.add_argument("--start", metavar="DATE", help="first bar to decide at (earlier bars warm up the features; "
                     "default: the first bar after the warm-up)")
    act.add_argument("--goal-unit", type=float, metavar="FLOAT", help="the goal scale shown to the agent "
                     "(default: from the run's training bars, as in its backtests)")
    act.add_argument("--device", default="cpu", help="device to run the policy on (default: cpu)")
    act.set_defaults(run=run_act)

    export = add_command(
        commands, "export", "export the acting network for deployment (torch.export, .pt2)",
        ("fitdqn export runs/sp500 --out policy.pt2",
         "python -c \"import torch; p = torch.export.load('policy.pt2').module(); actions, q = p(obs)\""),
        "Save RUN_DIR's acting network as a torch.export program: obs [B, W, S] float32 -> (actions [B, 3] "
        "int64, q [B, 3, n]), greedy on the C51 means (learn.risk = 'cvar': on the IQN CVaR at evenly spaced "
        "levels), plain PyTorch kernels in fp32; it loads with torch.export.load, without fitdqn. The archive's "
        "fitdqn.json says how to build obs (feature and agent-state names, window) and how to read the actions "
        "(target contracts, stop and take-profit ATR multiples). `fitdqn act` does all of that for you.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fitdqn train")
    export.add_argument("--out", required=True, metavar="FILE.pt2", help="where to write the program")
    export.set_defaults(run=run_export)


def version_text() -> str:
    import torch

    return f"fitdqn {__version__} (torch {torch.__version__})"


def device_from_args(args: argparse.Namespace, config: Config) -> DeviceInfo:
    """The real probed device, or a described one when any what-if option is given."""
    if not (args.gpu or args.total_memory or args.free_memory):
        return probe(config.train.device)
    total = parse_size(args.total_memory) if args.total_memory else None
    free = parse_size(args.free_memory) if args.free_memory else None
    return what_if_device(args.gpu, total, free)  # the card's facts by name (device.cards)


def run_plan(args: argparse.Namespace) -> int:
    from fitdqn.plan.plan_cache import plan_for_device  # cached: a repeated plan is instant
    from fitdqn.plan.report import plot_plan, print_plan

    config = config_for(args)
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
    from fitdqn.config import for_device
    from fitdqn.plan.build import PlanInputs, plan_for_device
    from fitdqn.plan.calibrate import calibrate, calibrated_plan, parse_batches, print_calibration, require_cuda
    from fitdqn.plan.report import plot_plan, print_plan

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
        from fitdqn.plan.calibrate import comparison_rows

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

    from fitdqn.train import distributed
    from fitdqn.train.run import default_run_dir, resume_config, train
    from fitdqn.train.study import is_study, member_market, run_study

    if args.resume:
        run_dir = Path(args.resume)
        base = resume_config(run_dir)
        args.config = None
        config = config_for(args, base=base)
    else:
        config = config_for(args)
        run_dir = Path(config.train.out) if config.train.out else default_run_dir()
    if config.train.gpus > 1 or distributed.world_size_of() > 1:  # data parallel (fitdqn.train.distributed)
        if is_study(config):
            raise UserError("--seeds/--folds train one run after another: give them without --gpus")
        if not distributed.launched_by_torchrun():
            return distributed.launch(config.train.gpus, config.train.device, args.argv)
    if is_study(config):  # --seeds / --folds: several runs under run_dir, one report (continues where it was)
        run_study(config, run_dir)
    else:  # a walk-forward member resumes on its own fold's bars
        train(config, run_dir, resume=bool(args.resume), market=member_market(config, run_dir))
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fitdqn.train.run import evaluate_run
    from fitdqn.train.study import STUDY_NAME, evaluate_study

    run_dir = Path(args.run_dir)
    if (run_dir / STUDY_NAME).is_file():
        evaluate_study(run_dir, args.split, args.device, network=args.network)
    else:
        evaluate_run(run_dir, args.split, args.device, network=args.network)
    return 0


def run_profiles(args: argparse.Namespace) -> int:
    config = config_for(args)
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

    return run_profile_command(args, config_for(args))


def run_bench(args: argparse.Namespace) -> int:
    from fitdqn.train.bench import print_bench, run_bench_command

    result = run_bench_command(config_for(args), iters=args.iters, collect_steps=args.collect_steps,
                               seconds=args.seconds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_bench(result)
    return 0


def run_act(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fitdqn.deploy import act_run, load_run_policy, write_actions
    from fitdqn.device.probe import resolve_device

    policy = load_run_policy(args.run_dir, resolve_device(args.device))
    out = Path(args.out) if args.out else Path(args.run_dir) / "actions.csv"
    if out.suffix.lower() not in (".csv", ".parquet", ".pq"):
        raise UserError(f"--out {out}: write the decisions to a .csv or .parquet file")
    goal_unit = policy.goal_unit() if args.goal_unit is None else args.goal_unit
    frame = act_run(policy, args.data, start=args.start, goal_unit=goal_unit)
    write_actions(frame, out)
    print(f"{len(frame)} decisions, {frame['timestamp'].iloc[0]} to {frame['timestamp'].iloc[-1]}, of the policy in "
          f"{args.run_dir} (checkpoint epoch {policy.epoch}, contract {policy.contract.name}, goal unit "
          f"{goal_unit:.6g}) written to {out}")
    print(f"latest, to trade at the next open: {decision_text(frame.iloc[-1])}")
    return 0


def decision_text(row) -> str:
    """One decision row in words: target and bracket."""
    parts = [f"bar {row['timestamp']}: hold {row['target']:+g} contracts (now {row['held']:+g})"]
    if row["target"] != 0:
        for name, k, price in (("stop", row["stop_atr"], row["stop_price"]),
                               ("take-profit", row["take_profit_atr"], row["take_profit_price"])):
            parts.append(f"{name} {k:g} x ATR = {price:g}" if k > 0 else f"no {name}")
    return ", ".join(parts)


def run_export(args: argparse.Namespace) -> int:
    from fitdqn.deploy import export_policy, load_run_policy

    out = export_policy(load_run_policy(args.run_dir, "cpu"), args.out)
    print(f"acting network of {args.run_dir} exported to {out} (torch.export.load('{out}').module()(obs) -> "
          "actions, q)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_torch_threads(0)  # auto (OMP_NUM_THREADS, else the usable cores); train.threads re-sets it in config_for
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
    except OSError as error:  # a full disk, a read-only folder, no permission: one line, not a traceback
        print(f"fitdqn {args.command}: error: {describe_os_error(error, doing='file error at')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM during a run (fitdqn.train.run.Interrupted)
        signum = getattr(error, "signum", signal.SIGINT)
        print(f"fitdqn {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    raise SystemExit(main())
