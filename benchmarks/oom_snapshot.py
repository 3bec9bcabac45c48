"""Why did an emulated card run out of memory? Record the allocator at the OOM, then replay it through the model.

1. On the GPU: run one card of ``budget_sweep.py`` with PyTorch's allocator history on; at the first OOM the
   allocator's snapshot (segments, blocks and the ordered alloc/free/map events with Python frames) is written::

       PYTHONPATH=src python benchmarks/oom_snapshot.py record --card 4 --out oom_snapshot.pickle

2. Anywhere: replay that snapshot's last CUDA-graph capture (the events from the first mapping of the newest
   private pool) through :class:`fitdqn.memory.allocator_model.CachingAllocatorModel` and compare the pool
   the model builds from the *real* sequence with the real segments; print the live blocks by source line::

       PYTHONPATH=src python benchmarks/oom_snapshot.py replay oom_snapshot.pickle

   With ``--cap-bytes`` (the allocator cap the card ran under: its ``allocator_cap_bytes`` in the sweep's JSON)
   the model also applies ``alloc_block``'s fraction check, with what the other pools had mapped when the
   capture began counted against the cap, and says whether it refuses the request the GPU refused.

   If the model, fed the real sequence, reproduces the real pool, the model's rules hold and a gap between
   plan and card lies in the *sequence* (the trace) or outside the pool; if not, in the rules.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
from pathlib import Path

from fitdqn.memory.allocator_model import MIB


def record(card: float, out: str, emulation: str = "fraction") -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fitdqn.device.probe import configure_allocator

    configure_allocator()  # before the first CUDA allocation, as fitdqn train does
    import budget_sweep
    import torch

    torch.cuda.memory._record_memory_history(max_entries=400_000)
    dumped: list[int] = []

    def on_oom(device, requested, device_allocated, device_free) -> None:
        if not dumped:  # the first OOM is the planned batch's
            torch.cuda.memory._dump_snapshot(out)
            dumped.append(requested)
            print(f"OOM: request {requested} B, allocated {device_allocated} B; snapshot: {out}", flush=True)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
    row: dict = {}
    args = budget_sweep.parse_args(["--cards", str(card), "--epochs", "1", "--emulation", emulation])
    budget_sweep.run_card(card, args, row)
    print({key: row.get(key) for key in ("planned_batch", "largest_batch", "ooms", "oom_events", "status")})
    if not dumped:
        print("no OOM: nothing recorded")


def source_line(entry: dict) -> str:
    for frame in entry.get("frames", []):
        if "fitdqn" in frame["filename"]:
            return f"{frame['filename'].split('src/')[-1]}:{frame['line']} {frame['name']}"
    return "(no fitdqn frame: autograd engine or library)"


def replay(path: str, cap_bytes: int | None = None) -> None:
    from fitdqn.memory.allocator_model import AllocatorCapExceeded, CachingAllocatorModel

    with open(path, "rb") as file:
        snapshot = pickle.load(file)
    events = snapshot["device_traces"][0]
    pools = {}
    for segment in snapshot["segments"]:
        key = tuple(segment.get("segment_pool_id", ()))
        pools.setdefault(key, [0, 0])
        pools[key][0] += segment["total_size"]
        pools[key][1] += segment["allocated_size"]
    for key, (total, allocated) in sorted(pools.items()):
        print(f"pool {key}: reserved {total / MIB:9.1f} MiB, allocated {allocated / MIB:9.1f} MiB")
    newest = max(pools)
    first_address = min(s["address"] for s in snapshot["segments"] if tuple(s.get("segment_pool_id", ())) == newest)
    start = next(i for i, e in enumerate(events) if e["action"] == "segment_map" and e["addr"] == first_address)
    outside = sum(e["size"] if e["action"] == "segment_map" else -e["size"]
                  for e in events[:start] if e["action"] in ("segment_map", "segment_unmap"))
    print(f"mapped by the other pools when the capture began: {outside / MIB:.1f} MiB")
    model = CachingAllocatorModel(True, None, limit_bytes=cap_bytes, outside_bytes=outside)
    live = {}
    for event in events[start:]:
        if event["action"] == "alloc":
            live[event["addr"]] = model.malloc(event["size"])
        elif event["action"] == "free_completed":
            block = live.pop(event["addr"], None)
            if block is not None:
                model.free(block)
        elif event["action"] == "oom":
            print(f"at the OOM: model pool {model.reserved_bytes / MIB:.1f} MiB from the real sequence; "
                  f"request {event['size'] / MIB:.1f} MiB from {source_line(event)}")
            try:
                model.malloc(event["size"])
                print(f"the model serves it: the pool would then hold {model.reserved_bytes / MIB:.1f} MiB")
            except AllocatorCapExceeded as refused:
                print(f"the model refuses it too (alloc_block's fraction check): {refused}")
    print(f"the model's largest fraction-check charge over the replayed sequence: "
          f"{model.charged_peak_bytes / MIB:.1f} MiB (pool reserved + the request, at a growth)")
    live_by_line = collections.Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live_by_line[source_line(block)] += block["size"]
    print("live blocks at the OOM, by source line:")
    for line, size in live_by_line.most_common(15):
        print(f"  {size / MIB:9.1f} MiB  {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run one emulated card with allocator history; snapshot at the first OOM")
    rec.add_argument("--card", type=float, default=4.0, help="emulated card size in GiB")
    rec.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "oom_snapshot.pickle"))
    rec.add_argument("--emulation", choices=("fraction", "ballast"), default="fraction",
                     help="how the card is emulated (budget_sweep.py --emulation)")
    rep = sub.add_parser("replay", help="replay a snapshot's newest graph capture through the allocator model")
    rep.add_argument("snapshot")
    rep.add_argument("--cap-bytes", type=int, help="the allocator cap the card ran under (allocator_cap_bytes)")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.card, args.out, args.emulation)
    else:
        replay(args.snapshot, args.cap_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
