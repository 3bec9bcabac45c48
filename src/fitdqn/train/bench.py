"""`fitdqn bench`: throughput of the three hot loops on the present device, with the real Trainer objects.

The config is planned and allocated exactly as ``fitdqn train`` would (``Trainer``), then:

- **collector**: ``Collector.run`` (policy in the loop: observe -> ``Learner.act`` -> env step -> replay write),
  env steps/s = ``num_envs x steps / s``; eager, and on CUDA replaying the captured collector graph
  (``Trainer.collect`` captures it);
- **replay**: ``ReplayBuffer.sample`` at the planned batch + ``update_priorities``, samples/s; eager, and on
  CUDA replaying one graph of both;
- **update**: ``Trainer.update_step`` (sample -> update -> priorities) at the planned batch, updates/s and
  samples/s; eager, and on CUDA replaying the update graph the trainer captures.

Each is warmed up, then timed over up to ``iters`` calls (collector: ``collect_steps`` steps) or ``seconds``,
whichever ends first, between two host syncs (wall clock). Graphed rows need a
CUDA device and ``train.cuda_graphs``. On a CPU a small config runs in seconds
(``fitdqn bench --collect.num_envs 64 --market.data synthetic``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fitdqn.config import Config
from fitdqn.device.graphs import capture_graph
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.train.trainer import Trainer

WARMUP = 2


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: a timing boundary


def timed(fn: Callable[[], Any], device: torch.device, iters: int, seconds: float = float("inf")
          ) -> tuple[float, int]:
    """(seconds, calls) for up to ``iters`` calls of ``fn``, stopping early once ``seconds`` have passed
    (at least one call). Host syncs before and after, none between (on CUDA the clock then reads launch
    time, so the budget is approximate; the reported time is not)."""
    sync(device)
    start = time.perf_counter()
    calls = 0
    while calls < iters:
        fn()
        calls += 1
        if time.perf_counter() - start >= seconds:
            break
    sync(device)
    return max(time.perf_counter() - start, 1e-9), calls


def capture(fn: Callable[[], Any], device: torch.device, generators=(), stream=None) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` the way the trainer does (``fitdqn.device.graphs.capture_graph``)."""
    return capture_graph(fn, device, stream, WARMUP, generators)[0]


def fill_replay(trainer, needed: int, max_rounds: int = 10_000) -> None:
    """Collector steps until ``needed`` transitions can be sampled."""
    chunk = max(trainer.config.learn.n_step + 1, 4)
    for _ in range(max_rounds):
        if int(trainer.system.replay.sampleable()) >= needed:  # host sync
            return
        trainer.system.collector.run(chunk)
    raise UserError(f"the replay never held {needed} sampleable transitions: raise collect.num_envs or "
                    "replay.capacity")


def run_bench(config: Config, *, iters: int, collect_steps: int, seconds: float) -> dict[str, Any]:
    """Build the Trainer for ``config`` on its device and time collector, replay and update (module doc).

    Each timed row runs up to ``iters`` calls (``collect_steps`` collector steps) or ``seconds``, whichever
    comes first; the counts actually run are in the result."""
    if iters < 1 or collect_steps < 1 or seconds <= 0:
        raise UserError(f"iters ({iters}) and collect_steps ({collect_steps}) must be at least 1, seconds ({seconds}) "
                        "positive")
    trainer = Trainer(config, log=lambda *_: None)
    try:
        return _bench(trainer, iters, collect_steps, seconds)
    except torch.OutOfMemoryError as error:
        raise UserError(
            f"out of device memory during the bench at batch {trainer.batch_size} on {trainer.device_info.name}: the "
            f"plan did not hold (another process, or a plan error: check with fitdqn plan --calibrate); "
            f"{str(error).splitlines()[0][:200]}") from None


