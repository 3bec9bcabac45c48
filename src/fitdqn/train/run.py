"""A whole run: plan table, allocation check, epochs with a progress bar, evaluation, checkpoints, report.

Run directory::

    config.toml      the config used (resume reads it back)
    plan.json        the memory plan, plus what the device reported after allocating
    metrics.jsonl    one line per epoch / evaluation; tensorboard/ holds the same scalars
    checkpoint.pt    the latest checkpoint (atomic write; loads with weights_only=True)
    report.json, report.md, equity_test.png, learning_curves.png, vram.png
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fitdqn.budget.report import plot_plan, print_plan
from fitdqn.config import Config, load_config
from fitdqn.device.probe import probe
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.train.checkpoint import atomic_write_text
from fitdqn.train.evaluate import evaluate_split
from fitdqn.train.logs import RunLogger, read_jsonl
from fitdqn.train.memory_check import format_rows, peak_memory_row
from fitdqn.train.oom import OomGuard
from fitdqn.train.plots import plot_equity, plot_learning_curves
from fitdqn.train.trainer import CHECKPOINT_NAME, Trainer, write_run_config


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def resume_config(run_dir: Path) -> Config:
    path = run_dir / "config.toml"
    if not path.is_file():
        raise UserError(f"'{run_dir}' has no config.toml: not a fitdqn run directory (fitdqn train --out writes one)")
    return load_config(path)


def train(config: Config, run_dir: Path, resume: bool = False, console: Console | None = None,
          trainer_hook=None, on_epoch=None) -> dict[str, Any]:
    """Train (or resume) a run in ``run_dir``; returns the report. ``on_epoch(record) -> bool`` sees each epoch's
    record after it is logged; True ends the run there (saved and reported as if its epochs were done)."""
    console = console or Console()
    if resume and not (run_dir / CHECKPOINT_NAME).is_file():
        raise UserError(f"cannot resume: no {CHECKPOINT_NAME} in '{run_dir}'; start a new run without --resume")
    if not resume and (run_dir / CHECKPOINT_NAME).exists():
        raise UserError(f"'{run_dir}' already holds a run ({CHECKPOINT_NAME}): continue it with --resume "
                        f"{run_dir}, or give another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    device_info = probe(config.train.device)
    trainer = Trainer(config, device_info)
    print_plan(trainer.plan, console, trainer.schedule, trainer.reward_info)
    if resume:
        trainer.restore(run_dir)
        console.print(f"resumed from {run_dir / CHECKPOINT_NAME} at epoch {trainer.epoch}")
    config = trainer.config  # with the device's auto values resolved: what a resume must use
    write_run_config(run_dir, config)
    plan_record = {**trainer.plan.to_json(),
                   "allocated": trainer.ledger.compare(trainer.plan, trainer.persistent_bytes())}
    for line in format_rows(plan_record["allocated"]):
        console.print(line, highlight=False)
    if trainer.device.type != "cuda":
        console.print("memory check: the CPU has no allocator statistics; the plan is checked on CUDA devices",
                      style="dim")
    plot_plan(trainer.plan, run_dir / "vram.png")
    if trainer_hook is not None:
        trainer_hook(trainer)

    logger = RunLogger(run_dir)
    guard = OomGuard(trainer, console, logger)
    deadline = time.monotonic() + 60 * config.train.minutes if config.train.minutes > 0 else None
    try:
        with progress_bar(console) as progress:
            task = progress.add_task("train", total=config.train.epochs, completed=trainer.epoch, status="")
            while trainer.epoch < config.train.epochs:
                stats = guard.run_epoch()
                record = {"epoch": stats.epoch, "updates": stats.updates, "seconds": stats.seconds, **stats.values}
                if stats.epoch % config.train.eval_every == 0 or stats.epoch == config.train.epochs:
                    validation, _ = evaluate_split(trainer.learner, trainer.market_on_device, config, "validation",
                                                   seeds=0)
                    record["validation_sharpe"] = validation["agent"]["sharpe"]
                    record["validation_return"] = validation["agent"]["total_return"]
                trainer.history.append(record)
                logger.log(stats.epoch, "epoch", record)
                progress.update(task, completed=stats.epoch, status=status_line(record))
                if not console.is_terminal:  # logs and pipes get one line per epoch instead of a live bar
                    console.print(f"epoch {stats.epoch}/{config.train.epochs}  {status_line(record)}",
                                  highlight=False)
                if stats.epoch % config.train.checkpoint_every == 0:
                    trainer.save(run_dir)
                if on_epoch is not None and on_epoch(record):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    console.print(f"time limit of {config.train.minutes:g} min reached at epoch {stats.epoch}")
                    break
    except KeyboardInterrupt:
        trainer.save(run_dir)
        logger.close()
        console.print(f"interrupted: checkpoint saved at epoch {trainer.epoch}; resume with --resume {run_dir}")
        raise
    trainer.save(run_dir)
    if trainer.device.type == "cuda":
        plan_record["peak"] = peak_memory_row(trainer.plan, torch.cuda.max_memory_reserved(trainer.device))
        for line in format_rows([plan_record["peak"]]):
            console.print(line, highlight=False)
    atomic_write_text(run_dir / "plan.json", json.dumps(plan_record, indent=2))
    report = final_report(trainer, run_dir, console)
    logger.log(trainer.epoch, "test", {"sharpe": report["test"]["agent"]["sharpe"]})
    logger.close()
    return report


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]epoch"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"), console=console, transient=False,
    )


def status_line(record: dict[str, Any]) -> str:
    parts = [
        f"env {record.get('env_steps_per_s', 0):,.0f}/s",
        f"upd {record.get('updates_per_s', 0):,.1f}/s",
        f"loss {record['loss']:.3f}" if "loss" in record else "filling replay",
    ]
    if "validation_sharpe" in record:
        parts.append(f"val Sharpe {record['validation_sharpe']:.2f}")
    if "gpu_memory_gib" in record:
        parts.append(f"mem {record['gpu_memory_gib']:.2f} GiB")
    return "  ".join(parts)


def final_report(trainer: Trainer, run_dir: Path, console: Console) -> dict[str, Any]:
    """Test and validation backtests beside the baselines; report.json, report.md and plots."""
    config = trainer.config
    report: dict[str, Any] = {"epochs": trainer.epoch, "updates": trainer.updates_done,
                              "env_steps": trainer.env_steps_done, "samples": trainer.samples_done,
                              "schedule": trainer.schedule.to_json(), "reward": trainer.reward_info.describe(),
                              "batch_size": trainer.batch_size, "batch_source": trainer.plan.batch_source,
                              "device": trainer.device_info.name}
    curves, times = {}, None
    for split in ("validation", "test"):
        results, backtest = evaluate_split(trainer.learner, trainer.market_on_device, config, split)
        report[split] = results
        if split == "test":
            capital = results["capital"]
            curves = {"agent": capital + backtest.equity, "buy and hold": capital + backtest.buy_and_hold}
            times = backtest.timestamp
    plot_equity(curves, run_dir / "equity_test.png", f"test split: {config.market.data}", times)
    plot_learning_curves(
        [{"step": r["step"], **r} for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "epoch"],
        run_dir / "learning_curves.png",
    )
    atomic_write_text(run_dir / "report.json", json.dumps(report, indent=2))
    atomic_write_text(run_dir / "report.md", report_markdown(report, trainer))
    console.print(report_markdown(report, trainer), markup=False, highlight=False)
    return report


def report_markdown(report: dict[str, Any], trainer: Trainer) -> str:
    plan = trainer.plan
    lines = [
        f"# fitdqn run: {trainer.config.market.data}",
        "",
        f"{report['epochs']} epochs, {report['updates']} updates at batch {report['batch_size']} "
        f"({report['batch_source']}) on {report['device']}; planned memory "
        f"{format_bytes(plan.planned_bytes)} of {format_bytes(plan.device.free_bytes or 0)} free.",
        f"{report['env_steps']:,} env steps, {report['samples']:,} samples drawn (train.sample_reuse "
        f"{trainer.config.train.sample_reuse:g}); reward: {report['reward']}.",
        "",
    ]
    keys = ("total_return", "sharpe", "sortino", "max_drawdown", "calmar", "turnover", "trades", "win_rate")
    for split in ("validation", "test"):
        results = report[split]
        lines += [f"## {split} ({results['bars']} bars)", "", "| policy | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
        for name in ("agent", "buy_and_hold", "random"):
            row = results[name]
            cells = [fmt(row.get(k)) for k in keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Plots: equity_test.png, learning_curves.png, vram.png", ""]
    return "\n".join(lines)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def evaluate_run(run_dir: Path, split: str, device_spec: str = "auto", console: Console | None = None
                 ) -> dict[str, Any]:
    """Backtest the checkpoint in ``run_dir`` on ``split``; writes ``evaluate_<split>.json``."""
    from fitdqn.device.probe import resolve_device
    from fitdqn.learn.learner import Learner
    from fitdqn.market.loader import load_market
    from fitdqn.train.checkpoint import load_checkpoint

    console = console or Console()
    config = resume_config(run_dir)
    device = resolve_device(device_spec)
    state = load_checkpoint(run_dir / CHECKPOINT_NAME, map_location=device)
    market = load_market(config.market, window=config.net.window, device=device)
    learner = Learner(config, state_dim_of(market), device)
    try:
        learner.load_state_dict(state["learner"])
    except (KeyError, RuntimeError, ValueError) as error:
        raise UserError(f"checkpoint in '{run_dir}' does not fit its config.toml ({error}); was it edited?") from None
    results, _ = evaluate_split(learner, market, config, split)
    atomic_write_text(run_dir / f"evaluate_{split}.json", json.dumps(results, indent=2))
    keys = ("total_return", "sharpe", "sortino", "max_drawdown", "calmar", "turnover", "trades", "win_rate")
    console.print(f"{split} split of {config.market.data}, {results['bars']} bars, checkpoint epoch {state['epoch']}")
    console.print("| policy | " + " | ".join(keys) + " |", markup=False)
    for name in ("agent", "buy_and_hold", "random"):
        console.print(f"| {name} | " + " | ".join(fmt(results[name].get(k)) for k in keys) + " |", markup=False)
    return results


def state_dim_of(market) -> int:
    from fitdqn.market.env import NUM_AGENT_FIELDS

    return int(market.features.shape[1]) + NUM_AGENT_FIELDS
