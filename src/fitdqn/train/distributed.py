"""Data-parallel training over ``torch.distributed``: one process (rank) per device, launched by torchrun.

``fitdqn train --gpus N`` runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m fitdqn
train ...`` (:func:`launch`); ``torchrun --nproc-per-node N -m fitdqn train ...`` works as well. Each rank:

- joins the process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT``): NCCL on CUDA (device ``cuda:LOCAL_RANK``), gloo on the CPU, with
  ``train.dist_timeout`` on every collective, so a rank that dies or hangs ends the job with an error;
- seeds its own envs, replay sampling and exploration (:meth:`Distributed.rank_config`: rank 0 keeps
  ``train.seed``), collects into its own replay shard, and probes and plans its own device;
- agrees on one batch with the others: the smallest planned batch (all-reduce MIN), which fits every rank;
- starts from rank 0's parameters, targets and optimizer state (:meth:`Distributed.broadcast_learner`), and
  averages the gradients of every update in one all-reduce of a flat buffer (:class:`GradientAllReduce`),
  inside the captured update on CUDA, between backward and the clip and optimizer step: parameters, targets
  and optimizer state stay identical on every rank. One update thus learns from ``world_size x batch``
  samples: the learning-rate and target rules are applied at that batch (``learner.set_batch_size``).

Rank 0 alone writes the run directory, validates, checkpoints and reports; the others wait at the end of each
epoch (:meth:`Distributed.agree`, which also makes every rank stop at the same epoch) and at the end of the run
(:meth:`Distributed.barrier`). The checkpoint records the world size; a resume with another is refused. A
resumed job of several ranks continues rank 0's replay on every rank (the other shards are not saved), each
rank re-seeded: it continues the run, not bit for bit.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fitdqn.config import SEED_MAX, Config, TrainConfig
from fitdqn.errors import UserError

RANK_SEED_STRIDE = 1_000_003  # rank r seeds with seed + r x this (a prime far from the +1, +2 of the generators)
WORLD_SIZE_KEY = "world_size"  # what a checkpoint records


class DistributedError(UserError):
    """A collective failed: another rank died, or did not answer within ``train.dist_timeout``."""


def launched_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


def world_size_of(environ: Mapping[str, str] | None = None) -> int:
    """The job's world size: torchrun's ``WORLD_SIZE``, else 1."""
    environ = os.environ if environ is None else environ
    return _env_int(environ, "WORLD_SIZE") if launched_by_torchrun(environ) else 1


def _env_int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except (KeyError, ValueError):
        raise UserError(f"torchrun's {key} is {environ.get(key)!r}, not a number: launch with "
                        "`fitdqn train --gpus N` or `torchrun --nproc-per-node N -m fitdqn train`") from None


@dataclasses.dataclass
class Distributed:
    """This process's place in a data-parallel job (the process group is the default one)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" | "gloo"
    device: torch.device
    timeout_s: float

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes the run directory, validates, checkpoints and reports."""
        return self.rank == 0

    def rank_config(self, config: Config) -> Config:
        """This rank's config: its own seed (rank 0 keeps ``train.seed``), ``train.gpus`` = the world size."""
        seed = (config.train.seed + RANK_SEED_STRIDE * self.rank) % (SEED_MAX + 1)
        return dataclasses.replace(config, train=dataclasses.replace(config.train, seed=seed,
                                                                     gpus=self.world_size))

    # ------------------------------------------------------------ collectives (host syncs: setup, epoch ends)
    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, dist.DistError) as error:  # gloo/NCCL: a closed connection or a timeout
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} failed: another rank died or did not answer "
                f"within train.dist_timeout ({self.timeout_s:g} s); see the other ranks' output. A run that has a "
                f"checkpoint continues with --resume RUN_DIR. ({first_line(error)})") from None

    def agree_batch(self, batch_size: int) -> int:
        """The job's batch: the smallest any rank planned (it fits every rank's device)."""
        value = torch.tensor([int(batch_size)], dtype=torch.int64, device=self.device)
        with self._guard("agreeing on the batch size"):
            dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())  # host sync: once, at setup

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true if it is on any rank (all-reduce MAX). Called by every rank at the end of an epoch, it
        is also where the others wait for rank 0's validation and checkpoint."""
        value = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=self.device)
        with self._guard("the end-of-epoch meeting of the ranks"):
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in value.tolist())  # host sync: once an epoch

    def barrier(self, what: str = "the barrier") -> None:
        with self._guard(what):
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` (the same list on every rank) with rank 0's, in place."""
        with self._guard("the broadcast of rank 0's state"), torch.no_grad():
            for tensor in tensors:
                moved = tensor.device != self.device
                buffer = tensor.detach().to(self.device) if moved else tensor.detach()
                dist.broadcast(buffer, src=0)
                if moved:
                    tensor.copy_(buffer)

    def broadcast_learner(self, learner: Any) -> None:
        """Rank 0's nets, target nets, value net, optimizer state and step counter on every rank (in place:
        addresses stay, so a captured graph stays valid)."""
        self.broadcast_(state_tensors(learner.state_dict()))

    def gradient_sync(self, params: Sequence[torch.Tensor]) -> GradientAllReduce:
        """The learner's ``gradient_sync``: averages ``params``' gradients across the ranks."""
        return GradientAllReduce(params, self)

    # ------------------------------------------------------------ checkpoints
    def reseed(self, trainer: Any) -> None:
        """After a resume, ranks other than 0 (which loaded rank 0's checkpoint) draw their own numbers again."""
        if self.main:
            return
        base = trainer.config.train.seed + 7919 * (int(trainer.epoch) + 1)
        for offset, generator in enumerate((trainer.system.sample_generator, trainer.system.act_generator,
                                            getattr(trainer.system.env, "generator", None))):
            if generator is not None:
                generator.manual_seed((base + offset + 1) % (SEED_MAX + 1))
        torch.manual_seed(base % (SEED_MAX + 1))

    # ------------------------------------------------------------ until the trainer takes these itself
    def attach(self, trainer: Any) -> None:
        """Join ``trainer`` (built from :meth:`rank_config`, its learner with this job's :meth:`gradient_sync`) to
        the job: the agreed batch, the learning rules at the job's batch, rank 0's learner state."""
        batch = self.agree_batch(trainer.batch_size)
        if batch != trainer.batch_size:
            trainer.set_batch_size(batch)
        self.learning_batch(trainer)
        self.broadcast_learner(trainer.system.learner)

    def learning_batch(self, trainer: Any) -> None:
        """One update averages ``world_size x batch`` samples: lr and target rules at that batch."""
        trainer.system.learner.set_batch_size(trainer.batch_size * self.world_size)

    def close(self) -> None:
        global _CURRENT
        if dist.is_initialized():
            dist.destroy_process_group()
        _CURRENT = None


class GradientAllReduce:
    """Average the gradients of ``params`` over the ranks: copy them into one flat buffer per dtype, all-reduce
    each buffer (sum) once, divide by the world size, copy back. No host sync: on CUDA it is captured with the
    update (NCCL collectives can be captured in a CUDA graph). The buffers are the ``all_reduce`` component
    (:func:`fitdqn.memory.distributed.distributed_components`)."""

    def __init__(self, params: Sequence[torch.Tensor], job: Distributed) -> None:
        self.job = job
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            raise ValueError("every parameter needs its gradient allocated before the all-reduce is built")
        self.buckets: list[tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]] = []
        for dtype in sorted({g.dtype for g in grads}, key=str):
            members = [g for g in grads if g.dtype == dtype]
            flat = torch.zeros(sum(g.numel() for g in members), dtype=dtype, device=members[0].device)  # [P]
            views, offset = [], 0
            for g in members:
                views.append(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            self.buckets.append((members, flat, views))

    @property
    def nbytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for _, flat, _ in self.buckets)

    def __call__(self) -> None:
        scale = 1.0 / self.job.world_size
        for grads, flat, views in self.buckets:
            torch.cat([g.reshape(-1) for g in grads], out=flat)
            with self.job._guard("the gradient all-reduce"):
                dist.all_reduce(flat)
            flat.mul_(scale)
            for grad, view in zip(grads, views, strict=True):
                grad.copy_(view)


class NullLogger:
    """The run logger of ranks other than 0: they log nothing (rank 0 writes metrics.jsonl and TensorBoard)."""

    records = 0
    dropped = 0

    def log(self, step: int, kind: str, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def state_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts in key order, lists in order): the same list on every rank."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, Mapping):
        return [t for key in state for t in state_tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in state_tensors(item)]
    return []


def check_world_size(state: Mapping[str, Any], world_size: int, run_dir: Any) -> None:
    """Refuse to resume a checkpoint written by a job of another world size (older checkpoints: 1)."""
    saved = int(state.get(WORLD_SIZE_KEY, 1))
    if saved != world_size:
        raise UserError(
            f"the checkpoint in '{run_dir}' was written by a job of {saved} rank(s) and this one has {world_size}: "
            f"the replay shards, batch and learning rules belong to {saved}; resume with --gpus {saved} "
            "(or torchrun --nproc-per-node " f"{saved}), or start a new run")


_CURRENT: Distributed | None = None


def current_job() -> Distributed | None:
    """The job this process joined (:func:`setup`), or None."""
    return _CURRENT


def setup(train: TrainConfig, environ: Mapping[str, str] | None = None) -> Distributed | None:
    """Join the job torchrun started (once per process; later calls return the same), or None outside torchrun.

    NCCL on CUDA (this rank's device: ``cuda:LOCAL_RANK``), gloo on the CPU (``train.device cpu``, or no GPU).
    NVLink SHARP is turned off (``NCCL_NVLS_ENABLE=0``) unless set: its buffers are not in the plan.
    """
    global _CURRENT
    environ = os.environ if environ is None else environ
    if not launched_by_torchrun(environ):
        return None
    if _CURRENT is not None:
        return _CURRENT
    rank, world, local = (_env_int(environ, k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
    if missing:
        raise UserError(f"{' and '.join(missing)} not set: launch with `fitdqn train --gpus N` or torchrun")
    device = rank_device(train.device, local, world)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(device)  # train.device 'auto' / 'cuda' resolve to it from here on
    job = Distributed(rank, world, local, backend, device, float(train.dist_timeout))
    with job._guard("joining the process group"):
        dist.init_process_group(backend, timeout=timedelta(seconds=train.dist_timeout),
                                device_id=device if backend == "nccl" else None)
    _CURRENT = job
    atexit.register(job.close)
    return job


def rank_device(spec: str, local_rank: int, world_size: int) -> torch.device:
    """``cuda:LOCAL_RANK`` for 'auto' (with CUDA) or 'cuda'; the CPU for 'cpu' (or 'auto' without CUDA)."""
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if spec not in ("auto", "cuda"):
        if world_size > 1:
            raise UserError(f"train.device {spec!r} with {world_size} ranks would put every rank on one GPU: "
                            "leave train.device auto (or cuda); rank r uses cuda:LOCAL_RANK")
        return torch.device(spec)
    if not torch.cuda.is_available():
        raise UserError("train.device cuda under torchrun, but this machine has no CUDA GPU: use --device cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"LOCAL_RANK {local_rank}, but this machine has {torch.cuda.device_count()} GPU(s): "
                        f"launch at most {torch.cuda.device_count()} processes per node")
    return torch.device("cuda", local_rank)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


# ---------------------------------------------------------------- the launcher behind `fitdqn train --gpus N`
def torchrun_command(processes: int, argv: Sequence[str]) -> list[str]:
    """The command `fitdqn train --gpus N` runs: torchrun (``torch.distributed.run``, through
    :mod:`fitdqn.train.launch`: a failed rank is one line, not torchrun's traceback) on this machine, on a free
    port (``--standalone``), N copies of ``python -m fitdqn`` with the same arguments."""
    return [sys.executable, "-m", "fitdqn.train.launch", "--standalone", f"--nproc-per-node={processes}",
            "-m", "fitdqn", *argv]


def launch(processes: int, device_spec: str, argv: Sequence[str]) -> int:
    """Run ``argv`` (``train ...``) as ``processes`` ranks under torchrun; its exit status. Checked first:
    enough GPUs (or ``--device cpu`` for gloo processes on the CPU)."""
    if device_spec != "cpu":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--gpus {processes}: this machine has no CUDA GPU; --device cpu --gpus {processes} "
                            "runs that many gloo processes on the CPU")
        if processes > count:
            raise UserError(f"--gpus {processes}: this machine has {count} GPU(s); give --gpus {count} or fewer")
    elif processes > (os.cpu_count() or 1):
        raise UserError(f"--device cpu --gpus {processes}: that many gloo processes on {os.cpu_count() or 1} CPU "
                        f"core(s); give --gpus {os.cpu_count() or 1} or fewer")
    process = subprocess.Popen(torchrun_command(processes, argv))
    # Ctrl-C reaches torchrun from the terminal itself; a SIGTERM sent to this process is passed on
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, _f: process.send_signal(signum))}
    try:
        code = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, like a shell
