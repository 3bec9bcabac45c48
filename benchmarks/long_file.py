"""A long file end to end: `fitdqn train --data FILE` on a seeded 2,000,000-bar one-minute OHLCV file, with the
wall time of each phase and the peak RSS of the training process.

    # generate the file (once; about 120 MB of CSV), then train on it and write the figures:
    python benchmarks/long_file.py --bars 2000000 --out benchmarks/results/long_file.json
    # on a GPU: the same command (`train.device = auto` takes the GPU), or `--set train.device=cuda`

The file: 24x5 one-minute bars (weekends left out) from 2015-01-05, with minute-scale volatility (about 0.04 %
a minute, ~1.5 % a day), an intraday U-shaped volatility profile, a slow log-normal volatility wander, a small
planted one-bar momentum edge, intrabar wicks and volume that rises with volatility. Its log price is a random
walk of about 0.6 standard deviations over 2 M bars, so prices stay far inside fitdqn's bounds (the built-in
`synthetic` market has daily volatility and drifts out of them beyond ~150 k bars).

The run: `python -m fitdqn train --data FILE --epochs E --out DIR` (plus any `--set key=value` as
`--key value`) in a child process with `PYTHONUNBUFFERED=1`. Each line the child prints is timestamped as it
arrives; the phases are cut at its own lines: start-up (imports, up to "run directory:"), setup (loading the
bars and building features, planning, allocating: up to the last line before "epoch 1/"), the epochs (collect
+ update, and the validation backtests at `train.eval_every` and at the last epoch), the checkpoint and the
final report (choosing the network on validation, validation and test backtests beside the baselines, plots).
Inside those, a small bootstrap times the library's own calls in the child (`load_market`, `plan_for_device`,
`evaluate_split`) where they exist. Peak RSS is the child's `ru_maxrss` (`RUSAGE_CHILDREN`, after it exits);
`/proc/PID/status` is also sampled every second for the peak within each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _common import write_json
from scipy.signal import lfilter

from fitdqn.provenance import code_commit

REPO = Path(__file__).resolve().parent.parent

# The child: time the library's own calls where they exist (names may move; a missing one is skipped), then run
# the CLI exactly as `python -m fitdqn` does. Wrapping a module attribute before the importers bind it makes
# every later `from module import name` get the timed one.
BOOTSTRAP = r"""
import atexit, functools, importlib, json, os, runpy, sys, time
calls = []
def timed(module, name, label):
    try:
        mod = importlib.import_module(module)
        inner = getattr(mod, name)
    except (ImportError, AttributeError):
        return
    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return inner(*args, **kwargs)
        finally:
            split = args[3] if label == "evaluate_split" and len(args) > 3 else kwargs.get("split")
            calls.append({"call": label, "start": start, "end": time.time(),
                          "split": split if isinstance(split, str) else None,
                          "baselines": kwargs.get("baselines", True) if label == "evaluate_split" else None})
    setattr(mod, name, wrapper)
