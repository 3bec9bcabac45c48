"""A run directory's trained policy: its config, its contract, and the learner restored from its checkpoint; or a
study directory's: the ensemble of its latest fold's members (:mod:`fitdqn.evaluate.ensemble`), the policy a trader
acts with after the walk-forward (the members trained on the most recent bars)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fitdqn.config import Config, load_run_config
from fitdqn.errors import UserError
from fitdqn.evaluate.backtest import Policy
from fitdqn.evaluate.baselines import greedy_policy
from fitdqn.evaluate.ensemble import EnsemblePolicy, ensemble_levels
from fitdqn.files import NETWORKS, STUDY_NAME
from fitdqn.learn.learner import Learner
from fitdqn.market.contract import ContractSpec
from fitdqn.market.env import market_goal_unit, position_levels
from fitdqn.market.layout import STATE_DIM
from fitdqn.market.loader import load_market, market_contract
from fitdqn.train.checkpoint import restore_network


@dataclass
class RunPolicy:
    """What acting needs from a run: the config it trained with, the contract it traded, the learner; for a study,
    its ensemble's ``members`` too (``learner`` is the first of them, ``member_dirs`` their run directories)."""

    run_dir: Path
    config: Config
    contract: ContractSpec
    learner: Learner
    epoch: int
    members: tuple[Learner, ...] = ()
    member_dirs: tuple[Path, ...] = ()

    @property
    def device(self) -> torch.device:
        return self.learner.device

    def member_levels(self) -> list[float]:
        """Branch 0's contracts of one member (the config's levels)."""
        return position_levels(self.config.net.branches[0], self.config.market.max_contracts)

    def levels(self) -> list[float] | None:
        """Branch 0's contracts of the policy's actions where they are not the config's: an ensemble's means."""
        return ensemble_levels(self.member_levels(), len(self.members)) if self.members else None

    def acting(self) -> Policy:
        """``obs -> actions``, greedy: the run's evaluated network, or the study's ensemble."""
        return EnsemblePolicy(self.members, self.member_levels()) if self.members else greedy_policy(self.learner)

    def goal_unit(self) -> float:
        """The goal scale the backtests show the agent: the training split's median ATR for one contract in
        reward units (:func:`fitdqn.market.env.market_goal_unit`), from the run's own training bars."""
        try:
            market = load_market(self.config.market, window=self.config.net.window, device=self.device)
        except UserError as error:
            raise UserError(
                f"the run's training bars (market.data = '{self.config.market.data}') are needed for the goal "
                f"scale the policy was evaluated with, and cannot be loaded ({error}); put the file back where "
                "the run's config.toml says, or give --goal-unit (`fitdqn act` prints it where the bars are)"
            ) from None
        return market_goal_unit(market, self.config.net.window, self.config.market.reward_scale,
                                self.config.market.reward)


def load_run_policy(run_dir: str | Path, device: torch.device | str, network: str = "best") -> RunPolicy:
    """The trained learner of ``run_dir`` (its ``config.toml``) on ``device``: ``network = 'best'`` the network
    the run's report is about (``best.pt``, chosen on validation), ``'last'`` the latest checkpoint's. A study
    directory (its ``study.json``) gives its latest fold's ensemble (:func:`load_study_policy`)."""
    run_dir = Path(run_dir)
    if (run_dir / STUDY_NAME).is_file():
        return load_study_policy(run_dir, device, network)
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise UserError(f"'{run_dir}' has no config.toml: not a fitdqn run directory (fitdqn train --out writes one)")
    if network not in NETWORKS:
        raise UserError(f"network '{network}': give one of {', '.join(NETWORKS)}")
    config = load_run_config(config_path)
    device = torch.device(device)
    learner = Learner(config, STATE_DIM, device)
    state = restore_network(learner, run_dir, network, device)
    try:
        contract = market_contract(config.market)  # 'auto' on a file: derived from the run's training bars
    except UserError as error:
        raise UserError(
            f"the run's contract comes from its training bars (market.data = '{config.market.data}', market.contract "
            f"= auto), which cannot be loaded ({error}); put the file back where the run's config.toml says, or set "
            "market.contract in it to the spec the run traded (a name or a TOML path)"
        ) from None
    return RunPolicy(run_dir, config, contract, learner, int(state.get("epoch", 0)))


def load_study_policy(study_dir: Path, device: torch.device | str, network: str = "best") -> RunPolicy:
    """The ensemble of a study's latest fold: its members (every seed trained on the most recent bars), each with
    its ``network``, as one :class:`RunPolicy` (the first member's config and contract)."""
    try:
        listed = json.loads((study_dir / STUDY_NAME).read_text())
        latest = max(int(m["fold"]) for m in listed)
        dirs = [study_dir / m["dir"] for m in listed if int(m["fold"]) == latest]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"'{study_dir / STUDY_NAME}' does not list the study's members ({error}); run the study's "
                        "`fitdqn train` command again to write it") from None
    policies = [load_run_policy(sub, device, network) for sub in dirs]
    first = policies[0]
    return RunPolicy(study_dir, first.config, first.contract, first.learner, first.epoch,
                     members=tuple(p.learner for p in policies), member_dirs=tuple(dirs))
