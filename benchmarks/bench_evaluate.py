"""Backtest speed on long files: one greedy backtest of the default network (untrained) over --bars bars of
synthetic one-minute data, in --segments parallel segments (1 = one env, one forward per bar).

Reports wall time of the backtest alone and the process's peak RSS before and after it (``ru_maxrss``: the
market's features are built first, so the first figure is the loading peak). Run each segment count in its own
process so the peaks do not mix:

    python benchmarks/bench_evaluate.py --bars 300000 --segments 1024 --out bench_evaluate_1024.json
    python benchmarks/bench_evaluate.py --bars 300000 --segments 1 --out bench_evaluate_1.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

import torch
from _common import write_json

from fitdqn.config import Config, with_overrides
from fitdqn.evaluate.backtest import evaluate_config
from fitdqn.evaluate.baselines import greedy_policy
from fitdqn.learn.learner import Learner
from fitdqn.market.layout import STATE_DIM
from fitdqn.market.loader import load_market


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bars", type=int, default=300_000, help="bars in the backtested split (default 300000)")
    parser.add_argument("--segments", type=int, default=1024, help="evaluate.segments (default 1024)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    total = round(args.bars / 0.9)  # validation: 90 % of the file = --bars bars
    config = with_overrides(Config(), {"market.data": "synthetic", "market.synthetic_bars": total,
                                       "market.train_fraction": 0.05, "market.validation_fraction": 0.9,
                                       "evaluate.segments": args.segments, "train.device": args.device})
    start = time.perf_counter()
    market = load_market(config.market, window=config.net.window, device=args.device)
    load_seconds = time.perf_counter() - start
    learner = Learner(config, STATE_DIM, args.device)
    rss_loaded = peak_rss_mib()
    start = time.perf_counter()
    with torch.no_grad():
        backtest = evaluate_config(greedy_policy(learner), config, "validation", market=market)
    seconds = time.perf_counter() - start
    result = {
        "bars": len(backtest), "segments": backtest.segments, "backtest_seconds": seconds,
        "bars_per_second": len(backtest) / seconds, "load_seconds": load_seconds,
        "peak_rss_mib_after_load": rss_loaded, "peak_rss_mib_after_backtest": peak_rss_mib(),
        "device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "processor": platform.processor(), "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
