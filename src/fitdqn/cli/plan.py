"""`fitdqn plan`: where every byte of GPU memory goes, and the batch size that leaves (``--calibrate``: measured on
this GPU)."""

from __future__ import annotations

import argparse
import gc
import json

from fitdqn.cli.args import add_config_arguments
from fitdqn.cli.common import COMMON_KNOBS, Commands, add_command, config_for
from fitdqn.config import Config, for_device

CALIBRATE_BATCHES = "64,256"


def add_parser(commands: Commands) -> argparse.ArgumentParser:
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
    calibration.add_argument("--calibrate-batches", metavar="A,B", default=CALIBRATE_BATCHES,
                             help="the two batch sizes to measure the step at (default: %(default)s)")
    add_config_arguments(plan, COMMON_KNOBS)
    plan.set_defaults(run=run, device_for=device_from_args)  # --print-config resolves for the what-if card too
    return plan


def what_if_given(args: argparse.Namespace) -> bool:
    return bool(args.gpu or args.total_memory or args.free_memory)


def device_from_args(args: argparse.Namespace, config: Config):
    """The real probed device, or a described one when any what-if option is given."""
    # fitdqn.device imports torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.device.probe import probe, what_if_device
    from fitdqn.device.sizes import device_memory_size

    if not what_if_given(args):
        return probe(config.train.device)
    total = device_memory_size(args.total_memory, "--total-memory") if args.total_memory else None
    free = device_memory_size(args.free_memory, "--free-memory") if args.free_memory else None
    return what_if_device(args.gpu, total, free)  # the card's facts by name (device.cards)


def run(args: argparse.Namespace) -> int:
    gc.freeze()  # torch's ~10^6 objects (imported by now) are left out of every collection of this short command
    try:
        return _run(args)
    finally:
        gc.unfreeze()


def _run(args: argparse.Namespace) -> int:
    # the planner imports torch: imported when the command runs, so `fitdqn --help` stays fast; the tables (rich)
    # and the chart (matplotlib) only when shown
    from fitdqn.plan.plan_cache import plan_for_device  # cached: a repeated plan is instant

    config = config_for(args)
    if args.calibrate:
        return run_calibrated(args, config)
    device = device_from_args(args, config)
    plan = plan_for_device(config, device)
    if args.plot:
        from fitdqn.plan.report import plot_plan

        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        from fitdqn.learn.schedule import Schedule
        from fitdqn.plan.report import print_plan

        print_plan(plan, schedule=Schedule.from_config(for_device(config, device.kind), plan.batch_size))
        if args.plot:
            print(f"chart written to {args.plot}")
    return 0


def run_calibrated(args: argparse.Namespace, config: Config) -> int:
    """``fitdqn plan --calibrate``: probe, plan, measure the real step, re-plan with the measurement."""
    # the planner and calibration import torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.device.probe import probe, what_if
    from fitdqn.plan.build import PlanInputs, plan_for_device
    from fitdqn.plan.calibrate import (
        calibrate,
        calibrated_plan,
        comparison_rows,
        parse_batches,
        print_calibration,
        require_cuda,
    )
    from fitdqn.plan.report import plot_plan, print_plan

    if what_if_given(args):
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
