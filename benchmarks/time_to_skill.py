"""Time to skill: seconds from the start of `fitdqn train --data synthetic` (default config) to a skilled network.

    PYTHONPATH=src python benchmarks/time_to_skill.py --seeds 0,1,2 --out benchmarks/results/time_to_skill.json
    PYTHONPATH=src python benchmarks/time_to_skill.py --seeds 0 --set train.device=cpu --out cpu.json   # a CPU run

The definition (what a user of the defaults would see): the run is the library's ``train`` (what the command
calls) on the synthetic market with the default config and seed S, started in this process. At every validation
backtest the run already does (``train.eval_every`` epochs), the network that validation has chosen so far is
the one in ``best.pt`` (the highest validation Sharpe yet, as the run keeps it). Each time that choice changes,
this script backtests the chosen network on the test split (the same backtest as the final report's, with the
random generators' states saved and restored, so the run goes on as it would without it); the test split
chooses nothing. **Time to skill** = seconds from the ``train`` call (planning, allocation, compiling and graph
capture included; the interpreter's start and imports reported apart, as ``import_s``) to the end of the first
validation backtest after which the chosen network's test Sharpe is at least ``--threshold`` (default 1.0), not
counting the seconds of this script's own test backtests. A run that never gets there reports ``null`` and its
best. The run goes on to its last epoch, so the final report's test Sharpe is there too, beside buy-and-hold
(the chosen network at the end is the one backtested last, so the two figures agree).
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _common import write_json  # noqa: E402
from rich.console import Console  # noqa: E402

from fitdqn.config import Config, with_overrides  # noqa: E402
from fitdqn.evaluate.compare import evaluate_split  # noqa: E402
from fitdqn.provenance import code_commit  # noqa: E402
from fitdqn.train.run import train  # noqa: E402

IMPORT_S = time.perf_counter() - PROCESS_START


class SkillClock:
    """``trainer_hook`` and ``on_epoch`` for :func:`fitdqn.train.run.train`: the chosen network's test Sharpe at
    each validation backtest, on a clock that leaves out its own backtests."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.trainer = None
        self.start = time.perf_counter()
        self.paused = 0.0  # seconds spent in this clock's test backtests
        self.best_validation: float | None = None
        self.best_epoch: int | None = None
        self.best_test: float | None = None
        self.curve: list[dict] = []
        self.skill_s: float | None = None
        self.skill_epoch: int | None = None

    def hook(self, trainer) -> None:
        self.trainer = trainer

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def test_sharpe(self) -> float | None:
        trainer = self.trainer
        begin = time.perf_counter()
        cpu_state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None
        try:
            result = evaluate_split(trainer.system.learner, trainer.system.market, trainer.config, "test",
                                    baselines=False, graphs=trainer.backtests)
            return result.results["agent"]["sharpe"]
        finally:
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, trainer.device)
            self.paused += time.perf_counter() - begin

    def on_epoch(self, record: dict) -> bool:
        score = record.get("validation_sharpe")
        if "validation_sharpe" not in record:
            return False
        at = self.elapsed()
        # best.pt's rule (fitdqn.train.run.keep_best): a validation Sharpe above every earlier one
        if score is not None and (self.best_validation is None or score > self.best_validation):
            self.best_validation, self.best_epoch = score, record["epoch"]
            self.best_test = self.test_sharpe()
        point = {"epoch": record["epoch"], "seconds": at, "validation_sharpe": score,
                 "chosen_epoch": self.best_epoch, "chosen_test_sharpe": self.best_test}
        self.curve.append(point)
        if self.skill_s is None and self.best_test is not None and self.best_test >= self.threshold:
            self.skill_s, self.skill_epoch = at, record["epoch"]
        return False


