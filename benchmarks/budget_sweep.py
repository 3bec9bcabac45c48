"""Does the plan hold on smaller cards? Emulate them on one big GPU and check the planner's promises.

For each emulated card size (default 1.7, 2.5, 4, 8, 16, 24, 40, 80 GiB), in a fresh subprocess (so allocator
caps, caches, graphs and loaded kernels do not leak between cards):

1. emulate the card: its free memory is ``size - memory_reserved()`` (the CUDA context, created first, is
   outside: a real card of that size holds one too), and the plan is made for a ``DeviceInfo`` with exactly
   that free memory (what-if style). On a real card the driver's later loads (kernel images, cuBLAS handles,
   graph executables) come out of that free memory too, but ``torch.cuda.set_per_process_memory_fraction``
   caps only PyTorch's allocator: so the allocator is capped at the free memory *less the driver-side bytes
   the plan budgets* (``cuda_overhead``, from the GPU's profile), and whether the driver kept within that is
   the free-memory check of step 3;
2. plan with ``budget.batch_size = 0`` and ``budget.max_batch`` lifted (so the planned batch is the largest the
   plan says fits, not a clamp), allocate everything (``Trainer``), train 2 short epochs under the trainer's
   ``OomGuard``, each followed by the validation backtest a run makes (as `fitdqn train` does: its default
   stream's cuBLAS workspace and its forward's transients are part of a run), and count out-of-memory errors:
   **must be 0**;
3. compare the plan with what the run took: the allocator's peak reserved bytes (``max_memory_reserved``:
   tensors, CUDA-graph pools, the cache) against the planned bytes less the budgeted driver-side bytes, and the
   drop in driver-level free memory (``mem_get_info``, everything the process took) against all planned bytes:
   **both within +-1.5 %** (``max_memory_allocated`` is recorded too: it leaves out the graph pools' slack);
4. with everything else still allocated, find the real largest batch by bisection on the trainer's update
   step (``set_batch_size``, graph re-captured, ``torch.OutOfMemoryError`` caught, cache emptied between
   tries): **planned / largest >= 0.95**. The search stops at the most transitions the replay serves at once
   (``fitdqn.plan.build.sampleable_capacity``), the planner's bound on the batch too: on a card whose memory
   fits more than that (``capped``, the table's ``*``) the plan is judged against the bound.

Under ``set_per_process_memory_fraction`` PyTorch's allocator charges the whole rounded request before it grows an
expandable segment, even when the growth reuses the segment's free end (``alloc_block``; the allocator model's
docstring), and a capture so refused is an out-of-memory error that a real card of that size would not raise. So
the card's ``DeviceInfo`` carries the cap (``allocator_limit_bytes``), as ``probe`` reports it for any capped
process, and the trainer maps the update graph's pool before capturing it (``fitdqn.device.graphs``).

``--emulation ballast`` emulates the card the other way: a second process takes all the GPU's free memory but the
card's size (``BALLAST``), and this one runs *uncapped*, so the limit is the driver's, as on a real card of that
size: the default, since a real card's limit is the driver's. ``--emulation fraction`` is the stricter mode kept
beside it.

Any exception in one card is recorded in that card's row and the sweep goes on. Prints one table, writes JSON.

    python benchmarks/budget_sweep.py --out budget_sweep.json                 # all 8 cards, ballast, ~6 min on an H200
    python benchmarks/budget_sweep.py --emulation fraction --out budget_sweep_fraction.json
    python benchmarks/budget_sweep.py --cards 4,16 --set collect.num_envs=1024 --out sweep_small.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import write_json

from fitdqn.provenance import code_commit

DEFAULT_CARDS = "1.7,2.5,4,8,16,24,40,80"
PEAK_TOLERANCE = 0.015  # reserved peak and driver free-drop within +-1.5 % of the plan
BATCH_RATIO = 0.95  # planned / real largest batch
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cards", default=DEFAULT_CARDS, help="emulated card sizes in GiB, comma-separated")
    parser.add_argument("--out", default="budget_sweep.json", help="JSON results file")
    parser.add_argument("--epochs", type=int, default=2, help="short training epochs per card")
    parser.add_argument("--card-timeout", type=float, default=150.0, help="seconds before a card is abandoned")
    parser.add_argument("--emulation", choices=("ballast", "fraction"), default="ballast",
                        help="cap PyTorch's allocator (fraction) or fill the rest of the GPU from another process "
                             "(ballast)")
    parser.add_argument("--total-seconds", type=float, default=480.0,
                        help="time budget of the whole sweep: cards not started by then are skipped")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set collect.num_envs=1024 (repeatable)")
    parser.add_argument("--child", type=float, help=argparse.SUPPRESS)  # internal: run one card
    parser.add_argument("--result", help=argparse.SUPPRESS)  # internal: the child's JSON file
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ one card
def sweep_config(overrides: list[str]):
    from fitdqn.config import Config, with_overrides

    values = {
        "market.data": "synthetic", "collect.steps_per_epoch": 8,
        "budget.batch_size": 0, "budget.max_batch": 1 << 22, "train.device": "cuda", "train.epochs": 2,
    }
    values.update(dict(item.split("=", 1) for item in overrides))
    return with_overrides(Config(), values)


def steps_for_batch(config, batch: int) -> int:
    """Env steps per epoch so the first epoch already makes ``batch`` (and min_fill) sampleable."""
    envs = config.collect.num_envs
    needed = max(batch, config.replay.min_fill)
    return int(min(max(config.collect.steps_per_epoch, math.ceil(needed / envs) + config.learn.n_step + 2), 256))


class CountingLogger:
    """Stands in for RunLogger under OomGuard: counts the 'oom' events into the card's row as they happen."""

    def __init__(self, row: dict) -> None:
        self.row = row
        self.row.setdefault("oom_events", [])

    def log(self, step, kind, values) -> None:
        if kind == "oom":
            self.row["oom_events"].append({"epoch": step, **values})
            self.row["ooms"] = len(self.row["oom_events"])


