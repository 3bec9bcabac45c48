"""Real bars, walk-forward, several seeds: the agent beside buy-and-hold, the rules and random, Sharpe with
bootstrap intervals. One study per data set (:func:`fitdqn.train.study.run_study`, what
``fitdqn train --seeds N --folds K`` runs), then one table for all of them.

    python benchmarks/real_bars.py --out runs/real_bars                           # sp500 + nasdaq, 5 seeds, 4 folds
    python benchmarks/real_bars.py --data sp500 --seeds 5 --folds 4 --config run.toml --set train.epochs=30
    python benchmarks/real_bars.py --paired A/real_bars.json B/real_bars.json    # two studies, member by member

Writes ``real_bars.json`` (every study's summary, the machine, the commit) and ``real_bars.md`` (the table
for BENCHMARKS.md) into --out; each study's run directories are under ``--out/<data>``. Running the same
command again continues where it stopped (finished runs are read back). ``--paired`` compares two such files
(e.g. a setting and its default, the same seeds and folds): per data set, the differences of the members'
validation Sharpe (what chose each network) and test Sharpe, seed and fold matched, mean +- standard error.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import write_json
from rich.console import Console

from fitdqn.config import Config, load_config, with_overrides
from fitdqn.evaluate.compare import POLICIES
from fitdqn.evaluate.report import fmt, fmt_ci, policy_label
from fitdqn.provenance import code_commit
from fitdqn.train.study import run_study


def parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item}: write KEY=VALUE, e.g. train.epochs=30")
        out[key] = value
    return out


def table(studies: dict[str, dict[str, Any]], config: Config) -> str:
    """Markdown: one row per data set and policy, the pooled test Sharpe with its interval."""
    level = f"{100 * config.evaluate.confidence:g} %"
    lines = [f"| data | policy | pooled test Sharpe | {level} interval | seeds: median (range) |",
             "|---|---|---:|---|---|"]
    for data, summary in studies.items():
        for name in [p for p in POLICIES if p in summary["pooled"]]:
            entry = summary["pooled"][name]
            seeds = ""
            if name == "agent":
                low, high = summary["sharpe_range"] or (None, None)
                seeds = f"{fmt(summary['median_sharpe'], 2)} ({fmt(low, 2)} .. {fmt(high, 2)})"
            ensemble = summary.get("agent_book") == "ensemble"
            label = policy_label(name, config) if name != "agent" else (
                "agent (the seeds' ensemble)" if ensemble else "agent (seeds' average book)")
            lines.append(f"| {data} | {label} | {fmt(entry['sharpe'], 2)} | {fmt_ci(entry['sharpe_ci'])} | {seeds} |")
            if name == "agent" and ensemble:
                average = summary["average_book"]
                lines.append(f"| {data} | seeds' average book | {fmt(average['sharpe'], 2)} | "
                             f"{fmt_ci(average['sharpe_ci'])} | |")
        diff = summary["pooled"]["agent"].get("sharpe_minus_buy_and_hold")
        if diff:
            lines.append(f"| {data} | agent minus buy & hold | {diff['estimate']:+.2f} | {fmt_ci(diff)} | |")
        check = summary["pooled"]["agent"].get("reality_check")
        if check:
            spa = check["some_baseline_beats_agent"] or {}
            lines.append(f"| {data} | reality check: p (agent beats every baseline) / p (some baseline beats it) | "
                         f"{fmt(check['agent_beats_every_baseline'], 3)} / {fmt(spa.get('consistent'), 3)} | | |")
    lines.append("")
    for data, summary in studies.items():
        lines += [f"{data}: {summary['verdict']}", ""]
    return "\n".join(lines)


def paired(first: dict[str, Any], second: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per data set in both records, ``first`` minus ``second`` member by member (the same seed and fold): for
    ``validation_sharpe`` and ``test_sharpe``, the number of pairs, the mean difference, its standard error and
    how many are above zero."""
    out = {}
    for data in [d for d in first["studies"] if d in second["studies"]]:
        others = {(m["seed"], m["fold"]): m for m in second["studies"][data]["members"]}
        out[data] = {}
        for key in ("validation_sharpe", "test_sharpe"):
            diffs = [m[key] - others[(m["seed"], m["fold"])][key] for m in first["studies"][data]["members"]
                     if (m["seed"], m["fold"]) in others and m.get(key) is not None
                     and others[(m["seed"], m["fold"])].get(key) is not None]
            n = len(diffs)
            error = statistics.stdev(diffs) / n ** 0.5 if n > 1 else None
            out[data][key] = {"pairs": n, "mean": statistics.fmean(diffs) if n else None, "standard_error": error,
                              "above": sum(d > 0 for d in diffs)}
    return out


def paired_table(comparison: dict[str, dict[str, Any]], first: str, second: str) -> str:
    lines = [f"{first} minus {second}, member by member (seed and fold matched):", "",
             "| data | Sharpe on | pairs | mean difference | standard error | above zero |",
             "|---|---|---:|---:|---:|---:|"]
    for data, keys in comparison.items():
        for key, entry in keys.items():
            mean = "-" if entry["mean"] is None else f"{entry['mean']:+.3f}"
            lines.append(f"| {data} | {key.removesuffix('_sharpe')} | {entry['pairs']} | {mean} | "
                         f"{fmt(entry['standard_error'], 3)} | {entry['above']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="sp500,nasdaq", help="comma-separated data sets (default: sp500,nasdaq)")
    parser.add_argument("--seeds", type=int, default=5, help="training seeds per data set (default: 5)")
    parser.add_argument("--folds", type=int, default=4, help="walk-forward folds (default: 4)")
    parser.add_argument("--config", help="TOML config for every run (default: the defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--only-seed", type=int, metavar="K",
                        help="train only seed index K's members and report nothing (run several side by side, "
                             "then once without it to read them back and report)")
    parser.add_argument("--out", default="runs/real_bars", help="output directory (default: runs/real_bars)")
    parser.add_argument("--paired", nargs=2, metavar=("A", "B"),
                        help="compare two real_bars.json files member by member (A minus B) and train nothing")
    args = parser.parse_args(argv)
    if args.paired:
        first, second = (json.loads(Path(name).read_text()) for name in args.paired)
        comparison = paired(first, second)
        print(paired_table(comparison, *args.paired))
        return comparison
    base = load_config(args.config) if args.config else Config()
    base = with_overrides(base, {**parse_sets(args.set), "evaluate.seeds": args.seeds, "evaluate.folds": args.folds})
    out = Path(args.out)
    console = Console()
    studies, seconds = {}, {}
    for data in [d for d in args.data.split(",") if d]:
        config = with_overrides(base, {"market.data": data, "train.out": str(out / data)})
        start = time.perf_counter()
        studies[data] = run_study(config, out / data, console,
                                  None if args.only_seed is None else [args.only_seed])
        seconds[data] = time.perf_counter() - start
    if args.only_seed is not None:
        return {"seconds": seconds}
    markdown = table(studies, base)
    import torch

    record = {"command": "python benchmarks/real_bars.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "machine": platform.node(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
              "torch": torch.__version__, "seconds": seconds, "studies": studies}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "real_bars.json", record, announce=False)
    (out / "real_bars.md").write_text(markdown)
    console.print(markdown, soft_wrap=True, markup=False, highlight=False)
    return record


if __name__ == "__main__":
    main()
