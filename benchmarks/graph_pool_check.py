"""Does the allocator model predict the captured training step's CUDA graph pool? (``cuda_graphs`` component)

For each allocator mode (expandable segments on and off, each in a fresh process: PyTorch reads its allocator
config once, at start-up) and each batch: build the trainer's captured step for real on the GPU
(``fitdqn.plan.build.make_train_step``: sample -> update -> priorities), warm it up on the capture stream (its
cuBLAS workspaces are made there, outside the graph), capture it in a CUDA graph and read the graph's private
pool from ``torch.cuda.memory_snapshot`` (the segments whose ``segment_pool_id`` is the graph's pool; the
growth of ``memory_reserved`` over the capture beside it). Next to it, from the same step traced on fake
tensors: ``allocator_model.pool_usage``, the traced live peak (``step_bytes``), and what the plan budgets
for the pool: the step traced at that batch + the ``cuda_graphs`` component anchored there, as the plan takes them.

    PYTHONPATH=src python benchmarks/graph_pool_check.py --batches 64,256,1024,4096,8192,16384 --out pool.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

import torch
from _common import write_json

from fitdqn.config import Config, for_device, with_overrides
from fitdqn.device import probe
from fitdqn.device.graphs import capture_graph, captured_pool_bytes
from fitdqn.memory.allocator_model import ALLOC_CONF_VARIABLES, pool_usage
from fitdqn.memory.trace import trace_step_memory
from fitdqn.plan.build import (
    PlanInputs,
    cuda_graphs_component,
    make_train_step,
    stand_in_system,
    trace_config,
    tracer_for,
)


def real_pool(config: Config, num_bars: int, capacity: int, batch_size: int, device: torch.device) -> dict:
    """The trainer's way of capturing (``capture_graph``, its replay's sample generator registered), then the bytes
    of the graph's private pool."""
    with device:
        system = stand_in_system(config, num_bars, capacity, batch_size, device)
    graph, _ = capture_graph(system.update_step, device, generators=(system.sample_generator,))
    torch.cuda.synchronize(device)  # host sync: capture done
    row = {"pool_bytes": captured_pool_bytes(graph)}
    del graph, system
    gc.collect()
    torch.cuda.empty_cache()
    return row


def child(args) -> None:
    expandable = args.child == "expandable"
    config = for_device(with_overrides(Config(), {"market.data": args.data}), "cuda")
    info = probe("cuda")
    device = info.torch_device
    inputs = PlanInputs.from_config(config)
    capacity = config.collect.num_envs * args.steps
    traced_config, note = trace_config(config, info)
    tracer = tracer_for(config, info, traced_config, inputs.num_bars)
    component = cuda_graphs_component(config, info, tracer, capacity, note)
    rows = []
    for batch_size in [int(b) for b in args.batches.split(",") if b]:
        # what the plan budgets at a batch it settles on: the step traced there and the pool in proportion to it
        pool_line = cuda_graphs_component(config, info, tracer, capacity, note, batch_size)
        trace = trace_step_memory(make_train_step(traced_config, inputs.num_bars, capacity), batch_size, "cuda",
                                  record_events=True)
        usage = pool_usage(trace, expandable)
        row = {"mode": args.child, "batch": batch_size, "step_bytes_traced": trace.step_bytes,
               "model_pool_bytes": usage.reserved_bytes, "model_footprint_bytes": usage.footprint_bytes,
               "planned_pool_bytes": trace.step_bytes + pool_line.bytes_at(batch_size)}
        try:
            row.update(real_pool(config, inputs.num_bars, capacity, batch_size, device))
            row["model_error"] = (row["model_pool_bytes"] - row["pool_bytes"]) / max(row["pool_bytes"], 1)
        except torch.OutOfMemoryError as error:
            row["error"] = f"out of memory: {str(error)[:200]}"
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"component": component.to_json(), "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,256,1024,4096,8192,16384")
    parser.add_argument("--modes", default="expandable,default")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--steps", type=int, default=64, help="replay capacity in lockstep steps of num_envs")
    parser.add_argument("--out", default="graph_pool_check.json")
    parser.add_argument("--child", choices=("expandable", "default"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "modes": {}}
    for mode in [m for m in args.modes.split(",") if m]:
        env = {name: value for name, value in os.environ.items() if name not in ALLOC_CONF_VARIABLES}
        env["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{mode == 'expandable'}"
        done = subprocess.run([sys.executable, __file__, "--child", mode, "--batches", args.batches,
                               "--data", args.data, "--steps", str(args.steps)],
                              env=env, check=True, stdout=subprocess.PIPE, text=True)
        result["modes"][mode] = json.loads(done.stdout.strip().splitlines()[-1])
    write_json(args.out, result, announce=False)
    for mode, data in result["modes"].items():
        print(f"{mode}: cuda_graphs = {data['component']['fixed_bytes']} B + "
              f"{data['component']['per_sample_bytes']} B/sample")
        for row in data["rows"]:
            real = row.get("pool_bytes")
            print(f"  batch {row['batch']:6d}  real pool {real / 2**20 if real else float('nan'):9.1f} MiB  "
                  f"model {row['model_pool_bytes'] / 2**20:9.1f} MiB  planned {row['planned_pool_bytes'] / 2**20:9.1f}"
                  f" MiB  step {row['step_bytes_traced'] / 2**20:9.1f} MiB  {row.get('error', '')}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
