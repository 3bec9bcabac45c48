"""K trials at once on one GPU, each planned and capped within its own plan's share, against one trial alone.

Runs two studies of the same config (the default networks on the synthetic market, only ``learn.lr`` searched, which
moves no memory) through ``fitdqn.tune.run_tune``: one trial alone (``--parallel 1``: uncapped), then K trials at
once (``--parallel K``: each worker capped with ``torch.cuda.set_per_process_memory_fraction`` at its share, from
its plan: ``fitdqn.schedule.shares``). Reports per trial: its cap, planned bytes, peak reserved bytes, batch, OOM
events and steady samples/s (updates x batch / epoch seconds, from the third epoch to the one before the last); the
K trials' combined samples/s over the wall-clock window in which all of them were in steady epochs (each trial's
rate over its whole epochs inside that window, summed); the device's peak used memory (``nvidia-smi`` every 0.2 s).
Checks: every trial complete, zero OOMs, planned <= cap, peak reserved <= cap, cap <= free / K (K trials at once).
The machine needs fitdqn's dependencies and optuna importable (``pip install -e '.[tune]'``).

    PYTHONPATH=src python benchmarks/tune_parallel.py --parallel 4 --epochs 12 \\
        --out benchmarks/results/h200_tune_parallel.json
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from _common import write_json
from rich.console import Console

from fitdqn.config import Config, with_overrides
from fitdqn.provenance import code_commit
from fitdqn.schedule.scheduler import probe_shares
from fitdqn.tune.runner import run_tune
from fitdqn.tune.space import parse_search_space

SEARCH = {"learn.lr": {"low": 3e-5, "high": 3e-4, "log": True}}
WARMUP_EPOCHS = 2  # capture, compile and the replay's first fill happen here


class MemoryMonitor:
    """Peak of the device's used memory, as the driver reports it (all processes), from nvidia-smi."""

    def __init__(self, index: int) -> None:
        self.peak_mib = 0
        self.total_mib = 0
        self.samples = 0
        if shutil.which("nvidia-smi") is None:
            self.process = None
            return
        self.process = subprocess.Popen(
            ["nvidia-smi", "-i", str(index), "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
             "-lms", "200"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                used, total = (int(v) for v in line.strip().split(","))
            except ValueError:
                continue
            self.peak_mib, self.total_mib, self.samples = max(self.peak_mib, used), total, self.samples + 1

    def stop(self) -> dict:
        if self.process is not None:
            self.process.terminate()
            self.process.wait()
        return {"peak_used_bytes": self.peak_mib * 2**20, "total_bytes": self.total_mib * 2**20,
                "samples": self.samples} if self.process is not None else {"note": "no nvidia-smi"}


def steady_epochs(timeline: list[dict]) -> list[dict]:
    """Epochs after the warm-up ones, less the last (its record ends after the validation backtest); each with
    ``start``: when the one before it was recorded."""
    ends = {e["epoch"]: e["end"] for e in timeline}
    last = max(ends, default=0)
    return [{**e, "start": ends[e["epoch"] - 1]} for e in timeline
            if WARMUP_EPOCHS < e["epoch"] < last and e["epoch"] - 1 in ends and e["updates"]]


def samples_per_s(epochs: list[dict]) -> float:
    """Updates x batch over the epochs' own seconds (collect + update)."""
    seconds = sum(e["seconds"] for e in epochs)
    return sum(e["updates"] * e["batch_size"] for e in epochs) / seconds if seconds else 0.0


def combined_rate(timelines: list[list[dict]]) -> dict:
    """Samples/s of all trials together over the wall-clock window in which every one was in its steady epochs
    (logging between epochs included)."""
    steady = [steady_epochs(t) for t in timelines]
    if not all(steady):
        return {"samples_per_s": None, "window_s": 0.0, "note": "a trial had no steady epoch: give more --epochs"}
    start = max(epochs[0]["start"] for epochs in steady)
    end = min(epochs[-1]["end"] for epochs in steady)
    inside = [[e for e in epochs if e["start"] >= start and e["end"] <= end] for epochs in steady]
    if end <= start or not all(inside):
        return {"samples_per_s": None, "window_s": 0.0, "note": "the trials' steady epochs did not overlap"}
    # each trial's wall-clock rate over its whole epochs inside the common window, summed
    rates = [sum(e["updates"] * e["batch_size"] for e in epochs) / (epochs[-1]["end"] - epochs[0]["start"])
             for epochs in inside]
    return {"samples_per_s": sum(rates), "trial_samples_per_s": rates, "window_s": end - start,
            "epochs_in_window": [len(e) for e in inside]}


def study_rows(study) -> list[dict]:
    rows = []
    for trial in study.get_trials():
        attrs = trial.user_attrs
        timeline = attrs.get("timeline", []) or []
        rows.append({
            "trial": trial.number, "state": trial.state.name, "error": attrs.get("error"),
            "value": trial.value, "params": trial.params, "batch_size": attrs.get("batch_size"),
            "allocator_limit_bytes": attrs.get("allocator_limit_bytes"), "planned_bytes": attrs.get("planned_bytes"),
            "peak_reserved_bytes": attrs.get("peak_reserved_bytes"), "ooms": attrs.get("ooms"),
            "steady_samples_per_s": samples_per_s(steady_epochs(timeline)), "seconds": attrs.get("seconds"),
            "timeline": timeline,
        })
    return rows


def run_phase(config: Config, name: str, parallel: int, tune_dir: Path, gpu_index: int) -> dict:
    config = with_overrides(config, {"tune.dir": str(tune_dir / name), "tune.study": name, "tune.trials": parallel,
                                     "tune.parallel": parallel, "tune.sampler": "random", "tune.pruner": "none"})
    free_before = probe_shares(config.train.device, [])["device"]
    console = Console(file=io.StringIO(), width=160)
    monitor = MemoryMonitor(gpu_index)
    started = time.time()
    study = run_tune(config, parse_search_space(SEARCH, config), console)
    wall = time.time() - started
    memory = monitor.stop()
    rows = study_rows(study)
    share = free_before["free_bytes"] / parallel
    checks = {
        "all_complete": all(r["state"] == "COMPLETE" for r in rows),
        "zero_ooms": all(r["ooms"] == 0 for r in rows),
        "planned_within_cap": all(r["allocator_limit_bytes"] is None or r["planned_bytes"] <= r["allocator_limit_bytes"]
                                  for r in rows),
        "peak_reserved_within_cap": all(r["allocator_limit_bytes"] is None or r["peak_reserved_bytes"] is None
                                        or r["peak_reserved_bytes"] <= r["allocator_limit_bytes"] for r in rows),
        "cap_within_share": all(r["allocator_limit_bytes"] is None or r["allocator_limit_bytes"] <= 1.01 * share
                                for r in rows),
    }
    return {"parallel": parallel, "free_bytes_before": free_before["free_bytes"],
            "total_bytes": free_before["total_bytes"], "device": free_before["name"], "share_bytes": int(share),
            "wall_s": wall, "trials": rows, "combined": combined_rate([r["timeline"] for r in rows]),
            "sum_of_trial_samples_per_s": sum(r["steady_samples_per_s"] for r in rows), "device_memory": memory,
            "checks": checks, "log": console.file.getvalue()[-4000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, default=4, help="trials at once in the packed phase (default 4)")
    parser.add_argument("--epochs", type=int, default=12, help="epochs per trial (default 12)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set collect.steps_per_epoch=32 (repeatable)")
    parser.add_argument("--dir", default="/tmp/fitdqn_tune_parallel", help="scratch tune directories (removed first)")
    parser.add_argument("--gpu-index", type=int, default=0, help="nvidia-smi index of the GPU (default 0)")
    parser.add_argument("--skip-alone", action="store_true", help="only the packed phase")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    overrides = {"market.data": "synthetic", "train.device": "cuda", "train.epochs": args.epochs,
                 "train.eval_every": args.epochs, "train.checkpoint_every": args.epochs}
    overrides.update(dict(item.split("=", 1) for item in args.set))
    config = with_overrides(Config(), overrides)
    tune_dir = Path(args.dir)
    shutil.rmtree(tune_dir, ignore_errors=True)
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "config": overrides,
              "search": SEARCH, "commit": code_commit()}
    if not args.skip_alone:
        result["alone"] = run_phase(config, "alone", 1, tune_dir, args.gpu_index)
    result["packed"] = run_phase(config, "packed", args.parallel, tune_dir, args.gpu_index)
    if "alone" in result and result["alone"]["trials"]:
        alone = result["alone"]["combined"]["samples_per_s"]
        combined = result["packed"]["combined"]["samples_per_s"]
        result["speedup_combined_vs_alone"] = combined / alone if combined and alone else None
    summary = {k: v for k, v in result.items() if k not in ("alone", "packed")}
    for phase in ("alone", "packed"):
        if phase in result:
            p = result[phase]
            summary[phase] = {"checks": p["checks"], "wall_s": round(p["wall_s"], 1),
                              "combined": p["combined"], "device_memory": p["device_memory"],
                              "trials": [{k: r[k] for k in ("trial", "state", "batch_size", "allocator_limit_bytes",
                                                            "planned_bytes", "peak_reserved_bytes", "ooms",
                                                            "steady_samples_per_s", "error")} for r in p["trials"]]}
    print(json.dumps(summary, indent=2))
    if args.out:
        write_json(args.out, result)
    ok = all(all(result[p]["checks"].values()) for p in ("alone", "packed") if p in result)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