def _bench(trainer, iters: int, collect_steps: int, seconds: float) -> dict[str, Any]:
    device = trainer.device
    cuda = device.type == "cuda"
    graphs = trainer.graphs_enabled
    batch = trainer.batch_size
    num_envs = trainer.config.collect.num_envs
    result: dict[str, Any] = {
        "device": trainer.device_info.name, "kind": device.type, "torch": torch.__version__,
        "batch_size": batch, "batch_source": trainer.plan.batch_source, "num_envs": num_envs,
        "replay_capacity": trainer.plan.replay_capacity, "max_iters": iters, "max_collect_steps": collect_steps,
        "max_seconds": seconds, "graphs": graphs, "collector": {}, "replay": {}, "update": {},
    }

    # collector: eager steps first (no graph yet), then the trainer's captured step
    warmup = WARMUP if cuda else 1
    collector = trainer.system.collector
    collector.run(warmup)
    step = lambda: collector.run(1)  # noqa: E731 - eager until captured, then a graph replay
    result["collector"]["eager"] = collector_row(num_envs, *timed(step, device, collect_steps, seconds))
    if graphs:
        trainer.collect()  # captures the collector graph (and collects an epoch)
        collector.run(warmup)
        result["collector"]["graphed"] = collector_row(num_envs, *timed(step, device, collect_steps, seconds))
    fill_replay(trainer, batch)

    # replay: sample at the planned batch + new priorities
    replay, generator, beta = trainer.system.replay, trainer.system.sample_generator, trainer.system.beta
    priorities = torch.rand(batch, device=device) + 0.1  # [B]

    def replay_step() -> None:
        sampled = replay.sample(batch, beta, generator)
        replay.update_priorities(sampled["index"], priorities)

    for _ in range(warmup):
        replay_step()
    result["replay"]["eager"] = sample_row(batch, *timed(replay_step, device, iters, seconds))
    if graphs:
        graph = capture(replay_step, device, (generator,), getattr(trainer, "capture_stream", None))
        graph.replay()
        result["replay"]["graphed"] = sample_row(batch, *timed(graph.replay, device, iters, seconds))
        del graph

    # update: the trainer's step, eager, then its captured graph
    for _ in range(warmup):
        trainer.update_step()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result["update"]["eager"] = update_row(batch, *timed(trainer.update_step, device, iters, seconds))
    if graphs:
        trainer.train_updates(WARMUP + 1)  # two warm-up updates, the capture, one replay
        update = lambda: trainer.train_updates(1)  # noqa: E731 - a graph replay
        result["update"]["graphed"] = update_row(batch, *timed(update, device, iters, seconds))
    if cuda:
        result["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return result


def collector_row(num_envs: int, seconds: float, steps: int) -> dict[str, float]:
    return {"env_steps_per_s": num_envs * steps / seconds, "steps_per_s": steps / seconds,
            "ms": 1e3 * seconds / steps, "calls": steps, "seconds": seconds}


def sample_row(batch: int, seconds: float, iters: int) -> dict[str, float]:
    return {"samples_per_s": batch * iters / seconds, "iters_per_s": iters / seconds, "ms": 1e3 * seconds / iters,
            "calls": iters, "seconds": seconds}


def update_row(batch: int, seconds: float, iters: int) -> dict[str, float]:
    return {"updates_per_s": iters / seconds, "samples_per_s": batch * iters / seconds,
            "ms": 1e3 * seconds / iters, "calls": iters, "seconds": seconds}


def print_bench(result: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    title = (f"{result['device']}: batch {result['batch_size']} ({result['batch_source']}), "
             f"{result['num_envs']} envs, torch {result['torch']}")
    table = Table(title=title, title_justify="left")
    for column in ("part", "mode", "throughput", "samples/s", "ms per call"):
        table.add_column(column, justify="left" if column in ("part", "mode") else "right")
    for part, unit, key in (("update", "updates/s", "updates_per_s"), ("replay", "sample+priorities/s", "iters_per_s"),
                            ("collector", "env steps/s", "env_steps_per_s")):
        for mode, row in result[part].items():
            samples = row.get("samples_per_s")
            table.add_row(part, mode, f"{row[key]:,.1f} {unit}", "-" if samples is None else f"{samples:,.0f}",
                          f"{row['ms']:.3f}")
    console.print(table)
    if "peak_bytes" in result:
        console.print(f"allocator peak: {format_bytes(result['peak_bytes'])}", highlight=False)
