"""Several runs reported as one: ``evaluate.seeds`` training seeds x ``evaluate.folds`` walk-forward folds.

Each (seed, fold) run is an ordinary run directory under the study's (``seed_S/fold_K``, or ``seed_S`` without
folds) trained by :func:`fitdqn.train.run.train`; the study directory holds ``config.toml``, ``study.json``
(its members), ``report.json`` and ``report.md`` (:mod:`fitdqn.evaluate.report`). Running the same command
again continues a study: finished members (with a report.json) are read back, a member with a checkpoint is
resumed. The report's headline is the study's ensemble (:mod:`fitdqn.evaluate.ensemble`): each fold's members
acting as one policy on that fold's test bars, the folds joined in time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console

from fitdqn.config import Config
from fitdqn.evaluate.backtest import SplitSizes
from fitdqn.evaluate.ensemble import EnsemblePolicy, evaluate_ensemble
from fitdqn.evaluate.report import study_markdown, study_summary, study_verdict
from fitdqn.evaluate.walk_forward import FOLD_NAME, Fold, fold_market, folds_for, run_fold
from fitdqn.files import CHECKPOINT_NAME, STUDY_NAME, read_run_json
from fitdqn.learn.learner import Learner
from fitdqn.market.data import bars_per_year
from fitdqn.market.env import STATE_DIM, position_levels
from fitdqn.market.loader import Market, load_market, market_contract
from fitdqn.train.checkpoint import atomic_write_text, restore_network
from fitdqn.train.run import evaluate_run, print_report, resume_config, train
from fitdqn.train.trainer import write_run_config

# what the study lists of each member: where it is, the epoch chosen on validation, that network's validation
# Sharpe (what chose it) and test Sharpe (two studies of the same seeds and folds compare member by member)
MEMBER_KEYS = ("seed", "fold", "dir", "selected_epoch", "validation_sharpe", "test_sharpe")
ENSEMBLE_PNL = "ensemble_test_pnl.csv"  # the ensemble's test P&L, fold by fold (the report's headline book)


def is_study(config: Config) -> bool:
    return config.evaluate.seeds > 1 or config.evaluate.folds > 1


def member_dir(run_dir: Path, seed_index: int, fold: Fold | None) -> Path:
    seed = run_dir / f"seed_{seed_index}"
    return seed if fold is None else seed / f"fold_{fold.index}"


def member_of(config: Config, run_dir: Path) -> Config:
    """A member's own config: one run (seeds 1, folds 1; its fold's ranges are in its fold.json) in run_dir."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, out=str(run_dir)),
                               evaluate=dataclasses.replace(config.evaluate, seeds=1, folds=1))


def member_market(config: Config, run_dir: Path) -> Market | None:
    """The bars of a walk-forward member (``fitdqn train --resume MEMBER_DIR``): its fold's ranges; None for a
    run that is not a fold."""
    fold = run_fold(run_dir)
    if fold is None:
        return None
    return fold_market(load_market(config.market, window=config.net.window, device="cpu"), fold, config)


@dataclass(frozen=True)
class StudyMember:
    """A member still to train: its name in the study (``seed_S/fold_K``), its run directory (with its fold.json),
    its own config, and its fold's bars (None for a run that is not a fold, or to be read from fold.json)."""

    key: str
    run_dir: Path
    config: Config
    market: Market | None = None


RunMembers = Callable[[list[StudyMember], Console], None]


def member_key(seed_index: int, fold: Fold | None) -> str:
    return f"seed_{seed_index}" if fold is None else f"seed_{seed_index}/fold_{fold.index}"


def train_one_after_another(todo: list[StudyMember], console: Console) -> None:
    """Train the members in this process, one after another (a member with a checkpoint is resumed)."""
    for member in todo:
        train(member.config, member.run_dir, resume=(member.run_dir / CHECKPOINT_NAME).is_file(), console=console,
              market=member.market)


def read_member(run_dir: Path, seed_index: int, fold: Fold | None, sub: Path) -> dict[str, Any]:
    """What the study report takes from a finished member (its report.json and test_pnl.csv)."""
    report = json.loads((sub / "report.json").read_text())
    return {"seed": seed_index, "fold": fold.index if fold is not None else 0, "dir": str(sub.relative_to(run_dir)),
            "capital": report["test"]["capital"], "test": report["test"],
            "selected_epoch": report["selection"]["epoch"], "code": report.get("code"),
            "validation_sharpe": report["selection"]["validation_sharpe"],
            "test_sharpe": report["test"]["agent"]["sharpe"],
            "pnl": pd.read_csv(sub / "test_pnl.csv")}


