"""Does the plan predict the real training step?

For each batch, in a fresh subprocess (so the cuBLAS workspaces, caches and loaded kernels of one batch are not
in the next one's baseline): build the captured training step for real on the GPU (replay at the planned
capacity, the learner, the device-resident features) and run it; compare ``torch.cuda.max_memory_allocated``
over the whole thing with what the plan's components predict for those same objects: replay + networks + batch +
cuda_overhead fixed bytes + the features tensor + per-sample bytes x B. Also the step alone: the step's components
(less the networks' own bytes, plus the replay's sampling scratch) against ``measure_step_memory`` (peak minus
allocated before the step). The components are anchored at the batch, as the plan's for a known batch.

The plan is made in this process; each batch's measurement runs in a child process. A child that fails
(an exception, a crash, a timeout) gives a row with an ``error`` and the check goes on. Prints one table,
writes JSON.

    PYTHONPATH=src python benchmarks/budget_check.py --batches 256,2048,8192 --out budget_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from _common import peak_bytes, write_json

from fitdqn.config import Config, for_device, with_overrides
from fitdqn.device import probe
from fitdqn.market.layout import NUM_FEATURES
from fitdqn.memory.component import tensor_bytes
from fitdqn.memory.trace import measure_step_memory
from fitdqn.plan.build import (
    PlanInputs,
    build_components,
    make_train_step,
    network_fixed_bytes,
    trace_config,
)
from fitdqn.provenance import code_commit

ALLOCATED_BY_STEP = ("replay", "her", "dqn", "attention", "iqn", "iql", "batch", "cuda_overhead")
STEP_COMPONENTS = ("dqn", "attention", "iqn", "iql", "batch")  # their per-sample parts: the step's bytes


def features_bytes(inputs: PlanInputs) -> int:
    return tensor_bytes((inputs.num_bars, NUM_FEATURES), torch.float32)
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="256,2048,8192")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--capacity", type=int, default=1_000_000, help="replay.capacity for the check")
    parser.add_argument("--out", default="budget_check.json")
    parser.add_argument("--batch-timeout", type=float, default=300.0,
                        help="seconds before one batch's child process is abandoned")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # internal: measure one batch
    parser.add_argument("--result", help=argparse.SUPPRESS)  # internal: the child's JSON file
    parser.add_argument("--planned-capacity", type=int, help=argparse.SUPPRESS)  # internal: the plan's capacity
    return parser.parse_args(argv)


def check_config(args: argparse.Namespace) -> Config:
    """The default config on synthetic data, its 'auto' values resolved for a GPU (as the trainer does)."""
    config = with_overrides(Config(), {"market.data": args.data, "replay.capacity": args.capacity})
    return for_device(config, "cuda")


# ------------------------------------------------------------------------------------------------ one batch
def measure_total(make_step, batch_size: int, device: torch.device) -> int:
    torch.cuda.empty_cache()

    def two_steps() -> None:
        with device:
            step = make_step(batch_size, device).step
            step()
            step()

    return peak_bytes(two_steps, device)


def measure_batch(args: argparse.Namespace) -> dict:
    """The child's work: the real whole-step peak, then the real step alone, at batch ``args.child``."""
    config = check_config(args)
    device = probe("cuda").torch_device  # also sets the allocator config the trainer runs with
    inputs = PlanInputs.from_config(config)
    make_step = make_train_step(config, inputs.num_bars, args.planned_capacity)
    return {"measured_total": measure_total(make_step, args.child, device),
            "measured_step": measure_step_memory(make_step, args.child, device)}


def child_main(args: argparse.Namespace) -> int:
    try:
        result = measure_batch(args)
    except Exception as error:  # noqa: BLE001 - recorded in the row, the check goes on
        result = {"error": f"{type(error).__name__}: {error}"[:500], "traceback": traceback.format_exc()[-3000:]}
    write_json(args.result, result, announce=False)
    return 0


# ------------------------------------------------------------------------------------------------ the check
def run_child(batch: int, args: argparse.Namespace, capacity: int) -> dict:
    """Measure one batch in a fresh process: its measurements, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "batch.json"
        command = [sys.executable, __file__, "--child", str(batch), "--result", str(result), "--data", args.data,
                   "--capacity", str(args.capacity), "--planned-capacity", str(capacity)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.batch_timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.batch_timeout:g} s"}
        if result.is_file():
            return json.loads(result.read_text())
        return {"error": f"child exited {done.returncode} without a result: {done.stderr[-1500:]}"}


def relative_error(predicted: int, measured: int | None) -> float | None:
    return None if not measured else (predicted - measured) / measured


def make_row(batch: int, predicted_total: int, predicted_step: int, measured: dict) -> dict:
    """One table row (the keys of the single-process version, ``error``/``traceback`` added on failure)."""
    measured_total, measured_step = measured.get("measured_total"), measured.get("measured_step")
    row = {
        "batch": batch, "predicted_total": predicted_total, "measured_total": measured_total,
        "total_error": relative_error(predicted_total, measured_total),
        "predicted_step": predicted_step, "measured_step": measured_step,
        "step_error": relative_error(predicted_step, measured_step),
    }
    row.update({key: measured[key] for key in ("error", "traceback") if key in measured})
    return row


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def print_table(rows: list[dict]) -> None:
    print(f"{'batch':>6} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7} | {'step pred MiB':>13} "
          f"{'step meas MiB':>13} {'error':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {fmt(r['predicted_total'], '.1f', MIB):>14} {fmt(r['measured_total'], '.1f', MIB):>13} "
              f"{fmt(r['total_error'], '+.1%'):>7} | {fmt(r['predicted_step'], '.1f', MIB):>13} "
              f"{fmt(r['measured_step'], '.1f', MIB):>13} {fmt(r['step_error'], '+.1%'):>7}")
        if r.get("error"):
            print(f"{'':>6} {r['error'][:200]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child_main(args)
    if not torch.cuda.is_available():
        print("budget_check.py measures the training step on a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    config = check_config(args)
    info = probe("cuda")
    inputs = PlanInputs.from_config(config)
    traced_config, note = trace_config(config, info)
    rows, components, capacity = [], [], 0
    for batch in [int(b) for b in args.batches.split(",") if b.strip()]:
        started = time.perf_counter()
        # what the plan budgets at a known batch: the components in proportion to the step traced there
        components, capacity = build_components(config, info, inputs, anchor=batch)
        by_name = {c.name: c for c in components}
        predicted_total = features_bytes(inputs) + sum(by_name[n].bytes_at(batch) for n in ALLOCATED_BY_STEP)
        predicted_step = sum(by_name[n].bytes_at(batch) for n in STEP_COMPONENTS) - sum(
            network_fixed_bytes(config).values()) + (by_name["replay"].per_sample_bytes
                                                     + by_name["her"].per_sample_bytes) * batch
        rows.append(make_row(batch, predicted_total, predicted_step, run_child(batch, args, capacity)))
        print(f"batch {batch}: {'error' if rows[-1].get('error') else 'measured'} in a fresh process "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    print(f"{info.name}, torch {torch.__version__}, replay capacity {capacity}, trace: {note or 'fake CUDA'}, "
          "one process per batch")
    print_table(rows)
    commit = code_commit()
    write_json(args.out, {"device": info.name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                          "commit": commit, "isolation": "one process per batch",
                          "components": [c.to_json() for c in components], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
