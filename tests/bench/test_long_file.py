"""benchmarks/long_file.py: the generated minute file is seeded, passes fitdqn's own bar checks with prices far
inside its bounds, and the phases are cut at the lines `fitdqn train` prints."""

from __future__ import annotations

import numpy as np
import pandas as pd
from support.benchmarks import load_benchmark

from fitdqn.market.data import read_bars_file


def load_bench():
    return load_benchmark("long_file")


def test_generated_file_is_seeded_and_valid(tmp_path):
    bench = load_bench()
    first = bench.generate(tmp_path / "a.csv", 20_000, seed=3)
    again = bench.generate(tmp_path / "b.csv", 20_000, seed=3)
    other = bench.generate(tmp_path / "c.parquet", 20_000, seed=4)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    assert first == {**again, "bytes": first["bytes"]}
    assert other["close_max"] != first["close_max"]
    bars = read_bars_file(tmp_path / "a.csv", date_format="auto")  # fitdqn's own reader and checks
    assert len(bars) == 20_000
    stamps = pd.DatetimeIndex(bars["timestamp"])
    assert (stamps.day_of_week < 5).all()  # 24 x 5: no weekend bars
    assert (np.diff(stamps.asi8)[:1000] == 60 * 10**9).all()  # one-minute bars from Monday 00:00
    returns = np.diff(np.log(bars["close"].to_numpy()))
    assert 1e-4 < returns.std() < 1e-3  # minute-scale volatility, not the daily market's ~1 %
    assert (bars[["open", "high", "low", "close"]].to_numpy() > 100).all()
    assert len(read_bars_file(tmp_path / "c.parquet", date_format="auto")) == 20_000


def test_phases_are_cut_at_the_run_lines():
    bench = load_bench()
    lines = [(1.0, "run directory: runs/x"), (5.0, "plan table"), (6.0, "memory check: ..."),
             (9.0, "epoch 1/2  env 1/s"), (12.0, "epoch 2/2  env 1/s"), (13.0, "checkpoint.pt: 1 MiB"),
             (20.0, "Run directory: runs/x")]
    assert bench.phases(lines, 0.0, 21.0) == {
        "start-up": (0.0, 1.0), "setup": (1.0, 6.0), "epochs": (6.0, 12.0), "checkpoint": (12.0, 13.0),
        "final report": (13.0, 21.0)}
    # a run that stopped during the epochs: what it reached, and the rest as "after the epochs"
    assert bench.phases(lines[:4], 0.0, 10.0) == {
        "start-up": (0.0, 1.0), "setup": (1.0, 6.0), "epochs": (6.0, 9.0), "after the epochs": (9.0, 10.0)}
    assert bench.phases([], 0.0, 3.0) == {"start-up": (0.0, 3.0)}
