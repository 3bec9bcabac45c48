"""How long `fitdqn plan` takes beyond importing torch: cold (empty trace cache) and warm (the same plan again).

Each case runs `python -m fitdqn plan ...` as a child process and, in turn with it, `python -c "import torch"`;
the figure is the child's CPU seconds (user + system, from the operating system's accounting of the finished
child), and its ratio to `import torch` timed beside it (a ratio holds on a busy machine). Beside `import torch`
it times `import torch, torch._dynamo`: PyTorch's compiler package, which a cold plan cannot avoid (making a
``FakeTensorMode`` and the first ``torch.optim`` step import it); the seconds beyond that reference are the
planning work proper. Medians over the repeats (the seconds beyond a reference: the median of each repeat's
difference, the plan and its references timed in turn). Cases:

- `what-if`: `--gpu rtx3050 --free-memory 1.7GiB --batch-size 0` (the auto batch on a described card: its free
  memory is fixed, so a warm run finds the whole stored plan);
- `probed`: the device this machine has (`train.device = auto`), profile batch: its free memory moves between
  probes, so a warm run finds the traces and the network bytes in the cache and sizes the replay again.

    python benchmarks/plan_latency.py --repeats 3 --out benchmarks/results/plan_latency_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json

from fitdqn.provenance import code_commit

CASES = {
    "what-if": ["--gpu", "rtx3050", "--free-memory", "1.7GiB", "--batch-size", "0"],
    "probed": [],
}


def child_cpu_seconds(command: list[str], environment: dict[str, str]) -> float:
    """User + system seconds of one finished child (``RUSAGE_CHILDREN`` before and after)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(data: str, repeats: int) -> dict[str, dict[str, float]]:
    results = {}
    import_torch = [sys.executable, "-c", "import torch"]
    import_compiler = [sys.executable, "-c", "import torch, torch._dynamo"]
    for case, options in CASES.items():
        plan = [sys.executable, "-m", "fitdqn", "plan", "--data", data, "--json", *options]
        rows = {"cold": [], "warm": []}
        for _ in range(repeats):
            cache = Path(tempfile.mkdtemp(prefix="fitdqn-plan-latency-"))
            environment = {**os.environ, "FITDQN_CACHE_DIR": str(cache)}
            try:
                for phase in ("cold", "warm"):
                    plan_seconds = child_cpu_seconds(plan, environment)
                    torch_seconds = child_cpu_seconds(import_torch, environment)
                    compiler_seconds = child_cpu_seconds(import_compiler, environment)
                    rows[phase].append((plan_seconds, torch_seconds, compiler_seconds))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        for phase, timed in rows.items():
            plan_s = statistics.median(p for p, _, _ in timed)
            torch_s = statistics.median(t for _, t, _ in timed)
            compiler_s = statistics.median(c for _, _, c in timed)
            ratio = statistics.median(p / t for p, t, _ in timed)
            # of each repeat timed in turn (a busy machine drifts)
            beyond = statistics.median(p - t for p, t, _ in timed)
            beyond_compiler = statistics.median(p - c for p, _, c in timed)
            results[f"{case} {phase}"] = {"plan_cpu_s": round(plan_s, 2), "import_torch_cpu_s": round(torch_s, 2),
                                          "import_torch_dynamo_cpu_s": round(compiler_s, 2),
                                          "ratio": round(ratio, 2), "beyond_import_s": round(beyond, 2),
                                          "beyond_import_dynamo_s": round(beyond_compiler, 2)}
            print(f"{case:8s} {phase}: plan {plan_s:.2f} s CPU, import torch {torch_s:.2f} s, ratio {ratio:.2f}, "
                  f"beyond import {beyond:.2f} s; import torch + torch._dynamo {compiler_s:.2f} s, beyond it "
                  f"{beyond_compiler:.2f} s", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="synthetic", help="market.data of the planned config (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="cold/warm pairs per case (median; default 3)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    results = measure(args.data, args.repeats)
    if args.out:
        record = {"date": time.strftime("%Y-%m-%d"), "commit": code_commit(), "machine": platform.node(),
                  "cpus": os.cpu_count(), "data": args.data, "repeats": args.repeats, "results": results}
        write_json(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
