"""`fitdqn act`: a run's policy on new bars, the target position and bracket for every bar
(:func:`fitdqn.deploy.act_run`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from fitdqn.cli.common import Commands, add_command, add_network_option, writing_into
from fitdqn.errors import UserError

DECISION_SUFFIXES = (".csv", ".parquet", ".pq")


def add_parser(commands: Commands) -> argparse.ArgumentParser:
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
        "position liquidated at each episode's end. The last row is the decision to trade at the next open. "
        "A study directory (fitdqn train with evaluate.seeds or evaluate.folds > 1) acts with its latest fold's "
        "ensemble: the mean of its members' target positions, the bracket of the member closest to it.",
    )
    act.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fitdqn train, or a study's")
    act.add_argument("--data", required=True, metavar="FILE|NAME",
                     help="bars to act on: a CSV or Parquet file (the columns `fitdqn train` reads), or a built-in "
                     "data set: sp500, nasdaq, or synthetic (the run's own synthetic market)")
    act.add_argument("--out", metavar="FILE.csv|FILE.parquet",
                     help="where to write the decisions (default: RUN_DIR/actions.csv)")
    act.add_argument("--start", metavar="DATE", help="first bar to decide at (earlier bars warm up the features; "
                     "default: the first bar after the warm-up)")
    act.add_argument("--goal-unit", type=float, metavar="FLOAT", help="the goal scale shown to the agent "
                     "(default: from the run's training bars, as in its backtests)")
    act.add_argument("--device", default="cpu", help="device to run the policy on (default: %(default)s)")
    add_network_option(act)
    act.set_defaults(run=run)
    return act


def run(args: argparse.Namespace) -> int:
    # the policy imports torch: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.deploy import act_run, load_run_policy, write_actions
    from fitdqn.device.probe import resolve_device

    out = Path(args.out) if args.out else Path(args.run_dir) / "actions.csv"
    if out.suffix.lower() not in DECISION_SUFFIXES:  # before any work: nothing computed is lost
        raise UserError(f"--out {out}: write the decisions to a .csv or .parquet file")
    if args.goal_unit is not None and not (math.isfinite(args.goal_unit) and args.goal_unit > 0):
        raise UserError(f"--goal-unit {args.goal_unit:g}: the goal scale shown to the agent is a positive "
                        "finite number; leave it out to use the run's own, from its training bars")
    with writing_into(args.run_dir, out):  # decisions written into the run: one writer at a time
        policy = load_run_policy(args.run_dir, resolve_device(args.device), args.network)
        goal_unit = policy.goal_unit() if args.goal_unit is None else args.goal_unit
        frame = act_run(policy, args.data, start=args.start, goal_unit=goal_unit)
        write_actions(frame, out)
    which = (f"ensemble of {len(policy.members)} members ({', '.join(str(d) for d in policy.member_dirs)}), "
             f"{args.network} networks" if policy.members else f"{args.network} network, epoch {policy.epoch}")
    print(f"{len(frame)} decisions, {frame['timestamp'].iloc[0]} to {frame['timestamp'].iloc[-1]}, of the policy in "
          f"{args.run_dir} ({which}, contract {policy.contract.name}, goal unit {goal_unit:.6g}) written to {out}")
    print(f"latest, to trade at the next open: {decision_text(frame.iloc[-1])}")
    return 0


def decision_text(row) -> str:
    """One decision row in words: target and bracket."""
    whole = "" if row["target_whole"] == row["target"] else f", {row['target_whole']:+g} in whole contracts"
    parts = [f"bar {row['timestamp']}: hold {row['target']:+.3g} contracts{whole} (now {row['held']:+.3g})"]
    if row["target"] != 0:
        for name, k, price in (("stop", row["stop_atr"], row["stop_price"]),
                               ("take-profit", row["take_profit_atr"], row["take_profit_price"])):
            parts.append(f"{name} {k:g} x ATR = {price:g}" if k > 0 else f"no {name}")
    return ", ".join(parts)
