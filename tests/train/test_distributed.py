"""Data-parallel training (fitdqn.train.distributed) on the CPU: gloo jobs of 2 spawned processes."""

from __future__ import annotations

import multiprocessing
import sys

import pytest
import torch
from support import ddp_ranks
from support.ddp_ranks import FixedRand, batches, free_port, make_learner

from fitdqn.config import Config, TrainConfig
from fitdqn.errors import UserError
from fitdqn.files import CHECKPOINT_NAME
from fitdqn.memory.distributed import (
    ALLREDUCE,
    NCCL,
    NCCL_INIT_BYTES,
    NCCL_LL128_BUFFSIZE,
    NCCL_LL_BUFFSIZE,
    distributed_components,
    nccl_bytes,
)
from fitdqn.train import distributed
from fitdqn.train.checkpoint import save_checkpoint
from fitdqn.train.run import checked_resume_state

WORLD = 2
JOIN_S = 120  # a job that is not over by then hangs: the test fails instead of waiting forever
# fork: the ranks start in a moment (spawn re-imports torch: ~15 s a job on 2 loaded cores). Not where CUDA is
# present: a forked child cannot use CUDA once the parent has, and torch's optimizers query CUDA when it is there
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_available() \
    else "spawn"


def run_ranks(target, *args, world: int = WORLD, method: str = START_METHOD) -> list[multiprocessing.Process]:
    context = multiprocessing.get_context(method)
    port = free_port()
    processes = [context.Process(target=target, args=(rank, world, port, *args)) for rank in range(world)]
    for process in processes:
        process.start()
    return processes


def finish(processes, *, wait_s: float = JOIN_S) -> list[int | None]:
    """Exit codes after ``wait_s`` at most (None: still running then, and killed)."""
    codes = []
    for process in processes:
        process.join(wait_s)
        if process.is_alive():
            process.kill()
            process.join()
            codes.append(None)
        else:
            codes.append(process.exitcode)
    return codes


def test_ranks_equal_one_process_on_the_combined_batch(tmp_path, monkeypatch):
    """K updates on 2 ranks, each on its half of fixed batches with the gradient all-reduce, leave both ranks with
    identical parameters, targets and Adam moments, equal to one learner's K updates on the whole batches (same
    quantile levels per sample). The ranks start from different weights: the broadcast makes them rank 0's."""
    updates, batch = 3, 16
    codes = finish(run_ranks(ddp_ranks.parity_rank, str(tmp_path), updates, batch))
    assert codes == [0, 0]
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    flat = [distributed.state_tensors(state) for state in states]
    assert all(torch.equal(a, b) for a, b in zip(*flat, strict=True))  # the ranks agree bit for bit

    reference = make_learner(seed=0, batch=batch * WORLD)  # rank 0's initial weights
    combined = batches(updates, batch * WORLD)
    monkeypatch.setattr(torch, "rand", FixedRand(0, batch * WORLD, ddp_ranks.NET.iqn_quantiles))
    for full in combined:
        reference.update(full)
    monkeypatch.undo()
    start = make_learner(seed=0, batch=batch * WORLD)
    moved = 0
    for name, ours, theirs in zip(["online", "target", "value"], (states[0][k] for k in ("online", "target", "value")),
                                  (reference.state_dict()[k] for k in ("online", "target", "value")), strict=True):
        for key in theirs:
            # tolerance: the mean of two half-batch means vs one mean of 2B losses, float32 sums in another order
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=f"{name}.{key}")
        moved += sum(not torch.equal(theirs[k], start.state_dict()[name][k]) for k in theirs)
    assert moved > 0  # the updates moved the weights (the comparison is not of untouched copies)
    ours, theirs = (distributed.state_tensors(s["optimizer"]["state"]) for s in (states[0], reference.state_dict()))
    for a, b in zip(ours, theirs, strict=True):  # Adam's step counts and moments
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    assert int(states[0]["step"]) == updates


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_failed_rank_ends_the_job_with_an_error(tmp_path, mode):
    """Rank 1 dies (or stops answering) after one update: rank 0's next all-reduce fails with a message naming the
    cause and the way on, within the timeout (a closed connection: at once), and rank 0's process ends."""
    processes = run_ranks(ddp_ranks.failing_rank, str(tmp_path), mode, 3.0)
    processes[0].join(JOIN_S)
    assert not processes[0].is_alive(), "rank 0 hung"
    rest = finish(processes[1:], wait_s=0 if mode == "hang" else JOIN_S)
    assert rest == ([3] if mode == "exit" else [None])  # the dead rank's own status; the hung one was killed
    message = (tmp_path / "rank0.txt").read_text()
    assert "rank 0 of 2: the gradient all-reduce failed" in message
    assert "train.dist_timeout (3 s)" in message and "--resume" in message
    assert processes[0].exitcode == 0


def test_resume_with_another_world_size_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_checkpoint(run_dir / CHECKPOINT_NAME, {"epoch": 1, "world_size": 2, "replay": {}})
    with pytest.raises(UserError, match=r"job of 2 rank\(s\) and this one has 1.*--gpus 2"):
        checked_resume_state(Config(), run_dir, torch.device("cpu"))
    distributed.check_world_size({"world_size": 2}, 2, run_dir)  # the same world size resumes
    distributed.check_world_size({}, 1, run_dir)  # a checkpoint of one process (older: no key) resumes on one
    with pytest.raises(UserError, match="--gpus 1"):
        distributed.check_world_size({}, 4, run_dir)


