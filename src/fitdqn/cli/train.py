"""`fitdqn train`: plan, allocate, train and evaluate (:func:`fitdqn.train.run.train`; with ``--seeds`` or
``--folds``, a study of several runs: :func:`fitdqn.train.study.run_study`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fitdqn.cli.args import add_config_arguments
from fitdqn.cli.common import COMMON_KNOBS, TRAIN_KNOBS, Commands, add_command, config_for
from fitdqn.errors import UserError


def add_parser(commands: Commands) -> argparse.ArgumentParser:
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
    add_config_arguments(train, COMMON_KNOBS + TRAIN_KNOBS + ("evaluate.seeds", "evaluate.folds",
                                                                  "train.parallel", "train.storage"))
    train.set_defaults(run=run)
    return train


def run(args: argparse.Namespace) -> int:
    # the trainer imports torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.schedule.study import run_packed_study
    from fitdqn.train import distributed, study
    from fitdqn.train import run as runs

    if args.resume:
        run_dir = Path(args.resume)
        base = runs.resume_config(run_dir)
        args.config = None
        config = config_for(args, base=base)
    else:
        config = config_for(args)
        run_dir = Path(config.train.out) if config.train.out else runs.default_run_dir()
    if config.train.gpus > 1 or distributed.world_size_of() > 1:  # data parallel (fitdqn.train.distributed)
        if study.is_study(config):
            raise UserError("--seeds/--folds train one run after another: give them without --gpus")
        if not distributed.launched_by_torchrun():
            return distributed.launch(config.train.gpus, config.train.device, args.argv)
    if study.is_study(config):  # --seeds / --folds: runs under run_dir from a queue, one report (continues)
        run_packed_study(config, run_dir)
    else:  # a walk-forward member resumes on its own fold's bars
        runs.train(config, run_dir, resume=bool(args.resume), market=study.member_market(config, run_dir))
    return 0
