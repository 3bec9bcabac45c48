"""PNG plots of a run: equity with drawdown beside the baselines, and learning curves by whole epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fitdqn.evaluate.metrics import drawdown


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_equity(curves: dict[str, np.ndarray], path: str | Path, title: str,
                times: np.ndarray | None = None) -> Path:
    """curves: name -> equity [T + 1] (currency); the first is the agent (drawn thicker, its drawdown filled),
    the others are baselines. Top: equity; bottom: drawdown.

    ``times [T]``: the time of each step's fill bar; the x axis shows dates when given (else bar numbers).
    """
    plt = _pyplot()
    fig, (equity_ax, dd_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(3, 1))
    length = len(next(iter(curves.values())))
    dated = times is not None and len(times) == length - 1 and not np.isnat(np.asarray(times)[0])
    x = np.concatenate([np.asarray(times)[:1], np.asarray(times)]) if dated else np.arange(length)
    first = next(iter(curves))
    for name, equity in curves.items():
        lead = name == first
        line, = equity_ax.plot(x, equity, label=name, linewidth=1.6 if lead else 0.8, alpha=1.0 if lead else 0.8,
                               zorder=3 if lead else 2)
        if lead:
            dd_ax.fill_between(x, -100 * drawdown(equity), alpha=0.35, label=name, color=line.get_color())
        else:
            dd_ax.plot(x, -100 * drawdown(equity), linewidth=0.6, alpha=0.7, color=line.get_color())
    equity_ax.set_ylabel("equity")
    equity_ax.set_title(title)
    equity_ax.legend(fontsize="small", ncol=2)
    equity_ax.grid(alpha=0.3)
    dd_ax.set_ylabel("drawdown %")
    dd_ax.set_xlabel("date" if dated else "bar")
    dd_ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def plot_learning_curves(records: list[dict[str, Any]], path: str | Path,
                         keys: tuple[str, ...] = ("loss", "c51_loss", "iqn_loss", "iql_loss", "q_mean",
                                                  "validation_sharpe"),
                         chosen_epoch: int | None = None) -> Path:
    """One panel per scalar found in the JSONL records, all on one x axis of whole epochs (``record["epoch"]``,
    else ``record["step"]``). ``chosen_epoch``: the reported network's epoch, a dashed line on every panel."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    present = [k for k in keys if any(k in r and r[k] is not None for r in records)]
    fig, axes = plt.subplots(max(len(present), 1), 1, figsize=(9, 2.2 * max(len(present), 1)), squeeze=False,
                             sharex=True)
    for ax, key in zip(axes[:, 0], present, strict=False):
        points = [(int(r.get("epoch", r["step"])), r[key]) for r in records if r.get(key) is not None]
        ax.plot(*zip(*points, strict=True), marker="." if len(points) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if chosen_epoch is not None:
            ax.axvline(chosen_epoch, color="0.4", linestyle="--", linewidth=0.8)
    if chosen_epoch is not None and present:
        axes[0, 0].set_title(f"dashed: epoch {chosen_epoch}, the network reported (best validation Sharpe)",
                             fontsize="small")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("epoch")
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
