"""Where a real run's device memory goes, phase by phase (CUDA): the check behind "the plan is exact on a run".

Runs `fitdqn train` in this process with a few of the trainer's calls wrapped (the system's build, each warm-up
and the capture of the collector and update graphs, the epochs' collection and updates, the validation
backtests, checkpoints) and records, before and after each of their first three calls, the allocator's reserved
and allocated bytes and their peaks. At chosen points it also keeps a summary of the allocator's snapshot: every
segment with its pool (the default pool, or a graph's private pool), stream, size, allocated bytes and its large
live blocks, which is how a 32 MiB cuBLAS workspace holding three 20 MiB pages, or a graph pool's page rounding,
shows. The run's own "run peak reserved" line against its plan (`plan.json` `peak`) ends the output.

    python benchmarks/run_memory_phases.py --out phases.json                    # default synthetic run, 2 epochs
    python benchmarks/run_memory_phases.py --out phases.json -- --data synthetic --epochs 4 --batch-size 4096

Arguments after ``--`` go to `fitdqn train`. Marks are skipped while a stream is capturing (a host sync there
would end the capture).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import torch
from _common import write_json

SNAPSHOT_AT = ("after build_system#1", "update call 1 before", "update call 2 after", "after train_updates#1",
               "after evaluate_split#1", "end")
MIB = 2**20


class PhaseRecorder:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.snapshots: dict[str, list[dict]] = {}

    def mark(self, label: str) -> None:
        if torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.synchronize()  # host sync: the phase's frees are done
        if label in SNAPSHOT_AT:
            self.snapshots[label] = [segment_summary(s) for s in torch.cuda.memory_snapshot()]
        self.rows.append({"label": label, "reserved": torch.cuda.memory_reserved(),
                          "allocated": torch.cuda.memory_allocated(),
                          "max_reserved": torch.cuda.max_memory_reserved(),
                          "max_allocated": torch.cuda.max_memory_allocated()})

    def wrap(self, owner, name: str, first_calls: int = 3) -> None:
        """Mark before and after the first ``first_calls`` calls of ``owner.name``."""
        original = getattr(owner, name)
        calls = [0]

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            calls[0] += 1
            label = f"{name}#{calls[0]}"
            if calls[0] <= first_calls:
                self.mark(f"before {label}")
            out = original(*args, **kwargs)
            if calls[0] <= first_calls:
                self.mark(f"after {label}")
            return out

        setattr(owner, name, wrapper)

    def wrap_capture(self, module, label: str) -> None:
        """Mark around each call of the step a ``capture_graph`` warms up (the captured call is skipped)."""
        original = module.capture_graph

        def capture(step, *args, **kwargs):
            calls = [0]

            def marked_step():
                calls[0] += 1
                self.mark(f"{label} call {calls[0]} before")
                out = step()
                self.mark(f"{label} call {calls[0]} after")
                return out

            return original(marked_step, *args, **kwargs)

        module.capture_graph = capture


def segment_summary(segment: dict) -> dict:
    live = [block["size"] for block in segment["blocks"] if block["state"] == "active_allocated"]
    return {"pool": str(segment.get("segment_pool_id")), "stream": segment.get("stream"),
            "size": segment["total_size"], "allocated": segment["allocated_size"],
            "live_large_blocks": sorted((size for size in live if size >= MIB), reverse=True)[:12]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the phases and snapshots")
    parser.add_argument("train_args", nargs="*", help="after --: arguments of `fitdqn train`")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    # the modules whose calls are wrapped: imported here, after the argument check (they import the whole system)
    import fitdqn.collect.collector as collector
    import fitdqn.train.run as run
    import fitdqn.train.trainer as trainer
    from fitdqn.cli import main as fitdqn_main

    recorder = PhaseRecorder()
    recorder.wrap_capture(collector, "collector")
    recorder.wrap_capture(trainer, "update")
    for owner, name in ((trainer, "build_system"), (trainer.Trainer, "collect"), (trainer.Trainer, "train_updates"),
                        (run, "evaluate_split"), (run, "keep_best"), (run, "save")):
        recorder.wrap(owner, name)
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "run"
        train_args = args.train_args or ["--data", "synthetic", "--epochs", "2"]
        rc = fitdqn_main(["train", *train_args, "--out", str(run_dir)])
        recorder.mark("end")
        plan = json.loads((run_dir / "plan.json").read_text()) if (run_dir / "plan.json").is_file() else {}
    write_json(args.out, {"rc": rc, "train_args": train_args, "rows": recorder.rows,
                          "snapshots": recorder.snapshots, "run_peak": plan.get("peak")}, announce=False)
    for row in recorder.rows:
        print(f"{row['label']:<32} reserved {row['reserved'] / MIB:9.1f} MiB  allocated {row['allocated'] / MIB:9.1f}"
              f"  peak reserved {row['max_reserved'] / MIB:9.1f}  peak allocated {row['max_allocated'] / MIB:9.1f}")
    print("run peak against the plan:", plan.get("peak"))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
