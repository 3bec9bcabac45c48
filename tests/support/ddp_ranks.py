"""The rank processes of the data-parallel tests (tests/train/test_distributed.py): module-level functions, so
``multiprocessing`` can spawn them. Each joins a gloo job on the CPU through ``fitdqn.train.distributed.setup``
(torchrun's environment variables set by hand) and writes what it ends with into ``out``."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch

from fitdqn.config import Config, NetConfig, TrainConfig
from fitdqn.learn import Learner, random_batch

STATE_DIM = 10
NET = NetConfig(window=4, trunk_hidden=32, d_model=16, attention_heads=4, stream_hidden=16, num_atoms=11,
                iqn_embedding=8, iqn_quantiles=8, iqn_act_quantiles=4, iql_hidden=16)
CONFIG = Config(net=NET)
_TORCH_RAND = torch.rand


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_job(rank: int, world: int, port: int, timeout_s: float, device: str = "cpu"):
    """What torchrun would set, then ``setup``: this process's :class:`Distributed`."""
    from fitdqn.train.distributed import setup

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    return setup(TrainConfig(device=device, dist_timeout=timeout_s))


def batches(updates: int, size: int) -> list[dict[str, torch.Tensor]]:
    """The combined batches, fixed: rank r takes rows ``[r*B, (r+1)*B)`` of each."""
    return [random_batch(CONFIG, STATE_DIM, size, "cpu", seed=100 + k) for k in range(updates)]


class FixedRand:
    """``torch.rand(rows, cols)`` as rows ``offset..offset+rows`` of fixed tables (the update's two draws of
    quantile levels alternate between two tables): rank r draws exactly the rows of its part of the combined
    batch, so one process on the combined batch draws the same levels for the same samples."""

    def __init__(self, offset: int, rows: int, cols: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.tables = [_TORCH_RAND(rows, cols, generator=generator) for _ in range(2)]
        self.offset, self.calls = offset, 0

    def __call__(self, *size, device=None, **kwargs):
        if len(size) != 2 or kwargs:
            return _TORCH_RAND(*size, device=device, **kwargs)
        table = self.tables[self.calls % 2]
        self.calls += 1
        return table[self.offset:self.offset + size[0], :size[1]].clone().to(device)


def make_learner(seed: int, batch: int, device: str = "cpu") -> Learner:
    torch.manual_seed(seed)
    learner = Learner(CONFIG, STATE_DIM, device)
    learner.set_batch_size(batch)
    return learner


def parity_rank(rank: int, world: int, port: int, out: str, updates: int, batch: int) -> None:
    """``updates`` updates on this rank's part of fixed combined batches, gradients all-reduced."""
    job = join_job(rank, world, port, timeout_s=60.0)
    learner = make_learner(seed=1000 * rank, batch=batch * world)  # the ranks start from different weights
    job.broadcast_learner(learner)  # ... until rank 0's are broadcast
    learner.gradient_sync = job.gradient_sync(learner.params)
    combined = batches(updates, batch * world)
    torch.rand = FixedRand(rank * batch, batch * world, NET.iqn_quantiles)
    for full in combined:
        learner.update({key: value[rank * batch:(rank + 1) * batch] for key, value in full.items()})
    torch.save(learner.state_dict(), Path(out) / f"rank{rank}.pt")


def failing_rank(rank: int, world: int, port: int, out: str, mode: str, timeout_s: float) -> None:
    """One update together; then rank 1 dies (``mode = 'exit'``) or stops answering (``'hang'``) while rank 0
    goes on updating: rank 0 writes the error it ends with."""
    from fitdqn.train.distributed import DistributedError

    job = join_job(rank, world, port, timeout_s=timeout_s)
    learner = make_learner(seed=0, batch=16 * world)
    learner.gradient_sync = job.gradient_sync(learner.params)
    batch = random_batch(CONFIG, STATE_DIM, 16, "cpu", seed=rank)
    learner.update(batch)
    if rank == 1:
        if mode == "exit":
            os._exit(3)
        time.sleep(120)
        os._exit(0)
    try:
        for _ in range(3):
            learner.update(batch)
        message = "no error"
    except DistributedError as error:
        message = str(error)
    (Path(out) / "rank0.txt").write_text(message)


def capture_update(learner: Learner, example: dict[str, torch.Tensor]):
    """``learner.update`` captured in a CUDA graph as the trainer captures it (``capture_graph``), with the learner's
    state put back after the warm-up updates (so it stays in step with an eager twin); returns ``step(batch)``,
    which copies ``batch`` into the graph's inputs, replays it and returns the update's outputs."""
    import copy

    from fitdqn.device.graphs import capture_graph

    static = {key: value.clone() for key, value in example.items()}
    saved = copy.deepcopy(learner.state_dict())
    graph, outputs = capture_graph(lambda: learner.update(static), learner.device)
    learner.load_state_dict(saved)  # in place: the graph keeps reading the same tensors

    def step(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for key, value in batch.items():
            static[key].copy_(value)
        graph.replay()
        return outputs

    return step


def captured_rank(rank: int, world: int, port: int, out: str, updates: int) -> None:
    """NCCL on CUDA: the update with the gradient all-reduce, eager and captured in a CUDA graph, from the same
    weights on the same batches; writes both learners' states and the last outputs."""
    job = join_job(rank, world, port, timeout_s=120.0, device="auto")
    assert job.backend == "nccl", job.backend
    eager, graphed = make_learner(0, 64 * world, "cuda"), make_learner(0, 64 * world, "cuda")
    for learner in (eager, graphed):
        job.broadcast_learner(learner)
        learner.gradient_sync = job.gradient_sync(learner.params)  # also at one rank: the captured collective
    combined = [random_batch(CONFIG, STATE_DIM, 64, "cuda", seed=rank * 100 + k) for k in range(updates)]
    step = capture_update(graphed, combined[0])
    outputs = {}
    for k, batch in enumerate(combined):
        torch.manual_seed(100 + k)
        expected = eager.update(batch)
        torch.manual_seed(100 + k)
        got = step(batch)
        outputs = {"eager_out": {key: v.detach().cpu() for key, v in expected.items()},
                   "graphed_out": {key: v.detach().cpu() for key, v in got.items()}}
    torch.cuda.synchronize()
    torch.save({"eager": eager.state_dict(), "graphed": graphed.state_dict(), **outputs},
               Path(out) / f"rank{rank}.pt")
