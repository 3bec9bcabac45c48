"""How much the synthetic market's planted edge gives to simple rules: last-bar momentum with a threshold and sizing.

The planted edge (``fitdqn.market.data.synthetic_bars``) makes a bar's expected return proportional to the last
bar's return in units of its volatility (``z``, the ``ret_1`` feature). The last-bar momentum baseline holds the
full position in the direction of ``z`` whatever its size; these rules hold the full position only where
``|z| > c``, and (``half``) one contract where ``c / 2 < |z| <= c``, flat below. Each is backtested like every
baseline (the same env, costs and episodes) on the validation and test splits. Nothing here is chosen: it is the
scale of what sizing by the edge's strength can add over the sign alone.

    PYTHONPATH=src python benchmarks/edge_ceiling.py --out benchmarks/results/synthetic_edge_ceiling.json
    PYTHONPATH=src python benchmarks/edge_ceiling.py --position-sizing contracts   # the rules in whole contracts
"""

from __future__ import annotations

import argparse

import torch
from _common import write_json

from fitdqn.config import SYNTHETIC_DATA, Config, MarketConfig, knob_choices, with_overrides
from fitdqn.evaluate.backtest import BarRule, SplitSizes, evaluate_rules
from fitdqn.evaluate.baselines import account_size
from fitdqn.evaluate.metrics import trading_metrics
from fitdqn.market.layout import FEATURE_NAMES, NUM_BRANCHES
from fitdqn.market.loader import load_market
from fitdqn.provenance import code_commit
from fitdqn.resolve import resolve_for_market

THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 1.0)


def sized_momentum(z: torch.Tensor, threshold: float, half: bool, max_contracts: int) -> BarRule:
    """``z [T]`` -> the rule's action table (branch 0: position index, centre = flat; no stop, no take-profit)."""
    strong = z.abs() > threshold
    contracts = torch.where(strong, max_contracts * torch.sign(z), torch.zeros_like(z))
    if half:
        contracts = torch.where(~strong & (z.abs() > threshold / 2), torch.sign(z), contracts)
    actions = torch.zeros((z.shape[0], NUM_BRANCHES), dtype=torch.int64)
    actions[:, 0] = (max_contracts + contracts).long()  # levels -max .. +max in steps of one contract
    return BarRule(f"abs(z) > {threshold:g}{', 1 contract above half' if half else ''}", actions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON results file")
    parser.add_argument("--position-sizing", choices=knob_choices(MarketConfig, "position_sizing"),
                        default=Config().market.position_sizing, help="market.position_sizing of the rules' env")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = with_overrides(Config(), {"market.data": SYNTHETIC_DATA, "market.position_sizing": args.position_sizing})
    if config.net.branches[0] != 2 * config.market.max_contracts + 1:
        raise SystemExit("this script assumes one position level per contract (net.branches[0] = 2 x max + 1)")
    market = load_market(config.market, window=config.net.window)
    config, _ = resolve_for_market(config, market)  # the sizing's target, derived as a run derives it
    z = market.features[:, FEATURE_NAMES.index("ret_1")].double()  # [T]
    rules = [sized_momentum(z, c, half, config.market.max_contracts) for c in THRESHOLDS for half in (False, True)]
    sizes = SplitSizes.of_config(config, market)
    rows = {rule.name: {} for rule in rules}
    for split in ("validation", "test"):
        capital = account_size(market, config, split)
        for rule, backtest in zip(rules, evaluate_rules(rules, market, split, sizes), strict=True):
            metrics = trading_metrics(backtest.pnl, backtest.position, capital, market.bars_per_year)
            rows[rule.name][split] = metrics.sharpe
    print("| rule | validation Sharpe | test Sharpe |\n|---|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['validation']:.2f} | {row['test']:.2f} |")
    if args.out:
        write_json(args.out, {"commit": code_commit(), "position_sizing": args.position_sizing, "rules": rows})


if __name__ == "__main__":
    main()
