"""`fitdqn train`: probe -> plan -> allocate in plan order -> check the plan -> epochs -> evaluation.

The loop per epoch: the collector steps every env ``collect.steps_per_epoch`` times (one graph replay per
step on CUDA), then the learner updates the run's budget still owes (:mod:`fitdqn.learn.schedule`:
``train.sample_reuse`` samples per transition collected, so the run's updates and samples do not depend on
the batch the planner picks), each one graph replay on CUDA of ``sample -> build obs -> update -> new
priorities``. Host syncs happen only between phases (stats for the progress bar and logs), never inside a
step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitdqn.config import Config, config_to_dict, dump_config
from fitdqn.device.blas import reserve_blas_workspaces
from fitdqn.device.graphs import capture_graph
from fitdqn.device.probe import DeviceInfo, probe
from fitdqn.errors import UserError
from fitdqn.evaluate.backtest_graphs import BacktestGraphs
from fitdqn.files import atomic_write_text
from fitdqn.learn.schedule import Schedule, updates_owed
from fitdqn.market.layout import env_state_bytes, market_bytes
from fitdqn.market.loader import Market, load_market
from fitdqn.plan.build import PlanInputs, plan_for_device
from fitdqn.plan.planner import Plan
from fitdqn.resolve import resolve_run
from fitdqn.system import build_system
from fitdqn.train.distributed import current_job, world_size_of
from fitdqn.train.memory_check import AllocationLedger


@dataclass
class EpochStats:
    epoch: int
    env_steps: int
    updates: int
    seconds: float
    values: dict[str, float] = field(default_factory=dict)


def beta_at(config: Config, progress: float) -> float:
    """Importance-weight exponent at ``progress`` through the run's env steps (``Schedule.progress``), annealed
    linearly."""
    r = config.replay
    return r.beta_start + (r.beta_end - r.beta_start) * progress


class Trainer:
    """Owns everything a run allocates, in plan order; ``run_epoch`` is one collect + update phase."""

    def __init__(self, config: Config, device_info: DeviceInfo | None = None, market: Market | None = None,
                 log=print) -> None:
        self.log = log
        self.device_info = device_info or probe(config.train.device)
        self.device = self.device_info.torch_device
        torch.manual_seed(config.train.seed)
        if self.device.type == "cpu":
            # Adam moments and Polyak-averaged weights drift into denormals; on x86 CPUs each denormal
            # operand costs ~100 cycles (measured here: 4 s instead of 0.1 s per update at batch 256).
            torch.set_flush_denormal(True)
        self.market = market or load_market(config.market, window=config.net.window, device="cpu")
        # every 'auto' settled once (the reward scale from the training split): the run's config keeps them
        config, self.reward_info = resolve_run(config, self.device_info, self.market)  # reward_info: for the report
        # the CPU threads torch runs with (the CLI sets them from train.threads), so config.toml can repeat the run
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, threads=torch.get_num_threads()))
        self.config = config
        # a rank of a torchrun job budgets its all-reduce and NCCL's memory too
        self.plan_inputs = PlanInputs.from_market(self.market, world_size_of())
        self.plan: Plan = plan_for_device(config, self.device_info, self.plan_inputs)
        self.batch_size = self.plan.batch_size
        self.schedule = Schedule.from_config(config, self.batch_size)
        self.ledger = AllocationLedger(self.device)
        self._allocate()
        self.epoch = 0
        self.updates_done = 0
        self.samples_done = 0  # updates x their batch: what the budget counts
        self.update_graph: torch.cuda.CUDAGraph | None = None
        self.history: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None  # an epoch whose updates an OOM interrupted
        self.oom_batch_size: int | None = None  # the batch the OOM guard settled on (kept by checkpoints)
        self.on_update: Callable[[], None] | None = None  # called after each update of an epoch (a progress bar)

    # ---------------------------------------------------------------- allocation, in plan order
    def _allocate(self) -> None:
        """The one assembly (``fitdqn.system.build_system``) on the real device, each part measured."""
        config, device = self.config, self.device
        # one side stream for every graph capture: each stream gets its own cuBLAS workspaces, made first
        self.capture_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        reserve_blas_workspaces(device, (None, self.capture_stream))
        job = current_job()  # a rank of a data-parallel job: its learner averages the gradients across the ranks
        self.system = build_system(
            config, self.market, device, capacity=self.plan.budgets.replay_capacity, batch_size=self.batch_size,
            epsilon_decay_steps=self.schedule.epsilon_decay_steps, measure=self.ledger.measure,
            gradient_sync=job.gradient_sync if job is not None and job.world_size > 1 else None)
        # the backtests as graph replays, captured into the collector graph's pool (its pages budgeted)
        self.backtests = BacktestGraphs(self.capture_stream, pool=self._collector_pool) if self.graphs_enabled else None

    # train/run.py's names for two of the system's parts (everything else reads ``trainer.system``)
    market_on_device = property(lambda self: self.system.market)
    learner = property(lambda self: self.system.learner)

    def persistent_bytes(self) -> dict[str, int]:
        """What the collector phase allocates for good (its component also budgets the collector step's peak)."""
        return {"collector": market_bytes(self.market.num_bars) + env_state_bytes(self.config.collect.num_envs)}

    # ---------------------------------------------------------------- the update step (capturable)
    def update_step(self) -> None:
        self.system.update_step()

    def _capture_update(self) -> None:
        """Capture :meth:`update_step` in a CUDA graph (after warm-up steps, which are real updates)."""
        def counted_update() -> None:
            self.update_step()
            self.updates_done += 1

        self.update_graph, _ = capture_graph(counted_update, self.device, self.capture_stream, warmup=2,
                                             generators=(self.system.sample_generator,),
                                             premap_bytes=self._premap_bytes())
        self.updates_done -= 1  # the captured call is recorded, not run

    def _premap_bytes(self) -> int:
        """Under PyTorch's per-process memory cap, what the plan budgets for the update graph's pool at this
        batch (every per-sample byte of the step, and the pool's pages), mapped before the capture
        (``device.graphs``: the capped allocator would charge a growth its whole request); else 0."""
        if self.device_info.allocator_limit_bytes is None:
            return 0
        return self.plan.per_sample_bytes * self.batch_size + self.plan.budgets.graph_pool_fixed_bytes

    def _collector_pool(self) -> tuple | None:
        return self.system.collector.graph.pool() if self.system.collector.graph is not None else None

    @property
    def graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and self.config.train.cuda_graphs

    def set_batch_size(self, batch_size: int) -> None:
        """A new batch (OOM guard): the update graph is rebuilt at the next update."""
        self.batch_size = batch_size
        self.schedule = Schedule.from_config(self.config, batch_size)
        self.system.set_batch_size(batch_size)
        self.update_graph = None

    # ---------------------------------------------------------------- one epoch
    def collect(self) -> dict[str, float]:
        steps = self.config.collect.steps_per_epoch
        if self.graphs_enabled and self.system.collector.graph is None:
            self.system.collector.capture(self.capture_stream)
            steps = max(steps - 3, 0)  # the capture ran 2 warm-up steps + 1 captured step
        self.system.collector.run(steps)
        return self.system.collector.take_stats()  # host sync: epoch stats

    def can_update(self) -> bool:
        # min_fill alone, not the batch: a batch larger than what is stored draws with replacement (the sampler's
        # way anyway), so a large batch starts learning when a small one does instead of epochs later
        return int(self.system.replay.sampleable()) >= max(self.schedule.min_fill, 1)  # host sync

    @property
    def env_steps_done(self) -> int:
        return self.epoch * self.schedule.env_steps_per_epoch

    def updates_due(self) -> int:
        """Updates the budget owes after this epoch's collection (those before min_fill included)."""
        collected = self.env_steps_done + self.schedule.env_steps_per_epoch
        return updates_owed(self.schedule.sample_reuse, collected, self.samples_done, self.batch_size)

    def train_updates(self, count: int) -> int:
        done = 0
        if self.graphs_enabled and self.update_graph is None and count > 0:
            before = self.updates_done
            self._capture_update()
            done += self.updates_done - before
        while done < count:
            if self.update_graph is not None:
                self.update_graph.replay()
            else:
                self.update_step()
            self.updates_done += 1
            done += 1
        return done

    def run_epoch(self) -> EpochStats:
        """Collect, then update; after an out-of-memory error (OomGuard) only the missing updates run again."""
        start = time.perf_counter()
        if self.pending is None:
            progress = self.schedule.progress(self.env_steps_done)
            self.system.beta.fill_(beta_at(self.config, progress))
            self.system.learner.set_lr_progress(progress)
            self.pending = {"collected": self.collect(), "updates": 0}  # host sync: the collector's stats
            self.pending["collect_seconds"] = time.perf_counter() - start
        collected = self.pending["collected"]
        collect_seconds = self.pending["collect_seconds"]
        update_start = time.perf_counter()
        if self.can_update():
            while self.updates_due() > 0:  # re-read after each update: an OOM re-plan changes the batch
                done = self.train_updates(1)
                self.pending["updates"] += done
                self.samples_done += done * self.batch_size  # the budget counts the epochs' updates only
                if self.on_update is not None:
                    self.on_update()
        updates = self.pending["updates"]
        self.pending = None
        values = ({key: float(v) / updates for key, v in self.system.stat_sums.items()}  # host sync
                  if updates else {})  # no update yet (replay below min_fill): no losses to report
        for v in self.system.stat_sums.values():
            v.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        update_seconds = time.perf_counter() - update_start
        env_steps = self.schedule.env_steps_per_epoch
        values.update({  # each rate per second of its own phase (collection, updates)
            "collect_reward": collected["reward"] / env_steps, "collect_pnl": collected["pnl"],
            "episodes_done": collected["episodes_done"], "env_steps_per_s": env_steps / max(collect_seconds, 1e-9),
            "updates_per_s": updates / max(update_seconds, 1e-9), "batch_size": self.batch_size,
        })
        if self.device.type == "cuda":
            values["gpu_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.epoch += 1
        stats = EpochStats(self.epoch, env_steps, updates, seconds, values)
        return stats

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        system = self.system
        return {
            "config": config_to_dict(self.config),
            "epoch": self.epoch,
            "updates_done": self.updates_done,
            "samples_done": self.samples_done,
            "batch_size": self.batch_size,
            "oom_batch_size": self.oom_batch_size,
            "learner": system.learner.state_dict(),
            "replay": system.replay.state_dict(),
            "collector": system.collector.state_dict(),
            "generators": {"sample": system.sample_generator.get_state(), "act": system.act_generator.get_state(),
                           "torch_cpu": torch.get_rng_state(),
                           "torch_cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda"
                           else torch.empty(0, dtype=torch.uint8)},
            "history": self.history,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_net = state["config"]["net"]
        current = config_to_dict(self.config)["net"]
        if saved_net != current:
            changed = sorted(k for k in current if saved_net.get(k) != current[k])
            raise UserError(
                f"checkpoint networks differ from this config in net.{', net.'.join(changed)}: resume with the "
                "run's own config.toml, or start a new run"
            )
        self.system.learner.load_state_dict(state["learner"])
        if "replay" in state:  # a finished run's checkpoint may leave it out (train.keep_replay)
            self.system.replay.load_state_dict(state["replay"])
        self.system.collector.load_state_dict(state["collector"])
        # generator states are CPU byte tensors, whatever device the checkpoint was mapped to (a CUDA run's is)
        generators = {name: value.cpu() for name, value in state["generators"].items()}
        self.system.sample_generator.set_state(generators["sample"])
        self.system.act_generator.set_state(generators["act"])
        torch.set_rng_state(generators["torch_cpu"])
        if self.device.type == "cuda" and generators["torch_cuda"].numel():
            torch.cuda.set_rng_state(generators["torch_cuda"], self.device)
        self.epoch = int(state["epoch"])
        self.updates_done = int(state["updates_done"])
        self.samples_done = int(state["samples_done"])
        self.system.set_batch_size(self.batch_size)  # the rules at this run's batch (the loaded lr is the saved one)
        self.history = list(state["history"])
        if state.get("oom_batch_size"):  # the OOM guard's batch outlives the process (never above this plan's)
            self.oom_batch_size = min(int(state["oom_batch_size"]), self.plan.batch_size)
            self.set_batch_size(self.oom_batch_size)


def write_run_config(run_dir: Path, config: Config) -> None:
    atomic_write_text(run_dir / "config.toml", dump_config(config))
