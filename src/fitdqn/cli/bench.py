"""`fitdqn bench`: update, replay and collector throughput on this device (:func:`fitdqn.train.bench.run_bench`)."""

from __future__ import annotations

import argparse
import json
import math

from fitdqn.cli.args import add_config_arguments
from fitdqn.cli.common import COMMON_KNOBS, Commands, add_command, config_for
from fitdqn.errors import UserError

ITERS = 20
COLLECT_STEPS = 16
SECONDS = 3.0


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    bench = add_command(
        commands, "bench", "update, replay and collector throughput on this device (CPU too)",
        ("fitdqn bench", "fitdqn bench --json", "fitdqn bench --collect.num_envs 64 --data synthetic   # on a CPU"),
        "Build the real Trainer for the config on the present device (CUDA or CPU) and time: the "
        "update at the planned batch (updates/s and samples/s; eager, and CUDA-graphed on a GPU), replay "
        "sampling + priority update (samples/s), and the collector with the policy in the loop (env steps/s).",
    )
    bench.add_argument("--iters", type=int, default=ITERS, metavar="N",
                       help="most timed iterations of the update and of the replay (default: %(default)s)")
    bench.add_argument("--collect-steps", type=int, default=COLLECT_STEPS, metavar="N",
                       help="most timed collector steps (each steps every env once; default: %(default)s)")
    bench.add_argument("--seconds", type=float, default=SECONDS, metavar="S",
                       help="time budget per timed row: stop early once it has passed (default: %(default)g)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    add_config_arguments(bench, COMMON_KNOBS)
    bench.set_defaults(run=run)
    return bench


def run(args: argparse.Namespace) -> int:
    # the trainer imports torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.train.bench import print_bench, run_bench

    if args.iters < 1 or args.collect_steps < 1 or not 0 < args.seconds < math.inf:
        raise UserError("--iters and --collect-steps must be at least 1, --seconds a positive finite number")
    result = run_bench(config_for(args), iters=args.iters, collect_steps=args.collect_steps, seconds=args.seconds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_bench(result)
    return 0