def run_card(gib: float, args: argparse.Namespace, row: dict) -> dict:
    """Fill ``row`` as the card goes (an exception part-way leaves what was measured before it)."""
    try:
        from fitdqn.device.probe import configure_allocator

        configure_allocator()  # the allocator settings fitdqn train runs with (before any CUDA allocation)
    except ImportError:
        pass
    import torch
    from rich.console import Console

    from fitdqn.config import with_overrides
    from fitdqn.device.probe import DeviceInfo
    from fitdqn.evaluate.compare import evaluate_split
    from fitdqn.plan.build import sampleable_capacity
    from fitdqn.plan.planner import InfeasiblePlan
    from fitdqn.train.oom import OomGuard
    from fitdqn.train.trainer import Trainer

    started = time.perf_counter()
    row.update(card_gib=gib, ooms=0, status="running", allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    device = torch.device("cuda", 0)
    free_real, total = torch.cuda.mem_get_info(device)  # creates the context (outside the cap)
    cap = int(gib * GIB)
    if cap > free_real:
        row.update(status="skipped", error=f"{gib} GiB is more than the {free_real / GIB:.1f} GiB free here")
        return row
    props = torch.cuda.get_device_properties(device)
    reserved = torch.cuda.memory_reserved(device)
    info = DeviceInfo(
        # the real name, so the plan takes this card's profile (its measured driver-side bytes)
        name=props.name, kind="cuda", index=0, total_bytes=cap, free_bytes=cap - reserved,
        compute_capability=(props.major, props.minor), bf16=torch.cuda.is_bf16_supported(),
        sm_count=props.multi_processor_count, max_threads_per_sm=props.max_threads_per_multi_processor,
    )
    config = sweep_config(args.set)
    driver_budget = planned_driver_bytes(config, info)
    allocator_cap = cap - driver_budget
    row.update(emulation=args.emulation)
    if args.emulation == "ballast":
        row["ballast_free_bytes"] = hold_ballast(cap - reserved, device)  # kept until this process exits
    else:
        torch.cuda.set_per_process_memory_fraction(allocator_cap / total, device)
        # the trainer maps the update graph's pool before capturing it (``fitdqn.device.graphs``): the capped
        # allocator charges a growth its whole request
        info = dataclasses.replace(info, allocator_limit_bytes=allocator_cap)
    row.update(cap_bytes=cap, emulated_free_bytes=info.free_bytes, driver_budget_bytes=driver_budget,
               allocator_cap_bytes=allocator_cap, gpu=props.name, torch=torch.__version__)

    # plan (inside Trainer: batch 0 = auto) and allocate in plan order
    torch.cuda.synchronize(device)
    free_before, _ = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    logger = CountingLogger(row)
    row["phase"] = "allocation"
    try:
        trainer = Trainer(config, info, log=lambda *_: None)
    except InfeasiblePlan as refused:
        row.update(status="refused by the planner", error=str(refused).splitlines()[0])
        return row
    except torch.OutOfMemoryError as error:
        row.update(ooms=1, status="out of memory while allocating", error=str(error).splitlines()[0][:300])
        return row
    plan = trainer.plan
    # epochs long enough that the first one already makes the planned batch sampleable (collection only)
    trainer.config = with_overrides(trainer.config, {
        "collect.steps_per_epoch": steps_for_batch(trainer.config, plan.batch_size)})
    row.update(planned_batch=plan.batch_size, max_fitting_batch=plan.max_fitting_batch,
               planned_bytes=plan.planned_bytes, fixed_bytes=plan.fixed_bytes, per_sample_bytes=plan.per_sample_bytes,
               headroom_bytes=plan.headroom_bytes, replay_capacity=plan.replay_capacity,
               num_envs=trainer.config.collect.num_envs, steps_per_epoch=trainer.config.collect.steps_per_epoch,
               components={c.name: [c.fixed_bytes, c.per_sample_bytes] for c in plan.components})
    row["allocated_bytes"] = int(torch.cuda.memory_allocated(device))
    guard = OomGuard(trainer, Console(quiet=True), logger)
    row["phase"] = "training"
    for _ in range(args.epochs):
        stats = guard.run_epoch()
        # each epoch ends with the run's validation backtest, as `fitdqn train` does (train.eval_every = 1)
        guard.run("evaluation", evaluate_split, trainer.system.learner, trainer.system.market, trainer.config,
                  "validation", baselines=False, graphs=trainer.backtests)
        row.setdefault("epochs", []).append({"updates": stats.updates, "seconds": round(stats.seconds, 3),
                                             "batch": trainer.batch_size})
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    reserved_peak = int(torch.cuda.max_memory_reserved(device))
    planned_allocator = plan.planned_bytes - driver_budget
    row.update(
        updates_done=trainer.updates_done, backtest_pool_growth_bytes=trainer.backtests.grown_bytes,
        allocator_peak_bytes=int(torch.cuda.max_memory_allocated(device)), reserved_peak_bytes=reserved_peak,
        planned_allocator_bytes=planned_allocator, free_drop_bytes=int(free_before - free_after),
        peak_error=(reserved_peak - planned_allocator) / planned_allocator,
        free_drop_error=(free_before - free_after - plan.planned_bytes) / plan.planned_bytes,
    )

    # the real largest batch, everything else allocated
    tries: list[list] = []

    row["phase"] = "bisection"

    def fits(batch: int) -> bool:
        trainer.set_batch_size(batch)
        gc.collect()
        torch.cuda.empty_cache()
        why = ""
        try:
            trainer.train_updates(3)  # warm-up updates, the graph capture, one replay
            torch.cuda.synchronize(device)
            ok = True
        except torch.OutOfMemoryError:
            ok, why = False, "out of memory"
        except RuntimeError as error:  # e.g. a capture ended by the allocator's error: check the GPU still works
            ok, why = False, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            torch.zeros(1, device=device).add_(1)
            torch.cuda.synchronize(device)  # raises if the context is broken: the card's row records it
        trainer.update_graph = None
        gc.collect()
        torch.cuda.empty_cache()
        tries.append([batch, ok, why])
        row["tries"] = tries
        return ok

    # no batch above what the replay serves at once: the planner's bound too (``sampleable_capacity``)
    cap = min(sampleable_capacity(trainer.config, plan.replay_capacity), 1 << 22)
    low = plan.batch_size
    if fits(low):
        high = low
        while low < cap:
            high = min(low * 2, cap)
            if not fits(high):
                break
            low = high
    else:
        high = low
        low = low // 2
        while low >= 1 and not fits(low):
            high, low = low, low // 2
    while low >= 1 and high - low > max(low // 100, 8):
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    row.update(largest_batch=low, batch_ratio=plan.batch_size / low if low >= 1 else None, tries=tries,
               batch_cap=cap, capped=low == cap)
    row.pop("phase", None)
    row["pass_ooms"] = row["ooms"] == 0
    row["pass_peak"] = abs(row["peak_error"]) <= PEAK_TOLERANCE
    row["pass_free_drop"] = abs(row["free_drop_error"]) <= PEAK_TOLERANCE
    row["pass_batch"] = row["batch_ratio"] is not None and row["batch_ratio"] >= BATCH_RATIO
    row["status"] = "ok"
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


BALLAST = """
import sys, torch
target = int(sys.argv[1])  # leave this many bytes free on the device
held = []
while True:
    free, _ = torch.cuda.mem_get_info()
    excess = (free - target) // (2 << 20) * (2 << 20)  # whole 2 MiB: cudaMalloc's granularity here
    if excess <= 0:
        break
    held.append(torch.empty(excess, dtype=torch.uint8, device="cuda"))
print(torch.cuda.mem_get_info()[0], flush=True)
sys.stdin.read()  # hold the memory until the card's process closes the pipe (or exits)
"""


_ballast: list = []  # the ballast process of this card's process


def hold_ballast(free_bytes: int, device) -> int:
    """Start a process that takes the GPU's free memory down to ``free_bytes`` (its own context included) and
    holds it while this process lives; returns the free bytes it left (driver-level, ``mem_get_info``)."""
    import torch

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", str(device.index or 0))}
    process = subprocess.Popen([sys.executable, "-c", BALLAST, str(free_bytes)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    _ballast.append(process)
    line = process.stdout.readline()
    if not line.strip():
        raise RuntimeError(f"the ballast process exited ({process.wait()}) before holding its memory")
    left, _ = torch.cuda.mem_get_info(device)
    if left > free_bytes + (64 << 20) or left < free_bytes - (64 << 20):
        raise RuntimeError(f"the ballast left {left} B free, not {free_bytes} B")
    return int(left)


def planned_driver_bytes(config, info) -> int:
    """The driver-side bytes the plan budgets for this device (its ``cuda_driver`` component)."""
    from fitdqn.config import for_device
    from fitdqn.plan.build import device_overhead_components

    components = device_overhead_components(for_device(config, "cuda"), info)
    return sum(c.fixed_bytes for c in components if c.name == "cuda_driver")


def child_main(args: argparse.Namespace) -> int:
    row: dict = {"card_gib": args.child}
    try:
        run_card(args.child, args, row)
    except Exception as error:  # noqa: BLE001 - recorded in the row, the sweep goes on
        row.update(status="error", error=f"{type(error).__name__}: {error}"[:500],
                   traceback=traceback.format_exc()[-3000:])
        if "OutOfMemoryError" in type(error).__name__ and row.get("phase") != "bisection":
            row["ooms"] = row.get("ooms", 0) + 1
    write_json(args.result, row, announce=False)
    return 0


# ------------------------------------------------------------------------------------------------ the sweep
def run_child(gib: float, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "card.json"
        # -X faulthandler: a child killed by a signal (a crash in native code) prints its Python stack to stderr
        command = [sys.executable, "-X", "faulthandler", __file__, "--child", str(gib), "--result", str(result),
                   "--epochs", str(args.epochs), "--emulation", args.emulation]
        for item in args.set:
            command += ["--set", item]
        started = time.perf_counter()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.card_timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"card_gib": gib, "status": "error", "error": f"timed out after {args.card_timeout:.0f} s"}
        if result.is_file():
            row = json.loads(result.read_text())
        else:
            row = {"card_gib": gib, "status": "error",
                   "error": f"child exited {done.returncode} without a result: {done.stderr[-1500:]}"}
        row["wall_seconds"] = round(time.perf_counter() - started, 1)
        return row


def fmt(value, spec: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return format(value / scale if scale != 1.0 else value, spec)


def print_table(rows: list[dict]) -> None:
    header = (f"{'card':>6} {'status':<10} {'planned':>8} {'largest':>8} {'ratio':>6} {'OOMs':>4} "
              f"{'planned GiB':>11} {'reserved GiB':>12} {'error':>7} {'free-drop GiB':>13} {'error':>7} {'s':>6}")
    print(header)
    for r in rows:
        status = r.get("status", "?")
        print(f"{r['card_gib']:>6g} {status[:10]:<10} {fmt(r.get('planned_batch'), 'd'):>8} "
              f"{fmt(r.get('largest_batch'), 'd') + ('*' if r.get('capped') else ''):>8} "
              f"{fmt(r.get('batch_ratio'), '.3f'):>6} "
              f"{fmt(r.get('ooms'), 'd'):>4} {fmt(r.get('planned_bytes'), '.3f', GIB):>11} "
              f"{fmt(r.get('reserved_peak_bytes'), '.3f', GIB):>12} {fmt(r.get('peak_error'), '+.1%'):>7} "
              f"{fmt(r.get('free_drop_bytes'), '.3f', GIB):>13} {fmt(r.get('free_drop_error'), '+.1%'):>7} "
              f"{fmt(r.get('wall_seconds'), '.0f'):>6}")
        if r.get("error"):
            print(f"{'':>6} {r['error'][:200]}")
    ok = [r for r in rows if r.get("status") == "ok"]
    print(f"\nchecks over {len(ok)} measured cards: OOMs zero: {all(r['pass_ooms'] for r in ok)}; "
          f"allocator reserved peak within {PEAK_TOLERANCE:.1%}: {all(r['pass_peak'] for r in ok)}; "
          f"free-memory drop within {PEAK_TOLERANCE:.1%}: {all(r.get('pass_free_drop', False) for r in ok)}; "
          f"planned/largest >= {BATCH_RATIO}: {all(r['pass_batch'] for r in ok)}")
    if any(r.get("capped") for r in ok):
        print("* the replay's bound: the card fits more, the replay serves no larger batch (the planner's bound)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args)
    import torch

    if not torch.cuda.is_available():
        print("budget_sweep.py emulates smaller cards on a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    cards = [float(c) for c in args.cards.split(",") if c.strip()]
    start = time.perf_counter()
    rows = []
    for gib in cards:
        if time.perf_counter() - start > args.total_seconds:
            rows.append({"card_gib": gib, "status": "skipped", "error": "sweep time budget spent"})
            continue
        row = run_child(gib, args)
        rows.append(row)
        print(f"{gib:g} GiB: {row.get('status')} planned {row.get('planned_batch')} largest {row.get('largest_batch')}"
              f" OOMs {row.get('ooms')} peak error {fmt(row.get('peak_error'), '+.1%')}"
              f" ({row.get('wall_seconds', '?')} s)", flush=True)
    print()
    print_table(rows)
    commit = code_commit()
    gpus = sorted({r["gpu"] for r in rows if r.get("gpu")})  # from the children: no context in this process
    record = {"date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
              "gpu": ", ".join(gpus), "args": {k: v for k, v in vars(args).items()
                                                             if k not in ("child", "result")}, "rows": rows}
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