def run_seed(seed: int, overrides: dict[str, str], threshold: float, keep: Path | None) -> dict:
    config = with_overrides(Config(), {"market.data": "synthetic", "train.seed": seed, **overrides})
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = (keep / f"seed_{seed}") if keep is not None else Path(tmp) / "run"
        clock = SkillClock(threshold)
        report = train(config, run_dir, console=Console(quiet=True), trainer_hook=clock.hook, on_epoch=clock.on_epoch)
        total = clock.elapsed()
    test = report["test"]
    return {
        "seed": seed, "time_to_skill_s": clock.skill_s, "skill_epoch": clock.skill_epoch,
        "run_s": total, "measuring_s": clock.paused, "device": report["device"], "batch_size": report["batch_size"],
        "epochs": report["epochs"], "updates": report["updates"], "samples": report["samples"],
        "env_steps": report["env_steps"], "final_test_sharpe": test["agent"]["sharpe"],
        "final_chosen_epoch": report["selection"]["epoch"], "buy_and_hold_test_sharpe": test["buy_and_hold"]["sharpe"],
        "random_test_sharpe": test["random"]["sharpe"], "curve": clock.curve,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds, one run each")
    parser.add_argument("--threshold", type=float, default=1.0, help="test Sharpe that counts as skill")
    parser.add_argument("--keep", default="", help="keep the run directories under this folder (default: none)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--plot", default="", metavar="PNG", help="the learning curves: the chosen network's test "
                        "Sharpe against seconds, one line a run")
    parser.add_argument("--from", dest="from_files", nargs="+", default=[], metavar="JSON",
                        help="no training: read these results files (e.g. seeds run side by side) and write their "
                             "runs together to --out (and --plot)")
    return parser.parse_args(argv)


def skill_summary(runs: list[dict]) -> dict:
    """How many runs reached the threshold, and their median time to skill."""
    reached = [r["time_to_skill_s"] for r in runs if r["time_to_skill_s"] is not None]
    return {"reached": f"{len(reached)} of {len(runs)}",
            "median_time_to_skill_s": statistics.median(reached) if reached else None}


def plot_curves(result: dict, path: str) -> None:
    """Each run's chosen network's test Sharpe (a step at each new choice) against seconds since the train() call,
    beside the threshold and the test split's buy-and-hold and random."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in result["runs"]:
        points = [p for p in run["curve"] if p["chosen_test_sharpe"] is not None]
        ax.step([p["seconds"] for p in points], [p["chosen_test_sharpe"] for p in points], where="post",
                marker="o", markersize=3, label=f"seed {run['seed']} (batch {run['batch_size']})")
    first = result["runs"][0]
    ax.axhline(result["threshold"], color="grey", linestyle=":", label=f"threshold {result['threshold']:g}")
    ax.axhline(first["buy_and_hold_test_sharpe"], color="black", linestyle="--", label="buy-and-hold")
    ax.axhline(first["random_test_sharpe"], color="tab:red", linestyle="--", label="random")
    ax.set_xlabel("seconds since the train() call")
    ax.set_ylabel("test Sharpe of the network validation chose")
    ax.set_title(f"time to skill, default config, {result['device']} (commit {result['commit']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_files:
        results = [json.loads(Path(f).read_text()) for f in args.from_files]
        runs = [run for r in results for run in r["runs"]]
        merged = {**results[0], **skill_summary(runs), "runs": runs}
        write_json(args.out, merged, announce=False)
        if args.plot:
            plot_curves(merged, args.plot)
        print(f"{len(merged['runs'])} runs; reached in {merged['reached']}; median {merged['median_time_to_skill_s']}"
              f" s; wrote {args.out}")
        return 0
    overrides = dict(item.split("=", 1) for item in args.set)
    keep = Path(args.keep) if args.keep else None
    runs = []
    for seed in (int(s) for s in args.seeds.split(",") if s):
        row = run_seed(seed, overrides, args.threshold, keep)
        runs.append(row)
        print(f"seed {seed}: time to test Sharpe >= {args.threshold:g}: "
              + (f"{row['time_to_skill_s']:.1f} s (epoch {row['skill_epoch']})" if row["time_to_skill_s"] is not None
                 else "not reached")
              + f"; whole run {row['run_s']:.1f} s, final test Sharpe {row['final_test_sharpe']:.2f} "
              f"(buy-and-hold {row['buy_and_hold_test_sharpe']:.2f}), batch {row['batch_size']}", flush=True)
    result = {
        "definition": "seconds from the train() call to the end of the first validation backtest after which the "
                      "validation-chosen network (best.pt) has test Sharpe >= threshold; this script's own test "
                      "backtests not counted",
        "threshold": args.threshold, "overrides": overrides, "device": runs[0]["device"] if runs else None,
        "torch": torch.__version__, "commit": code_commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "import_s": IMPORT_S, **skill_summary(runs), "runs": runs,
    }
    write_json(args.out, result, announce=False)
    if args.plot:
        plot_curves(result, args.plot)
    print(f"reached in {result['reached']} runs; median {result['median_time_to_skill_s']} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
