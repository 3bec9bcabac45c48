"""A run directory's trained policy: its config, its contract, and the learner restored from its checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fitdqn.config import Config, load_run_config
from fitdqn.errors import UserError
from fitdqn.files import NETWORKS
from fitdqn.learn.learner import Learner
from fitdqn.market.contract import ContractSpec
from fitdqn.market.env import STATE_DIM, market_goal_unit
from fitdqn.market.loader import load_market, market_contract
from fitdqn.train.checkpoint import restore_network


@dataclass
class RunPolicy:
    """What acting needs from a run: the config it trained with, the contract it traded, the learner."""

    run_dir: Path
    config: Config
    contract: ContractSpec
    learner: Learner
    epoch: int

    @property
    def device(self) -> torch.device:
        return self.learner.device

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
    the run's report is about (``best.pt``, chosen on validation), ``'last'`` the latest checkpoint's."""
    run_dir = Path(run_dir)
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
