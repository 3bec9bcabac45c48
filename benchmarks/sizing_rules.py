"""The rule baselines under each position sizing (``market.position_sizing``): Sharpe on the validation and test
splits of the default splits, through the same env, costs and episodes as the agent. Nothing is trained or chosen:
it is what volatility sizing does to a fixed rule.

    PYTHONPATH=src python benchmarks/sizing_rules.py --data synthetic,sp500,nasdaq --out sizing_rules.json
"""

from __future__ import annotations

import argparse

import torch
from _common import write_json

from fitdqn.config import Config, with_overrides
from fitdqn.evaluate.backtest import SplitSizes, evaluate_rules
from fitdqn.evaluate.baselines import account_size, rule_policies
from fitdqn.evaluate.metrics import trading_metrics
from fitdqn.market.loader import load_market
from fitdqn.provenance import code_commit
from fitdqn.resolve import resolve_for_market

SIZINGS = ("contracts", "volatility")
SPLITS = ("validation", "test")


def rule_sharpes(data: str, sizing: str) -> tuple[dict[str, dict[str, float]], float]:
    """rule -> split -> Sharpe, and the sizing's target volatility (0 for contracts)."""
    config = with_overrides(Config(), {"market.data": data, "market.position_sizing": sizing})
    market = load_market(config.market, window=config.net.window)
    config, _ = resolve_for_market(config, market)
    rules = rule_policies(market, config, market.bars_per_year)
    sizes = SplitSizes.of_config(config, market)
    out: dict[str, dict[str, float]] = {name: {} for name in rules}
    for split in SPLITS:
        capital = account_size(market, config, split)
        for name, backtest in zip(rules, evaluate_rules(list(rules.values()), market, split, sizes), strict=True):
            out[name][split] = trading_metrics(backtest.pnl, backtest.position, capital, market.bars_per_year).sharpe
    return out, config.market.target_volatility


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="synthetic,sp500,nasdaq", help="comma-separated data sets")
    parser.add_argument("--out", help="JSON results file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    print("| data | rule | " + " | ".join(f"{split}, {sizing}" for split in SPLITS for sizing in SIZINGS) + " |")
    print("|---|---|" + "---:|" * (len(SPLITS) * len(SIZINGS)))
    for data in args.data.split(","):
        by_sizing = {}
        for sizing in SIZINGS:
            sharpes, target = rule_sharpes(data, sizing)
            by_sizing[sizing] = {"target_volatility": target, "rules": sharpes}
        results[data] = by_sizing
        for rule in by_sizing["contracts"]["rules"]:
            cells = [by_sizing[sizing]["rules"][rule][split] for split in SPLITS for sizing in SIZINGS]
            print(f"| {data} | {rule} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    if args.out:
        write_json(args.out, {"commit": code_commit(), "results": results})


if __name__ == "__main__":
    main()
