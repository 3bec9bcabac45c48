"""Does it learn: `fitdqn train` runs on the synthetic market, one seed per call, beside the baselines.

    # one run (the default config; any --set key=value overrides it), its figures as JSON:
    python benchmarks/learning.py run --seed 0 --out results/cpu_default_s0.json [--set train.device=cpu ...]
    # the median and range over runs, a markdown table (and a learning-curve PNG with --plot):
    python benchmarks/learning.py summary results/cpu_default_s*.json [--plot curve.png]
    # a variant against a base, seed by seed: the mean paired difference and its standard error per split
    python benchmarks/learning.py compare --base results/cpu_default_s*.json --variant results/cpu_x_s*.json

Each run records the test and validation Sharpe of the agent, buy-and-hold, a random policy and the last-bar
momentum rule (the report's: the largest position in the direction of the decision bar's return, sized as the
agent's positions are, no stop or take-profit; under `momentum`), the report's intervals of the agent's Sharpe
minus each baseline's, the
wall-clock seconds of the whole `train` call (plan, allocation, training and the backtests), the updates and
samples it made, and its learning curve: validation Sharpe against the seconds trained so far.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json
from rich.console import Console

from fitdqn.config import Config, with_overrides
from fitdqn.provenance import code_commit
from fitdqn.train.logs import read_jsonl
from fitdqn.train.run import train


def run(args: argparse.Namespace) -> None:
    overrides = dict(item.split("=", 1) for item in args.set)
    config = with_overrides(Config(), {"market.data": "synthetic", "train.seed": args.seed, **overrides})
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        start, cpu_start = time.perf_counter(), time.process_time()
        report = train(config, run_dir, console=Console(quiet=True))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        epochs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"]
    elapsed, curve = 0.0, []
    for record in epochs:
        elapsed += record["seconds"]
        if "validation_sharpe" in record:
            curve.append({"epoch": record["epoch"], "train_seconds": elapsed, "validation_sharpe":
                          record["validation_sharpe"]})
    result = {
        "seed": args.seed, "overrides": overrides, "device": report["device"], "commit": code_commit(),
        "date": time.strftime("%Y-%m-%d"), "seconds": seconds, "cpu_seconds": cpu_seconds, "train_seconds": elapsed,
        "batch_size": report["batch_size"], "updates": report["updates"], "samples": report["samples"],
        "env_steps": report["env_steps"], "reward": report["reward"], "curve": curve,
    }
    for split in ("validation", "test"):
        r = report[split]
        result[split] = {"agent": r["agent"]["sharpe"], "buy_and_hold": r["buy_and_hold"]["sharpe"],
                         "random": r["random"]["sharpe"], "momentum": r["last_bar_momentum"]["sharpe"],
                         # the report's paired intervals: the agent's Sharpe minus each baseline's, same bars
                         "agent_minus": {"buy_and_hold": r["agent"].get("sharpe_minus_buy_and_hold"),
                                         **r["agent"].get("sharpe_minus_rules", {})}}
    write_json(args.out, result, announce=False)
    print(json.dumps({k: result[k] for k in ("seed", "seconds", "updates", "batch_size", "test")}))


def read_runs(paths: list[str]) -> list[dict]:
    """The runs in ``paths``: each file holds one run (``run --out``) or a list of them (``summary --bundle``)."""
    runs: list[dict] = []
    for path in paths:
        content = json.loads(Path(path).read_text())
        runs.extend(content if isinstance(content, list) else [content])
    return runs


def summary(args: argparse.Namespace) -> None:
    runs = read_runs(args.files)
    if args.bundle:  # one file for many runs: a results folder (or a device's return) keeps one file, not N
        write_json(args.bundle, runs, announce=False)
    print(f"{len(runs)} runs on {runs[0]['device']}, batch {sorted({r['batch_size'] for r in runs})}, "
          f"updates {sorted({r['updates'] for r in runs})}, commit {sorted({r['commit'] for r in runs})}")
    print("| split | policy | median Sharpe | range |")
    print("|---|---|---:|---|")
    for split in ("validation", "test"):
        for policy in ("agent", "buy_and_hold", "random", "momentum"):
            values = [r[split][policy] for r in runs]
            print(f"| {split} | {policy} | {statistics.median(values):.2f} | {min(values):.2f} .. {max(values):.2f} |")
    for split in ("validation", "test"):
        print(split_differences(runs, split))
    times = [r["seconds"] for r in runs]
    print(f"wall-clock seconds per run (whole train call): median {statistics.median(times):.0f}, "
          f"range {min(times):.0f} .. {max(times):.0f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in runs:
            ax.plot([p["train_seconds"] for p in r["curve"]], [p["validation_sharpe"] for p in r["curve"]],
                    marker="o", label=f"seed {r['seed']}")
        ax.axhline(statistics.median(r["validation"]["buy_and_hold"] for r in runs), color="grey", ls="--",
                   label="buy and hold")
        ax.axhline(statistics.median(r["validation"]["momentum"] for r in runs), color="black", ls=":",
                   label="last-bar momentum")
        ax.set_xlabel("training seconds")
        ax.set_ylabel("validation Sharpe")
        ax.set_title(f"fitdqn train --data synthetic on {runs[0]['device']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


def split_differences(runs: list[dict], split: str, rule: str = "last_bar_momentum") -> str:
    """The agent minus ``rule`` on ``split`` (the report's paired bootstrap, same bars): the median difference
    and how many runs' intervals lie above zero, below it, or straddle it."""
    diffs = [r[split].get("agent_minus", {}).get(rule) for r in runs]
    diffs = [d for d in diffs if d and d.get("low") is not None]
    if not diffs:
        return f"{split}: no agent-minus-{rule} intervals in these runs"
    above = sum(d["low"] > 0 for d in diffs)
    below = sum(d["high"] < 0 for d in diffs)
    return (f"{split}: agent minus {rule}, median {statistics.median(d['estimate'] for d in diffs):+.2f}; "
            f"intervals above zero {above}, below {below}, straddling {len(diffs) - above - below} of {len(diffs)}")


def paired(base: list[dict], variant: list[dict], split: str) -> dict:
    """The variant's agent minus the base's on ``split``, over the seeds both have: mean, standard error,
    how many seeds are positive, and the two medians."""
    by_seed = {r["seed"]: r[split]["agent"] for r in base}
    pairs = [(by_seed[r["seed"]], r[split]["agent"]) for r in variant if r["seed"] in by_seed]
    if len(pairs) < 2:
        raise SystemExit(f"compare: {len(pairs)} seed(s) in both sets; pairing needs at least 2")
    differences = [v - b for b, v in pairs]
    return {"seeds": len(pairs), "mean": statistics.fmean(differences),
            "standard_error": statistics.stdev(differences) / len(differences) ** 0.5,
            "positive": sum(d > 0 for d in differences), "base_median": statistics.median(b for b, _ in pairs),
            "variant_median": statistics.median(v for _, v in pairs)}


def compare(args: argparse.Namespace) -> None:
    base, variant = read_runs(args.base), read_runs(args.variant)
    print("| split | seeds | base median | variant median | paired difference (+- s.e.) | seeds above |")
    print("|---|---:|---:|---:|---|---:|")
    for split in ("validation", "test"):
        p = paired(base, variant, split)
        print(f"| {split} | {p['seeds']} | {p['base_median']:.2f} | {p['variant_median']:.2f} | "
              f"{p['mean']:+.3f} +- {p['standard_error']:.3f} | {p['positive']} |")
    print("choose on the validation row (the test split chooses nothing)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one training run, its figures as JSON")
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--out", required=True)
    one.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    many = sub.add_parser("summary", help="median and range over run files")
    many.add_argument("files", nargs="+", help="run files (one run each, or a bundle of runs)")
    many.add_argument("--bundle", default="", help="also write all the runs read into this one JSON file (a list)")
    many.add_argument("--plot", default="", help="learning-curve PNG")
    pair = sub.add_parser("compare", help="a variant against a base, paired by seed")
    pair.add_argument("--base", nargs="+", required=True, help="the base's run files or bundles")
    pair.add_argument("--variant", nargs="+", required=True, help="the variant's run files or bundles")
    args = parser.parse_args(argv)
    {"run": run, "summary": summary, "compare": compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