timed("fitdqn.market.loader", "load_market", "load_market")
timed("fitdqn.plan.plan_cache", "plan_for_device", "plan_for_device")
timed("fitdqn.plan.build", "plan_for_device", "plan_for_device_uncached")
timed("fitdqn.evaluate.compare", "evaluate_split", "evaluate_split")
atexit.register(lambda: open(os.environ["LONG_FILE_CALLS"], "w").write(json.dumps(calls)))
sys.argv = ["fitdqn"] + sys.argv[1:]
runpy.run_module("fitdqn", run_name="__main__", alter_sys=True)
"""


def generate(path: Path, bars: int, seed: int, signal_strength: float = 0.05) -> dict:
    """Write ``bars`` seeded one-minute bars (24x5) to ``path`` (.csv or .parquet); returns a summary."""
    rng = np.random.default_rng(seed)
    n = int(bars)
    minutes = pd.date_range("2015-01-05", periods=int(n * 7 / 5) + 3 * 1440, freq="min")  # Monday 00:00
    stamps = minutes[minutes.day_of_week < 5][:n]  # [n] Monday-Friday, around the clock
    minute_of_day = (stamps.hour * 60 + stamps.minute).to_numpy()  # [n]
    # intraday U shape: quiet mid-session, busy at the day's start and end (x0.7 .. x1.5)
    intraday = 0.7 + 0.8 * (np.cos(2 * np.pi * minute_of_day / 1440) ** 2)  # [n]
    wander = lfilter([1.0], [1.0, -0.9995], rng.normal(0.0, 0.01, n))  # [n] AR(1) log-vol, sd ~0.22
    sigma = 4e-4 * intraday * np.exp(wander)  # [n] per-minute log-return volatility
    eps = rng.normal(0.0, 1.0, n)
    drift = 0.002
    # z_t = signal * z_{t-1} + eps_t + drift: the close-to-close return in units of its volatility (AR(1))
    z = lfilter([1.0], [1.0, -signal_strength], eps + drift)  # [n]
    log_close = np.log(2000.0) + np.cumsum(sigma * z)  # [n]
    log_open = np.concatenate([[np.log(2000.0)], log_close[:-1]]) + sigma * rng.normal(0.0, 0.05, n)
    open_, close = np.exp(log_open), np.exp(log_close)
    high = np.maximum(open_, close) * np.exp(sigma * np.abs(rng.normal(0.0, 0.5, n)))
    low = np.minimum(open_, close) * np.exp(-sigma * np.abs(rng.normal(0.0, 0.5, n)))
    open_, high, low, close = (np.round(x, 2) for x in (open_, high, low, close))
    high = np.maximum(high, np.maximum(open_, close))
    low = np.minimum(low, np.minimum(open_, close))
    level = lfilter([1.0], [1.0, -0.9], rng.normal(0.0, 0.25, n))  # [n] persistent volume noise
    volume = np.round(np.exp(np.log(500.0) + 0.8 * np.log(sigma / 4e-4) + 0.15 * np.minimum(np.abs(z), 5) + level))
    frame = pd.DataFrame({"timestamp": stamps, "open": open_, "high": high, "low": low, "close": close,
                          "volume": volume})
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".parquet", ".pq"):
        frame.to_parquet(path, index=False)
    else:
        frame.to_csv(path, index=False, date_format="%Y-%m-%d %H:%M:%S", float_format="%.2f")
    return {"bars": n, "first": str(stamps[0]), "last": str(stamps[-1]), "seed": seed,
            "close_min": float(close.min()), "close_max": float(close.max()),
            "daily_volatility": float(np.std(np.diff(log_close)) * np.sqrt(1440)),
            "bytes": path.stat().st_size}


def rss_sampler(pid: int, samples: list, done: threading.Event) -> None:
    """Append (time, VmRSS MiB) of ``pid`` every second until ``done``."""
    status = Path(f"/proc/{pid}/status")
    while not done.is_set():
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    samples.append((time.time(), int(line.split()[1]) / 1024))
        except OSError:
            return
        done.wait(1.0)


def phases(lines: list[tuple[float, str]], start: float, end: float) -> dict[str, tuple[float, float]]:
    """Cut the child's timeline at its own lines (see the module docstring); phases not reached are left out."""
    def first(prefix: str, after: float = 0.0) -> float | None:
        return next((t for t, text in lines if text.startswith(prefix) and t >= after), None)

    cuts: dict[str, tuple[float, float]] = {}
    run_dir = first("run directory:")
    epoch_lines = [t for t, text in lines if text.startswith("epoch ") and "/" in text.split()[1]]
    if run_dir is None:
        return {"start-up": (start, end)}
    cuts["start-up"] = (start, run_dir)
    if not epoch_lines:
        cuts["setup"] = (run_dir, end)
        return cuts
    setup_end = max(t for t, _ in lines if t < epoch_lines[0])
    cuts["setup"] = (run_dir, setup_end)
    cuts["epochs"] = (setup_end, epoch_lines[-1])
    checkpoint = first("checkpoint.pt:", epoch_lines[-1])
    if checkpoint is None:
        cuts["after the epochs"] = (epoch_lines[-1], end)
        return cuts
    cuts["checkpoint"] = (epoch_lines[-1], checkpoint)
    cuts["final report"] = (checkpoint, end)
    return cuts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bars", type=int, default=2_000_000, help="bars in the file (default 2000000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated file (default 0)")
    parser.add_argument("--file", type=Path, help="where the file is (generated if missing; default "
                        "/tmp/fitdqn_long_file/minute_<bars>_s<seed>.csv)")
    parser.add_argument("--epochs", type=int, default=2, help="train.epochs (default 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more train options, e.g. --set train.device=cuda (passed as --KEY VALUE)")
    parser.add_argument("--costs", choices=("zero", "derived"), default="zero",
                        help="zero (default): a contract spec with no commission or slippage, so that no backtest "
                        "ends early at a ruined account and every one steps its whole split; derived: "
                        "market.contract = auto (1.5 bp a side), which ruins an untrained policy within a few "
                        "thousand minute bars")
    parser.add_argument("--run-dir", type=Path, help="the run directory (default: a new one under /tmp)")
    parser.add_argument("--timeout", type=float, default=0, help="stop the run after this many seconds and "
                        "report the phases it finished (0: no limit)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)

    path = args.file or Path(f"/tmp/fitdqn_long_file/minute_{args.bars}_s{args.seed}.csv")
    data: dict = {"file": str(path)}
    summary = path.with_name(path.name + ".json")  # what generate() said about the file
    if not path.is_file():
        start = time.perf_counter()
        facts = generate(path, args.bars, args.seed) | {"generate_seconds": round(time.perf_counter() - start, 1)}
        summary.write_text(json.dumps(facts, indent=2))
    if summary.is_file():
        data |= json.loads(summary.read_text())
    data["bytes"] = path.stat().st_size
    run_dir = args.run_dir or Path(f"/tmp/fitdqn_long_file/run_{time.strftime('%Y%m%d-%H%M%S')}")
    calls_file = run_dir.parent / f"{run_dir.name}.calls.json"
    command = ["train", "--data", str(path), "--epochs", str(args.epochs), "--out", str(run_dir)]
    if args.costs == "zero":
        spec = path.with_name("minute_zero_cost.toml")
        spec.write_text('name = "minute-zero-cost"\ndescription = "benchmarks/long_file.py: no costs"\n'
                        'currency = "USD"\nmultiplier = 1.0\ntick_size = 0.01\ncommission = 0.0\n'
                        'slippage_ticks = 0.0\n')
        command += ["--market.contract", str(spec)]
    for item in args.set:
        key, _, value = item.partition("=")
        command += [f"--{key}", value]
    env = dict(os.environ, PYTHONUNBUFFERED="1", LONG_FILE_CALLS=str(calls_file))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    print("python -m fitdqn " + " ".join(command), flush=True)

    lines: list[tuple[float, str]] = []
    samples: list[tuple[float, float]] = []
    start = time.time()
    child = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, *command], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
    done = threading.Event()
    sampler = threading.Thread(target=rss_sampler, args=(child.pid, samples, done), daemon=True)
    sampler.start()
    timer = None
    timed_out = threading.Event()
    if args.timeout > 0:
        def stop() -> None:
            timed_out.set()
            child.send_signal(signal.SIGINT)  # stops at the end of the epoch, or at once outside the epochs
            time.sleep(60)
            if child.poll() is None:
                child.kill()
        timer = threading.Timer(args.timeout, stop)
        timer.daemon = True
        timer.start()
    assert child.stdout is not None
    for text in child.stdout:
        lines.append((time.time(), text.rstrip("\n")))
        print(f"[{lines[-1][0] - start:7.1f} s] {text}", end="", flush=True)
    returncode = child.wait()
    end = time.time()
    done.set()
    if timer is not None:
        timer.cancel()
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux: KiB -> MiB

    calls = json.loads(calls_file.read_text()) if calls_file.is_file() else []
    cut = phases(lines, start, end)
    phase_rows = {}
    for name, (a, b) in cut.items():
        inside = [mib for t, mib in samples if a <= t <= b]
        phase_rows[name] = {"seconds": round(b - a, 2), "peak_rss_mib_sampled": round(max(inside), 1) if inside
                            else None}
    call_rows = [{"call": c["call"], "split": c["split"], "baselines": c["baselines"],
                  "start_s": round(c["start"] - start, 2), "seconds": round(c["end"] - c["start"], 2)} for c in calls]
    metrics = []
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file():
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else {}
    result = {
        "what": "fitdqn train --data FILE end to end on a generated one-minute file",
        "command": "python -m fitdqn " + " ".join(command),
        "benchmark_command": "python benchmarks/long_file.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "data": data, "returncode": returncode, "timed_out": timed_out.is_set(),
        "wall_seconds": round(end - start, 2), "peak_rss_mib": round(peak_rss, 1),
        "phases": phase_rows, "calls": call_rows,
        "epochs": [{k: r.get(k) for k in ("epoch", "seconds", "updates", "env_steps_per_s", "updates_per_s",
                                          "validation_sharpe")} for r in metrics if r.get("kind") == "epoch"],
        "report": {k: report.get(k) for k in ("bars", "epochs", "updates", "batch_size", "env_steps", "device",
                                             "planned_memory")} if report else None,
        "test_bars": report.get("test", {}).get("bars") if report else None,
        "validation_bars": report.get("validation", {}).get("bars") if report else None,
        "threads": os.environ.get("OMP_NUM_THREADS"), "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d"),
        "commit": code_commit(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    print(json.dumps({k: result[k] for k in ("wall_seconds", "peak_rss_mib", "phases", "calls")}, indent=2))
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
