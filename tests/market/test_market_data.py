"""Bars: built-ins, files (CSV and Parquet, aliases), every bad-file error, splits, synthetic, contracts."""

from __future__ import annotations

import functools
import hashlib
import sys
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fitdqn.config import Config, with_overrides
from fitdqn.errors import UserError
from fitdqn.market.contract import available_contracts, contract_for, load_contract
from fitdqn.market.data import builtin_bars, load_bars, synthetic_bars
from fitdqn.market.data import read_bars_file as _read_bars_file
from fitdqn.market.loader import load_market
from fitdqn.market.splits import split_bars

read_bars_file = functools.partial(_read_bars_file, date_format="auto")  # market.date_format's default


def good_frame(n: int = 400, seed: int = 0) -> pd.DataFrame:
    """A valid frame in a user's spelling: Date, Open, High, Low, Close, Vol plus an ignored extra column."""
    rng = np.random.default_rng(seed)
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, n)))
    open_ = close * np.exp(rng.normal(0, 0.002, n))
    high = np.maximum(open_, close) * 1.003
    low = np.minimum(open_, close) * 0.997
    return pd.DataFrame(
        {
            "Date": pd.bdate_range("2010-01-04", periods=n).strftime("%Y-%m-%d"),
            "Open": open_.round(4),
            "High": high.round(4) + 0.001,
            "Low": low.round(4) - 0.001,
            "Close": close.round(4),
            "Vol": rng.integers(1000, 5000, n),
            "Adj Close": close,
        }
    )


def write_csv(tmp_path, frame: pd.DataFrame, name: str = "bars.csv"):
    path = tmp_path / name
    frame.to_csv(path, index=False)
    return path


# ---------------------------------------------------------------------------------------------- sources
# What `arch` 8.0.0 (arch.data.<name>.load(), through fitdqn's normalise_bars) gave, pinned when the bars
# became fitdqn's own package data: the shipped file's sha256, and the sha256 of the canonical frame's bytes
# (int64 ns timestamps, then the float64 open/high/low/close/volume matrix), with a few values.
ARCH_BARS = {
    "sp500": {
        "file_sha256": "1e028cbb9c400cc018c816ccc439b33c919387e726c3ed5ca2c05c82746059de",
        "frame_sha256": "012a90a61b53c23903e39541c2e8fc2d6d33da51335cca4496a6e86be780e9a1",
        "close_0": 1228.099976,
        "close_1000": 889.659973,
        "volume_last": 3442870000.0,
    },
    "nasdaq": {
        "file_sha256": "b2009535343ebb14e0aa11ed086788d2997a416ffe4f9450eed9a561ae30ac59",
        "frame_sha256": "47bc2848d34a3283f02c8c98adc199d7e595aa5c3c9ca2723cd87dd54dbb78c6",
        "close_0": 2208.050049,
        "close_1000": 1367.890015,
        "volume_last": 2098560000.0,
    },
}


@pytest.mark.parametrize("name", ["sp500", "nasdaq"])
def test_builtin_real_bars_equal_what_arch_gave(name):
    bars = builtin_bars(name)
    pinned = ARCH_BARS[name]
    assert len(bars) == 5031
    assert list(bars.columns) == ["timestamp", "open", "high", "low", "close", "volume"]
    assert bars["timestamp"].iloc[0] == pd.Timestamp("1999-01-04")
    assert bars["timestamp"].iloc[-1] == pd.Timestamp("2018-12-31")
    assert bars["close"].iloc[0] == pinned["close_0"] and bars["close"].iloc[1000] == pinned["close_1000"]
    assert bars["volume"].iloc[-1] == pinned["volume_last"]
    frame_bytes = bars["timestamp"].to_numpy().astype("int64").tobytes() + bars[
        ["open", "high", "low", "close", "volume"]
    ].to_numpy().tobytes()
    assert hashlib.sha256(frame_bytes).hexdigest() == pinned["frame_sha256"]
    shipped = resources.files("fitdqn.market").joinpath("datasets", f"{name}.csv.gz").read_bytes()
    assert hashlib.sha256(shipped).hexdigest() == pinned["file_sha256"]


def test_builtin_bars_need_no_arch_and_keep_the_licence(monkeypatch):
    for module in ("arch", "scipy", "statsmodels"):
        monkeypatch.setitem(sys.modules, module, None)  # importing them now fails
    assert len(builtin_bars("sp500")) == 5031
    datasets = resources.files("fitdqn.market").joinpath("datasets")
    licence = datasets.joinpath("LICENSE-arch.md").read_text()
    assert "Copyright (c) 2017 Kevin Sheppard" in licence and "Redistributions" in licence
    assert "arch" in datasets.joinpath("README.md").read_text()
    dependencies = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith(("arch", "scipy", "statsmodels")) for d in dependencies["dependencies"])
    assert "pyarrow>=14.0.1" in dependencies["dependencies"]  # 14.0.0 has CVE-2023-47248