def run_study(config: Config, run_dir: Path, console: Console | None = None,
              seed_indices: list[int] | None = None, run_members: RunMembers | None = None) -> dict[str, Any] | None:
    """Train every member of the study (or read back the finished ones) and write the joint report.

    ``seed_indices`` trains only those seeds' members and writes no report (several processes can fill one
    study side by side; a last call with every seed reads them back and reports). ``run_members`` trains the
    members still to train (default: one after another in this process; ``fitdqn.schedule.study``: packed
    processes from a queue); each must leave its report.json, or raise."""
    console = console or Console()
    e = config.evaluate
    console.print(f"run directory: {run_dir}", highlight=False, markup=False, soft_wrap=True)
    market = load_market(config.market, window=config.net.window, device="cpu")
    folds: list[Fold | None] = folds_for(config, market.num_bars) if e.folds > 1 else [None]
    views = {f.index: fold_market(market, f, config) for f in folds if f is not None}  # every fold checked first
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(run_dir, config)
    members, todo = [], []
    for s in range(e.seeds) if seed_indices is None else seed_indices:
        seed_config = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=config.train.seed + s))
        for fold in folds:
            sub = member_dir(run_dir, s, fold)
            members.append((s, fold, sub))
            if (sub / "report.json").is_file():
                console.print(f"{sub}: finished, read back", highlight=False, markup=False, soft_wrap=True)
                continue
            if fold is not None:
                sub.mkdir(parents=True, exist_ok=True)
                atomic_write_text(sub / FOLD_NAME, json.dumps(fold.to_json()))
            todo.append(StudyMember(member_key(s, fold), sub, member_of(seed_config, sub),
                                    views[fold.index] if fold is not None else None))
    (run_members or train_one_after_another)(todo, console)
    members = [read_member(run_dir, s, fold, sub) for s, fold, sub in members]
    if seed_indices is not None:
        return None
    ensemble = ensemble_pnl(run_dir, members, market, "test")
    summary = study_summary(members, config, bars_per_year(market.bars["timestamp"]), ensemble)
    summary["verdict"] = study_verdict(summary, config)
    summary["members"] = [{k: m[k] for k in MEMBER_KEYS} for m in members]
    summary["member_code"] = distinct_code(members)
    summary["folds_layout"] = [f.to_json() for f in folds if f is not None]
    atomic_write_text(run_dir / STUDY_NAME, json.dumps(summary["members"], indent=2))
    atomic_write_text(run_dir / ENSEMBLE_PNL, ensemble_frame(members, ensemble).to_csv(index=False))
    atomic_write_text(run_dir / "report.json", json.dumps(summary, indent=2))
    markdown = study_markdown(summary, config, str(run_dir), market.contract)
    atomic_write_text(run_dir / "report.md", markdown)
    print_report(console, markdown)
    return summary


def ensemble_pnl(run_dir: Path, members: list[dict[str, Any]], market: Market, split: str, network: str = "best"
                 ) -> dict[int, np.ndarray]:
    """fold -> the net P&L per bar of the fold's ensemble (:class:`fitdqn.evaluate.ensemble.EnsemblePolicy` of the
    members trained on it, their ``network``) over the fold's ``split``, on the CPU; the members as listed in
    ``members`` (``fold``, ``dir`` relative to ``run_dir``)."""
    out = {}
    for index in sorted({m["fold"] for m in members}):
        dirs = [run_dir / m["dir"] for m in members if m["fold"] == index]
        config = resume_config(dirs[0])  # the members of a fold differ by their seed only
        learners = []
        for sub in dirs:
            learner = Learner(config, STATE_DIM, "cpu")
            restore_network(learner, sub, network, "cpu")
            learners.append(learner)
        fold = run_fold(dirs[0])
        view = fold_market(market, fold, config) if fold is not None else market
        policy = EnsemblePolicy(learners, position_levels(config.net.branches[0], config.market.max_contracts))
        out[index] = evaluate_ensemble(policy, view, split, SplitSizes.of_config(config, view)).pnl
    return out


def ensemble_frame(members: list[dict[str, Any]], ensemble: dict[int, np.ndarray]) -> pd.DataFrame:
    """The ensemble's P&L per bar, the folds in order: ``fold``, ``timestamp`` (the fill bar's), ``pnl``."""
    parts = []
    for fold, pnl in sorted(ensemble.items()):
        stamps = next(m["pnl"]["timestamp"] for m in members if m["fold"] == fold)
        parts.append(pd.DataFrame({"fold": fold, "timestamp": stamps.to_numpy(), "pnl": pnl}))
    return pd.concat(parts, ignore_index=True)


def distinct_code(members: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The code the members were trained with (``report.json``'s ``code``), each version once: one entry unless a
    study was continued after a change (members from before reports recorded it are left out)."""
    seen = {json.dumps(m["code"], sort_keys=True) for m in members if m.get("code")}
    return [json.loads(code) for code in sorted(seen)]


def check_study_members(members: Any) -> list[dict[str, Any]]:
    """study.json: the list of members, each with its folder (KeyError/TypeError when a part is missing)."""
    if not isinstance(members, list) or not members:
        raise ValueError("no list of members")
    if not all(isinstance(member, dict) and isinstance(member.get("dir"), str) for member in members):
        raise KeyError("dir")
    return members


def evaluate_study(run_dir: Path, split: str, device_spec: str, console: Console | None = None,
                   network: str = "best") -> dict[str, Any]:
    """``fitdqn evaluate`` on a study: every member's network on its own ``split`` (its fold's ranges), then
    the joint report (``evaluate_<split>.json`` and the printed verdict)."""
    console = console or Console()
    config = resume_config(run_dir)
    listed = read_run_json(run_dir / STUDY_NAME, f"run the study's command again (fitdqn train --config "
                           f"{run_dir / 'config.toml'} --out {run_dir}): its finished members are read back and "
                           f"{STUDY_NAME} is written anew", check_study_members)
    members = []
    for m in listed:
        sub = run_dir / m["dir"]  # relative to the study directory
        results = evaluate_run(sub, split, device_spec, console, network)
        members.append({**m, "capital": results["capital"], "test": results, "selected_epoch": results["epoch"],
                        "pnl": pd.read_csv(sub / f"evaluate_{split}_pnl.csv")})
    market = load_market(config.market, window=config.net.window, device="cpu")
    ensemble = ensemble_pnl(run_dir, members, market, split, network)
    summary = study_summary(members, config, members[0]["test"]["periods_per_year"], ensemble)
    summary["verdict"] = study_verdict(summary, config)
    print_report(console, study_markdown(summary, config, str(run_dir), _contract(config)))  # before the file
    atomic_write_text(run_dir / f"evaluate_{split}.json", json.dumps(summary, indent=2))
    return summary


def _contract(config: Config):
    return market_contract(config.market)  # 'auto' on a file: derived from its training bars
