"""Benchmark one learner update: time and activation bytes per sample across batch sizes, eager and graphed.

    PYTHONPATH=src python benchmarks/bench_update.py --out results.json
    PYTHONPATH=src python benchmarks/bench_update.py --device cpu --batches 64,128 --iters 3 --out cpu.json

For each batch size a fresh learner (the default config as a run on the device resolves it: the small widths;
`--set net.size=full` for the full ones; state_dim 80) is built, then:
- eager: ``--warmup`` updates, then ``--iters`` timed updates (CUDA events around each, median reported);
  peak activation bytes = ``torch.cuda.max_memory_allocated()`` during one update minus the memory
  allocated before it (parameters, gradients, Adam state and the batch already exist), divided by B;
  ``traced`` is the same step traced by the planner (``fitdqn.memory.trace``, fake tensors, allocator
  rounding) — the number the planner can get on any device, so the two can be compared;
- graphed (CUDA only): ``capture_graph`` over a static batch (its warm-up included in the peak), then timed
  ``step(batch)`` calls (input copy + replay); ``graph_pool`` is the memory the captured graph keeps reserved.
``marginal`` is the slope of peak bytes between consecutive batch sizes (fixed per-call costs such as
weight casts and cuBLAS workspaces cancel). On CPU only eager runs, with the trace for memory.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from _common import peak_bytes, sync, times_ms, write_json

from fitdqn.config import Config, config_to_dict, for_device, with_overrides
from fitdqn.device.graphs import capture_graph
from fitdqn.device.probe import probe, resolve_device
from fitdqn.learn import Learner, random_batch
from fitdqn.memory.trace import StepSetup, trace_step_memory
from fitdqn.nets.groups import parameter_groups
from fitdqn.plan.build import trace_config

DEFAULT_BATCHES = "64,256,1024,2048,4096,8192,16384"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--device", default="auto", help="'auto', 'cuda', 'cuda:N' or 'cpu'")
    parser.add_argument("--batches", default=DEFAULT_BATCHES, help="comma-separated batch sizes")
    parser.add_argument("--iters", type=int, default=50, help="timed updates per batch size and mode")
    parser.add_argument("--warmup", type=int, default=5, help="untimed updates before timing")
    parser.add_argument("--state-dim", type=int, default=80, help="features per bar token")
    parser.add_argument("--modes", default="eager,graphed", help="eager and/or graphed (graphed: CUDA only)")
    parser.add_argument("--no-trace", action="store_true", help="skip the traced (planner) measurement")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set learn.precision=fp32 --set net.iqn_embedding=32")
    return parser.parse_args(argv)


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_ms": statistics.median(ordered), "p10_ms": ordered[len(ordered) // 10],
            "p90_ms": ordered[min(len(ordered) - 1, (len(ordered) * 9) // 10)]}


def trace_update(config: Config, state_dim: int, device: torch.device, batch_size: int):
    """The planner's trace of the same update (fake tensors; ``fitdqn.memory.trace``)."""
    # as the planner traces it: the precision the device will pick (the fake tensors may be
    # CPU ones standing in for CUDA tensors)
    config, _ = trace_config(config, probe(str(device)))

    def make_step(batch: int, fake_device: torch.device) -> StepSetup:
        learner = Learner(config, state_dim, fake_device)
        data = random_batch(config, state_dim, batch, fake_device, seed=0)
        groups = {name: list(group.modules) for name, group in parameter_groups(learner).items()}
        return StepSetup(lambda: learner.update(data), groups)

    return trace_step_memory(make_step, batch_size, device.type)


def bench_eager(config: Config, args, device: torch.device, batch_size: int) -> dict:
    torch.manual_seed(0)
    learner = Learner(config, args.state_dim, device)
    batch = random_batch(config, args.state_dim, batch_size, device, seed=0)
    for _ in range(args.warmup):
        learner.update(batch)
    row: dict = {"batch": batch_size, "mode": "eager"}
    if device.type == "cuda":
        row["peak_bytes"] = peak_bytes(lambda: learner.update(batch), device)
    if not args.no_trace or device.type == "cpu":
        traced = trace_update(config, args.state_dim, device, batch_size)
        row["traced_peak_bytes"], row["traced_by_group"] = traced.step_bytes, traced.step_by_group
    if "peak_bytes" not in row:
        row["peak_bytes"] = row["traced_peak_bytes"]
    row.update(summary(times_ms(lambda: learner.update(batch), device, args.iters)))
    return row