def test_csv_and_parquet_load_the_same_bars(tmp_path):
    frame = good_frame()
    from_csv = read_bars_file(write_csv(tmp_path, frame))
    parquet = tmp_path / "bars.parquet"
    frame.assign(Date=pd.to_datetime(frame["Date"])).to_parquet(parquet)
    from_parquet = read_bars_file(parquet)
    assert list(from_csv.columns) == ["timestamp", "open", "high", "low", "close", "volume"]
    pd.testing.assert_frame_equal(from_csv, from_parquet)
    assert from_csv["close"].to_numpy() == pytest.approx(frame["Close"].to_numpy())
    assert from_csv["volume"].to_numpy() == pytest.approx(frame["Vol"].to_numpy())  # 'Vol' alias
    no_synthetic = dict(synthetic_bars_count=0, synthetic_signal=0.0, seed=0)
    assert load_bars(str(parquet), date_format="auto", **no_synthetic).equals(from_parquet)


def test_aliases_case_and_separate_date_time_columns(tmp_path):
    frame = good_frame(50)
    stamps = pd.date_range("2021-03-01 09:30", periods=50, freq="5min")
    frame = frame.drop(columns=["Date"]).rename(columns={"Open": "OPEN", "High": "high", "Vol": "Volume"})
    frame.insert(0, "Time", stamps.strftime("%H:%M:%S"))
    frame.insert(0, "Date", stamps.strftime("%Y-%m-%d"))
    bars = read_bars_file(write_csv(tmp_path, frame))
    assert (bars["timestamp"].to_numpy() == stamps.to_numpy()).all()
    parquet = tmp_path / "indexed.parquet"
    good_frame(50).drop(columns=["Date"]).set_index(stamps.rename("when")).to_parquet(parquet)
    assert (read_bars_file(parquet)["timestamp"].to_numpy() == stamps.to_numpy()).all()  # DatetimeIndex


# ---------------------------------------------------------------------------------------------- bad files
def _error(tmp_path, frame, name="bad.csv") -> str:
    with pytest.raises(UserError) as info:
        read_bars_file(write_csv(tmp_path, frame, name))
    return str(info.value)


def test_missing_column_is_named(tmp_path):
    message = _error(tmp_path, good_frame(20).drop(columns=["Open"]))
    assert "no 'open' column" in message and "Open" not in message.split("columns found:")[1].split(";")[0]
    assert "rename" in message
    assert "no timestamp column" in _error(tmp_path, good_frame(20).drop(columns=["Date"]))


def test_nan_names_column_and_row(tmp_path):
    frame = good_frame(20)
    frame.loc[7, "Close"] = np.nan
    message = _error(tmp_path, frame)
    assert "'Close'" in message and "data row 8" in message and "NaN" in message
    assert "fill" in message or "drop" in message


def test_non_numeric_value(tmp_path):
    frame = good_frame(20).astype({"High": object})
    frame.loc[3, "High"] = "n/a?"
    message = _error(tmp_path, frame)
    assert "'High'" in message and "data row 4" in message and "not a number" in message


def test_unparseable_and_missing_timestamps(tmp_path):
    frame = good_frame(20)
    frame.loc[5, "Date"] = "yesterday"
    assert "cannot read 'yesterday' as a time" in _error(tmp_path, frame)


@pytest.mark.parametrize("swap", ["duplicate", "backwards"])
def test_non_increasing_timestamps(tmp_path, swap):
    frame = good_frame(20)
    if swap == "duplicate":
        frame.loc[10, "Date"] = frame.loc[9, "Date"]
    else:
        frame.loc[[9, 10], "Date"] = frame.loc[[10, 9], "Date"].to_numpy()
    message = _error(tmp_path, frame)
    assert "strictly increase" in message and "data row 11" in message and "sort the file" in message


@pytest.mark.parametrize(
    "column, value, expected",
    [
        ("High", 1.0, "high"),  # high below low
        ("Open", 1e6, "open"),  # open above high
        ("Close", 1e-3, "close"),  # close below low
        ("Vol", -5, "volume -5"),
    ],
)
def test_inconsistent_bars(tmp_path, column, value, expected):
    frame = good_frame(20)
    frame.loc[12, column] = value
    message = _error(tmp_path, frame)
    assert "data row 13" in message and expected in message and "low <= open, close <= high" in message


