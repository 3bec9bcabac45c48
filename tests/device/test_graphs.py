"""``capture_graph``'s premapped pool: under PyTorch's per-process memory cap a capture whose pool grows over a
free end is refused; mapped first, the same capture fits (GPU), and the trainer's premap size is the plan's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fitdqn.train.trainer import Trainer

MIB = 2**20

# One process per case: the cap and the allocator settings are per process, and a refused capture leaves its pool.
CAPTURE_UNDER_A_CAP = """
import json, sys, torch
from fitdqn.device.graphs import capture_graph
MIB = 2**20
premap = int(sys.argv[1])
device = torch.device("cuda", 0)
_, total = torch.cuda.mem_get_info(device)
outside = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
outside.fill_(0)  # the fill kernel loads outside the capture
torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + 700 * MIB) / total, device)

def step():
    kept = torch.empty(200 * MIB, dtype=torch.uint8, device=device)
    dropped = torch.empty(300 * MIB, dtype=torch.uint8, device=device)
    del dropped  # a 300 MiB free block at the pool's mapped end
    grown = torch.empty(400 * MIB, dtype=torch.uint8, device=device)  # maps 100 MiB more, charged 500 + 400
    return kept.fill_(1), grown.fill_(2)

try:
    graph, (kept, grown) = capture_graph(step, device, warmup=0, premap_bytes=premap * MIB)
    graph.replay()
    torch.cuda.synchronize(device)
    pool = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", ())) == tuple(graph.pool()))
    ends = [int(kept[0]), int(kept[-1]), int(grown[0]), int(grown[-1])]
    print(json.dumps({"ok": True, "pool_mib": pool / MIB, "ends": ends}))
except torch.OutOfMemoryError as error:
    print(json.dumps({"ok": False, "error": str(error).splitlines()[0]}))
"""


def capture_under_a_cap(premap_mib: int) -> dict:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    done = subprocess.run([sys.executable, "-c", CAPTURE_UNDER_A_CAP, str(premap_mib)], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_premapped_pool_lets_a_capture_fit_under_the_memory_cap():
    refused = capture_under_a_cap(0)
    assert not refused["ok"] and "400.00 MiB" in refused["error"]  # 600 MiB of pages would have fitted
    fitted = capture_under_a_cap(600)
    assert fitted == {"ok": True, "pool_mib": 600.0, "ends": [1, 1, 2, 2]}  # the replay wrote both tensors


def test_the_trainer_premaps_the_plans_pool_only_under_a_cap():
    plan = SimpleNamespace(per_sample_bytes=1000, budgets=SimpleNamespace(graph_pool_fixed_bytes=22 * MIB))
    trainer = SimpleNamespace(plan=plan, batch_size=4096, device_info=SimpleNamespace(allocator_limit_bytes=None))
    assert Trainer._premap_bytes(trainer) == 0
    trainer.device_info.allocator_limit_bytes = 4 << 30
    assert Trainer._premap_bytes(trainer) == 1000 * 4096 + 22 * MIB