def bench_graphed(config: Config, args, device: torch.device, batch_size: int) -> dict:
    torch.manual_seed(0)
    learner = Learner(config, args.state_dim, device)
    batch = random_batch(config, args.state_dim, batch_size, device, seed=0)
    sync(device)
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)
    holder = {}
    begin = time.perf_counter()
    static_batch = {key: value.clone() for key, value in batch.items()}
    peak = peak_bytes(lambda: holder.setdefault("graph", capture_graph(lambda: learner.update(static_batch), device,
                                                                       warmup=args.warmup)), device)
    capture_s = time.perf_counter() - begin
    graph, _ = holder["graph"]

    def step(batch: dict[str, torch.Tensor]) -> None:
        for key, value in static_batch.items():
            value.copy_(batch[key], non_blocking=True)
        graph.replay()
    torch.cuda.empty_cache()
    row = {"batch": batch_size, "mode": "graphed", "peak_bytes": peak, "capture_s": capture_s,
           "graph_pool_bytes": torch.cuda.memory_reserved(device) - reserved_before}
    step(batch)
    row.update(summary(times_ms(lambda: step(batch), device, args.iters)))
    return row


def run(args) -> dict:
    device = resolve_device(args.device)
    overrides = dict(item.split("=", 1) for item in args.set)
    config = with_overrides(Config(), overrides) if overrides else Config()
    config = for_device(config, device.type)  # the widths a run on this device trains (`--set net.size=full`)
    batches = [int(b) for b in args.batches.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    if device.type != "cuda":
        modes = [m for m in modes if m != "graphed"]
    rows = []
    for mode in modes:
        bench = bench_eager if mode == "eager" else bench_graphed
        for batch_size in batches:
            try:
                row = bench(config, args, device, batch_size)
            except torch.OutOfMemoryError as error:
                row = {"batch": batch_size, "mode": mode, "error": f"out of memory: {str(error)[:200]}"}
            row["per_sample_bytes"] = row["peak_bytes"] / batch_size if "peak_bytes" in row else None
            rows.append(row)
            print(format_row(row), flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    add_marginals(rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": name, "torch": torch.__version__, "state_dim": args.state_dim,
        "precision": config.learn.precision, "config": {k: config_to_dict(config)[k] for k in ("net", "learn")},
        "args": {k: v for k, v in vars(args).items() if k != "out"}, "results": rows,
    }


def add_marginals(rows: list[dict]) -> None:
    for key in ("peak_bytes", "traced_peak_bytes"):
        previous: dict[str, dict] = {}
        for row in rows:
            if key not in row:
                continue
            last = previous.get(row["mode"])
            if last is not None and row["batch"] != last["batch"]:
                marginal = (row[key] - last[key]) / (row["batch"] - last["batch"])
                row[key.replace("peak_bytes", "marginal_per_sample")] = marginal
            previous[row["mode"]] = row


def format_row(row: dict) -> str:
    if "error" in row:
        return f"{row['mode']:>8} {row['batch']:>6}  {row['error']}"
    traced = row.get("traced_peak_bytes")
    traced_text = f"{traced / row['batch'] / 1024:9.1f}" if traced is not None else f"{'-':>9}"
    return (f"{row['mode']:>8} {row['batch']:>6} {row['median_ms']:9.3f} {row['p90_ms']:9.3f} "
            f"{row['per_sample_bytes'] / 1024:10.1f} {traced_text}")


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  torch {result['torch']}  precision {result['precision']}")
    print(f"{'mode':>8} {'batch':>6} {'median ms':>9} {'p90 ms':>9} {'KB/sample':>10} {'traced KB':>9} "
          f"{'marginal KB':>11} {'graph pool MB':>13}")
    for row in result["results"]:
        if "error" in row:
            print(format_row(row))
            continue
        marginal = row.get("marginal_per_sample")
        pool = row.get("graph_pool_bytes")
        print(format_row(row) + (f" {marginal / 1024:11.1f}" if marginal is not None else f" {'-':>11}")
              + (f" {pool / 2**20:13.1f}" if pool is not None else f" {'-':>13}"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