def test_unsupported_and_missing_files(tmp_path):
    (tmp_path / "bars.xlsx").write_text("x")
    with pytest.raises(UserError, match="unsupported file type '.xlsx'"):
        read_bars_file(tmp_path / "bars.xlsx")
    with pytest.raises(UserError, match="not found"):
        read_bars_file(tmp_path / "nope.csv")
    with pytest.raises(UserError, match="neither a built-in"):
        load_bars("spx500", date_format="auto", synthetic_bars_count=0, synthetic_signal=0.0, seed=0)


def test_too_few_bars_for_warmup_and_episode(tmp_path):
    path = write_csv(tmp_path, good_frame(300))
    config = with_overrides(Config(), {"market.data": str(path)})
    with pytest.raises(UserError) as info:
        load_market(config.market, window=8)  # episode_length 256 + warm-up 140 > 210 training bars
    message = str(info.value)
    assert "300 bars" in message and "warm-up 140" in message and "episode_length 256" in message
    assert "lower market.episode_length" in message
    small = with_overrides(config, {"market.episode_length": 32})
    market = load_market(small.market, window=8)
    assert market.num_bars == 300 and market.contract.name == "derived"  # 'auto' on a file: from its prices


# ---------------------------------------------------------------------------------------------- splits
def test_splits_are_time_ordered_and_cover_everything():
    splits = split_bars(5031, 0.7, 0.15)
    assert [s.name for s in splits.values()] == ["train", "validation", "test"]
    assert splits["train"].start == 0 and splits["test"].stop == 5031
    assert (
        splits["train"].stop == splits["validation"].start
        and splits["validation"].stop == splits["test"].start
    )
    assert len(splits["train"]) == 3522 and len(splits["validation"]) == 754
    with pytest.raises(UserError):
        split_bars(100, 0.9, 0.2)


# ---------------------------------------------------------------------------------------------- synthetic
def test_synthetic_is_seeded_and_realistic():
    a, b, c = synthetic_bars(3000, 0.3, 0), synthetic_bars(3000, 0.3, 0), synthetic_bars(3000, 0.3, 1)
    pd.testing.assert_frame_equal(a, b)
    assert not np.allclose(a["close"], c["close"])
    r = np.diff(np.log(a["close"].to_numpy()))
    vol = pd.Series(r).rolling(60).std().dropna()
    assert vol.max() / vol.min() > 2.0  # volatility regimes
    z = (r - r.mean()) / r.std()
    assert (np.abs(z) > 5).sum() >= 3  # fat tails / jumps
    v = a["volume"].to_numpy()
    assert np.corrcoef(np.log(v[1:]), np.abs(r))[0, 1] > 0.1  # volume rises with the move


def test_synthetic_signal_plants_momentum():
    def lag_corr(signal):
        close = synthetic_bars(6000, signal, 3)["close"].to_numpy()
        r = np.diff(np.log(close))
        return np.corrcoef(r[:-1], r[1:])[0, 1]

    assert abs(lag_corr(0.0)) < 0.05
    assert lag_corr(0.3) > 0.15


# ---------------------------------------------------------------------------------------------- contracts
def test_contracts_auto_and_by_path(tmp_path):
    assert set(available_contracts()) >= {"es", "nq", "generic"}
    bars = good_frame(50)
    assert contract_for("auto", "sp500", bars).name == "es"
    assert contract_for("auto", "nasdaq", bars).name == "nq"
    assert contract_for("auto", "synthetic", bars).name == "generic"
    assert contract_for("auto", "/data/cl.csv", bars.rename(columns=str.lower)).name == "derived"
    es = load_contract("es")
    assert (es.multiplier, es.tick_size, es.slippage) == (50.0, 0.25, 0.25)
    assert es.cost_per_side == pytest.approx(2.25 + 12.5)
    path = tmp_path / "cl.toml"
    path.write_text(
        'name = "cl"\nmultiplier = 1000\ntick_size = 0.01\ncommission = 2.0\nslippage_ticks = 2\n'
    )
    cl = contract_for(str(path), "mine.csv", bars)
    assert cl.multiplier == 1000.0 and cl.slippage == pytest.approx(0.02)
    path.write_text('name = "cl"\nmultiplier = 1000\n')
    with pytest.raises(UserError, match="missing key"):
        load_contract(str(path))
    with pytest.raises(UserError, match="unknown contract 'zz'"):
        load_contract("zz")
