"""Does the plan predict the real training step? (issue: VRAM planner, 'Done when').

For each batch: build the captured training step for real on the GPU (replay at the planned capacity, the
learner, the device-resident features) and run it; compare ``torch.cuda.max_memory_allocated`` over the whole
thing with what the plan's components predict for those same objects: replay + networks + batch +
cuda_overhead fixed bytes + the features tensor + per-sample bytes x B. Also the step alone: the traced line
(fixed_step + per_sample x B) against ``measure_step_memory`` (peak minus allocated before the step).

    PYTHONPATH=src python benchmarks/budget_check.py --batches 256,2048,8192 --out budget_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess

import torch

from fitdqn.budget.build import PlanInputs, _traces, build_components, make_train_step, trace_config
from fitdqn.budget.component import tensor_bytes
from fitdqn.budget.trace import measure_step_memory
from fitdqn.config import Config, config_to_dict, with_overrides
from fitdqn.device import probe
from fitdqn.market.features import NUM_FEATURES

ALLOCATED_BY_STEP = ("replay", "her", "dqn", "attention", "iqn", "iql", "batch", "cuda_overhead")


def measure_total(make_step, batch_size: int, device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with device:
        step = make_step(batch_size, device).step
        step()
        step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="256,2048,8192")
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--capacity", type=int, default=1_000_000, help="replay.capacity for the check")
    parser.add_argument("--out", default="budget_check.json")
    args = parser.parse_args()
    config = with_overrides(Config(), {"market.data": args.data, "replay.capacity": args.capacity,
                                       "replay.compile": False})
    info = probe("cuda")
    device = info.torch_device
    inputs = PlanInputs.from_config(config)
    components, capacity = build_components(config, info, inputs)
    by_name = {c.name: c for c in components}
    traced_config, note = trace_config(config, info)
    fit, _act = _traces(str(config_to_dict(traced_config)), traced_config, inputs.num_bars, capacity, "cuda")
    features = tensor_bytes((inputs.num_bars, NUM_FEATURES), torch.float32)
    make_step = make_train_step(config, inputs.num_bars, capacity)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        predicted_total = features + sum(by_name[n].bytes_at(batch) for n in ALLOCATED_BY_STEP)
        measured_total = measure_total(make_step, batch, device)
        predicted_step = fit.step_bytes_at(batch)
        measured_step = measure_step_memory(make_step, batch, device)
        rows.append({
            "batch": batch, "predicted_total": predicted_total, "measured_total": measured_total,
            "total_error": (predicted_total - measured_total) / measured_total,
            "predicted_step": predicted_step, "measured_step": measured_step,
            "step_error": (predicted_step - measured_step) / measured_step,
        })
    print(f"{info.name}, torch {torch.__version__}, replay capacity {capacity}, trace: {note or 'fake CUDA'}")
    print(f"{'batch':>6} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7} | {'step pred MiB':>13} "
          f"{'step meas MiB':>13} {'error':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['predicted_total'] / 2**20:>14.1f} {r['measured_total'] / 2**20:>13.1f} "
              f"{100 * r['total_error']:>+6.1f}% | {r['predicted_step'] / 2**20:>13.1f} "
              f"{r['measured_step'] / 2**20:>13.1f} {100 * r['step_error']:>+6.1f}%")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.out, "w") as f:
        json.dump({"device": info.name, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                   "commit": commit, "components": [c.to_json() for c in components], "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
