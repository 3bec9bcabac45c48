"""`fitdqn evaluate`: backtest a run's network on a split beside the baselines (:func:`fitdqn.train.run.evaluate_run`;
on a study, every seed and fold: :func:`fitdqn.train.study.evaluate_study`). The result is printed before any file
is written, so a failed write loses nothing the user can read."""

from __future__ import annotations

import argparse
from pathlib import Path

from fitdqn.cli.common import Commands, add_network_option, writing_into

SPLITS = ("train", "validation", "test")


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    evaluate = commands.add_parser(
        "evaluate", help="backtest a run's checkpoint on a split",
        description="Re-run the backtest of RUN_DIR's network (the best by validation, or --network last) on "
        "--split beside buy-and-hold, the rule baselines and a random policy, with bootstrap intervals on Sharpe; "
        "prints the verdict and the metrics and writes evaluate_<split>.json into RUN_DIR. On a study (trained "
        "with --seeds or --folds) every seed and fold is evaluated on its own bars and reported together.",
    )
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fitdqn train")
    evaluate.add_argument("--split", choices=SPLITS, default="test",
                          help="which bars to backtest on (default: %(default)s)")
    evaluate.add_argument("--device", default="auto", help="device to evaluate on (default: %(default)s)")
    add_network_option(evaluate)
    evaluate.set_defaults(run=run)
    return evaluate


def run(args: argparse.Namespace) -> int:
    # the backtest imports torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.train.run import evaluate_run
    from fitdqn.train.study import STUDY_NAME, evaluate_study

    run_dir = Path(args.run_dir)
    with writing_into(run_dir, run_dir):  # one writer per run directory (a study's members: each in turn)
        if (run_dir / STUDY_NAME).is_file():
            evaluate_study(run_dir, args.split, args.device, network=args.network)
        else:
            evaluate_run(run_dir, args.split, args.device, network=args.network)
    return 0
