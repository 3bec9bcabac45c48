"""How a plan is shown: a rich table for people, JSON for programs, a chart of where the VRAM goes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from fitdqn.device.sizes import format_bytes
from fitdqn.files import atomic_savefig
from fitdqn.plan.planner import Plan

if TYPE_CHECKING:  # the run's budget and reward scale are printed beside the plan, not planned
    from fitdqn.learn.schedule import Schedule
    from fitdqn.market.env import RewardScale


def device_table(plan: Plan) -> Table:
    device = plan.device
    table = Table(title="device", show_header=False, title_justify="left")
    unknown = "unknown"
    cc = ".".join(map(str, device.compute_capability)) if device.compute_capability else "-"
    rows = [
        ("name", device.name + ("  (what-if)" if device.what_if else "")),
        ("total memory", format_bytes(device.total_bytes) if device.total_bytes is not None else unknown),
        ("free memory", format_bytes(device.free_bytes) if device.free_bytes is not None else unknown),
        ("compute capability", cc),
        ("bf16", "yes" if device.bf16 else "no"),
        ("profile", f"{plan.profile.name}  ({plan.profile.source.get('description', '')})"),
        ("batch size", f"{plan.batch_size}  (from {plan.batch_source})"),
    ]
    if plan.max_fitting_batch is not None:
        rows.append(("largest batch that fits", str(plan.max_fitting_batch)))
    if plan.replay_capacity is not None:
        rows.append(("replay capacity", f"{plan.replay_capacity:,} transitions"))
    for key, value in rows:
        table.add_row(key, value)
    return table


def component_table(plan: Plan) -> Table:
    total = plan.device.total_bytes
    table = Table(title=f"where the memory goes at batch {plan.batch_size} (allocation order)", title_justify="left")
    for column in ("component", "fixed", "per sample", f"at batch {plan.batch_size}", "share of card"):
        table.add_column(column, justify="left" if column == "component" else "right")
    share = lambda n: f"{100 * n / total:.1f} %" if total else "-"
    for c in plan.components:
        at_batch = c.bytes_at(plan.batch_size)
        table.add_row(
            c.name, format_bytes(c.fixed_bytes), format_bytes(c.per_sample_bytes), format_bytes(at_batch),
            share(at_batch),
        )
    table.add_row("headroom", format_bytes(plan.headroom_bytes), "", format_bytes(plan.headroom_bytes),
                  share(plan.headroom_bytes), style="dim")
    table.add_row("total", format_bytes(plan.fixed_bytes), format_bytes(plan.per_sample_bytes),
                  format_bytes(plan.planned_bytes + plan.headroom_bytes),
                  share(plan.planned_bytes + plan.headroom_bytes), style="bold")
    return table


def schedule_table(schedule: Schedule, reward: RewardScale | None = None) -> Table:
    """What the run will do at the plan's batch: env steps, updates, samples and the derived rates."""
    table = Table(title="the run's budget (train.sample_reuse: the same samples at any batch)", show_header=False,
                  title_justify="left")
    for key, value in schedule.rows():
        table.add_row(key, value)
    if reward is not None:
        table.add_row("reward", reward.describe())
    return table


def print_plan(plan: Plan, console: Console | None = None, schedule: Schedule | None = None,
               reward: RewardScale | None = None) -> None:
    """The device, where the memory goes and why; with ``schedule`` the run's budget (and a warning when it makes
    fewer updates than ``train.min_updates``), with ``reward`` the reward scale."""
    console = console or Console()
    console.print(device_table(plan))
    if schedule is not None:
        console.print(schedule_table(schedule, reward))
        if schedule.warning():
            console.print(f"warning: {schedule.warning()}", style="bold yellow", highlight=False)
    if plan.components:
        console.print(component_table(plan))
        console.print("derived from:", style="bold")
        for c in plan.components:
            console.print(f"  {c.name}: {c.derived_from}", highlight=False, markup=False)
        console.print("  headroom: budget.headroom_fraction x free memory", highlight=False, markup=False)
    for note in plan.notes:
        console.print(f"note: {note}", style="yellow")


def plot_plan(plan: Plan, path: str | Path) -> Path:
    """A horizontal stacked bar of the card: each consumer at the chosen batch, headroom, what is left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    parts = [(c.name, c.bytes_at(plan.batch_size)) for c in plan.components]
    parts.append(("headroom", plan.headroom_bytes))
    if plan.device.free_bytes is not None:
        parts.append(("unplanned free", max(plan.device.free_bytes - plan.planned_bytes - plan.headroom_bytes, 0)))
    if plan.device.total_bytes is not None and plan.device.free_bytes is not None:
        parts.insert(0, ("in use before", plan.device.total_bytes - plan.device.free_bytes))
    gib = 2**30
    fig, bar_ax = plt.subplots(figsize=(11, 3.6))
    left = 0.0
    colors = plt.get_cmap("tab20").colors
    for i, (name, size) in enumerate(parts):
        bar_ax.barh(0, size / gib, left=left, color=colors[i % len(colors)], label=f"{name}: {format_bytes(size)}")
        left += size / gib
    bar_ax.set_yticks([])
    bar_ax.set_xlabel("GiB")
    bar_ax.set_title(f"{plan.device.name}: batch {plan.batch_size} ({plan.batch_source})")
    bar_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return path
