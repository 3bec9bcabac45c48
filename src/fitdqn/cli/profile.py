"""`fitdqn profile`: measure step time across batch sizes on this GPU and write its profile
(:func:`fitdqn.train.profile.profile_gpu`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from fitdqn.cli.args import DEST_PREFIX, add_config_arguments
from fitdqn.cli.common import COMMON_KNOBS, Commands, add_command, config_for
from fitdqn.errors import UserError

EPOCHS_PER_BATCH = 2
UPDATE_ITERS = 20


def add_parser(commands: Commands) -> argparse.ArgumentParser:
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
    profile.add_argument("--epochs-per-batch", type=int, default=EPOCHS_PER_BATCH, metavar="N",
                         help="timed full epochs per batch size (default: %(default)s)")
    profile.add_argument("--update-iters", type=int, default=UPDATE_ITERS, metavar="N",
                         help="timed update replays per batch size, after warm-up (default: %(default)s)")
    profile.add_argument("--name", metavar="NAME", help="profile name (default: from the card, e.g. h200)")
    profile.add_argument("--out", metavar="FILE.toml", help="where to write the profile "
                         "(default: ./profiles/<name>.toml)")
    profile.add_argument("--json", action="store_true", help="print the measurements as JSON instead of tables")
    add_config_arguments(profile, COMMON_KNOBS + ("collect.steps_per_epoch", "budget.profiles_dir"))
    profile.set_defaults(run=run)
    return profile


def parse_batch_list(text: str) -> list[int]:
    """``--batches 256,1024``: sorted, without repeats."""
    try:
        values = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    except ValueError:
        raise UserError(f"--batches {text!r}: expected comma-separated batch sizes, e.g. 256,1024,4096") from None
    if not values or values[0] < 1:
        raise UserError(f"--batches {text!r}: give positive batch sizes, e.g. 256,1024,4096")
    return values


def run(args: argparse.Namespace) -> int:
    # the measuring imports torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.device.probe import probe
    from fitdqn.device.sizes import format_bytes
    from fitdqn.plan.calibrate import require_cuda
    from fitdqn.train.profile import TOLERANCE, print_profile, profile_config, profile_gpu, profile_name

    config = config_for(args)
    if args.epochs_per_batch < 1 or args.update_iters < 1:
        raise UserError("--epochs-per-batch and --update-iters must be at least 1")
    batches = parse_batch_list(args.batches) if args.batches else None
    device = probe(config.train.device)
    require_cuda(device, "fitdqn profile measures step time")
    config = profile_config(config, steps_given=hasattr(args, DEST_PREFIX + "collect.steps_per_epoch"))
    name = args.name or profile_name(device.name)
    out = Path(args.out) if args.out else Path("profiles") / f"{name}.toml"
    console = Console()
    result = profile_gpu(config, device, batches=batches, epochs_per_batch=args.epochs_per_batch,
                         update_iters=args.update_iters, name=name, out=out,
                         command="fitdqn " + " ".join(args.argv), console=None if args.json else console)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print_profile(result.rows, result.batch_size, f"{result.card}: training throughput by batch size "
                  f"({result.seconds:.0f} s)", console)
    if result.driver_bytes is not None:
        console.print(f"driver-side bytes over the run: {format_bytes(result.driver_bytes)} (budgeted as "
                      "cuda_driver)", highlight=False)
    console.print(f"profile batch {result.batch_size}: the smallest within {TOLERANCE:.0%} of the best epoch "
                  f"samples/s; written to {out} (use it with --budget.profiles_dir {out.parent})", highlight=False)
    return 0