def test_components_come_from_the_real_gradients():
    learner = make_learner(seed=0, batch=32)
    job = distributed.Distributed(0, 4, 0, "nccl", torch.device("cpu"), 60.0)
    sync = job.gradient_sync(learner.params)
    gradient_bytes = sum(p.grad.numel() * p.grad.element_size() for p in learner.params)
    assert sync.nbytes == gradient_bytes > 0
    components = {c.name: c for c in distributed_components(4, sync.nbytes, "cuda", environ={})}
    assert components[ALLREDUCE].fixed_bytes == gradient_bytes and components[ALLREDUCE].per_sample_bytes == 0
    # NCCL defaults: 4 MiB + 512 KiB + 4,800 KiB per connection, rounded to 10 MiB; 32 channels x 3 connections
    assert components[NCCL].fixed_bytes == NCCL_INIT_BYTES + 32 * 3 * (10 << 20)
    assert NCCL_LL_BUFFSIZE == 512 << 10 and NCCL_LL128_BUFFSIZE == 4800 << 10
    small, text = nccl_bytes(2, {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "4"})
    assert small == NCCL_INIT_BYTES + 4 * 3 * (8 << 20) and "NCCL_BUFFSIZE=1048576" in text  # 1 MiB + 5,312 KiB
    assert [c.name for c in distributed_components(2, gradient_bytes, "cpu")] == [ALLREDUCE]  # gloo: no NCCL
    one = distributed_components(1, gradient_bytes, "cuda")  # one rank: no all-reduce, the communicator's init
    assert [(c.name, c.fixed_bytes) for c in one] == [(NCCL, NCCL_INIT_BYTES)]
    assert distributed_components(1, gradient_bytes, "cpu") == []


def test_gradient_sync_averages(monkeypatch):
    """The all-reduce sums; the sync leaves the mean of the ranks' gradients (here a fake 2-rank sum)."""
    learner = make_learner(seed=0, batch=32)
    for p in learner.params:
        p.grad.fill_(3.0)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *a, **k: tensor.mul_(2).add_(4))
    distributed.Distributed(0, 2, 0, "gloo", torch.device("cpu"), 60.0).gradient_sync(learner.params)()
    assert all(torch.all(p.grad == 5.0) for p in learner.params)  # (3 + 7) / 2


def test_outside_torchrun_there_is_no_job_and_ranks_seed_apart():
    assert distributed.setup(TrainConfig(), environ={}) is None
    assert distributed.world_size_of({}) == 1
    config = Config()
    seeds = [distributed.Distributed(r, 3, r, "gloo", torch.device("cpu"), 1.0).rank_config(config).train
             for r in range(3)]
    assert seeds[0].seed == config.train.seed and len({s.seed for s in seeds}) == 3
    assert {s.gpus for s in seeds} == {3}


def test_rank_device_refuses_one_gpu_for_all_ranks():
    with pytest.raises(UserError, match="every rank on one GPU"):
        distributed.rank_device("cuda:0", 1, 2)
    assert distributed.rank_device("cpu", 1, 2) == torch.device("cpu")


def test_gpus_launches_torchrun_with_the_same_arguments(monkeypatch):
    command = distributed.torchrun_command(2, ["train", "--gpus", "2", "--epochs", "3"])
    assert command[:5] == [sys.executable, "-m", "fitdqn.train.launch", "--standalone", "--nproc-per-node=2"]
    assert command[5:] == ["-m", "fitdqn", "train", "--gpus", "2", "--epochs", "3"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(UserError, match="no CUDA GPU; --device cpu --gpus 2"):
        distributed.launch(2, "auto", ["train"])


def test_cli_refuses_gpus_beyond_the_machine(monkeypatch, capsys):
    from fitdqn.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["train", "--gpus", "2", "--data", "synthetic"]) == 2
    assert "--gpus 2: this machine has no CUDA GPU" in capsys.readouterr().err
    assert main(["train", "--gpus", "2", "--seeds", "2", "--device", "cpu"]) == 2
    assert "--seeds/--folds" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")
def test_gradient_all_reduce_is_captured_with_the_update_on_nccl(tmp_path):
    """NCCL, one rank per GPU present (at most 2): the update with its all-reduce, captured in a CUDA graph, gives
    what the eager update gives (the graph test's tolerance), and every rank ends equal."""
    world = min(torch.cuda.device_count(), 2)
    codes = finish(run_ranks(ddp_ranks.captured_rank, str(tmp_path), 3, world=world, method="spawn"))
    assert codes == [0] * world
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True, map_location="cpu") for r in range(world)]
    for state in states:
        for key in state["eager"]["online"]:
            torch.testing.assert_close(state["graphed"]["online"][key], state["eager"]["online"][key], rtol=1e-4,
                                       atol=1e-5, msg=key)
        for key, value in state["eager_out"].items():  # outputs of the last update
            torch.testing.assert_close(state["graphed_out"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        assert int(state["graphed"]["step"]) == 3
    for other in states[1:]:
        for key in states[0]["graphed"]["online"]:
            assert torch.equal(other["graphed"]["online"][key], states[0]["graphed"]["online"][key]), key
