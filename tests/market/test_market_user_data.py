"""A user's own bars read right: date orders, time zones, bars per year, contracts derived from or checked against
the prices, bad bars refused with row/time/column, prices beyond float32, bars without volume."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest

from fitdqn.config import Config, with_overrides
from fitdqn.errors import UserError
from fitdqn.market.contract import ContractSpec, check_contract_fits, derive_contract, parse_contract, price_grid
from fitdqn.market.data import bars_from_config, bars_per_year, read_bars_file, synthetic_bars
from fitdqn.market.features import CLIP, compute_features
from fitdqn.market.layout import FEATURE_NAMES, VOLUME_FEATURES, WARMUP
from fitdqn.market.loader import load_market, market_contract


def ohlc(close: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    open_ = close * np.exp(rng.normal(0, 0.002, len(close)))
    return {
        "Open": open_,
        "High": np.maximum(open_, close) * 1.003,
        "Low": np.minimum(open_, close) * 0.997,
        "Close": close,
        "Volume": rng.integers(1000, 5000, len(close)).astype(float),
    }


def frame_at(stamps, close=None, seed: int = 0, **columns) -> pd.DataFrame:
    n = len(stamps)
    if close is None:
        close = 100 * np.exp(np.cumsum(np.random.default_rng(seed).normal(0, 0.01, n)))
    return pd.DataFrame({"Date": stamps, **ohlc(np.asarray(close, dtype=float), seed), **columns})


def read(tmp_path, frame: pd.DataFrame, date_format: str = "auto", name: str = "bars.csv") -> pd.DataFrame:
    path = tmp_path / name
    frame.to_csv(path, index=False)
    return read_bars_file(path, date_format=date_format)


def refused(tmp_path, frame, date_format: str = "auto") -> str:
    with pytest.raises(UserError) as info:
        read(tmp_path, frame, date_format)
    return str(info.value)


# ---------------------------------------------------------------------------------------------- date order
def test_day_first_timestamps_are_read_day_first(tmp_path):
    days = pd.bdate_range("2017-01-02", periods=300)
    text = [d.strftime("%d.%m.%Y %H:%M:%S") + ".000" for d in days]  # 13.01.2017 00:00:00.000
    assert "13.01.2017 00:00:00.000" in text
    bars = read(tmp_path, frame_at(text))
    assert (bars["timestamp"].to_numpy() == days.to_numpy()).all()
    by_pattern = read(tmp_path, frame_at(text), "%d.%m.%Y %H:%M:%S.%f")
    pd.testing.assert_frame_equal(bars, by_pattern)
    assert (read(tmp_path, frame_at(text), "day-first")["timestamp"] == bars["timestamp"]).all()


def test_month_first_timestamps_and_the_order_that_increases(tmp_path):
    days = pd.bdate_range("2017-01-02", periods=300)
    bars = read(tmp_path, frame_at(days.strftime("%m/%d/%Y")))
    assert (bars["timestamp"].to_numpy() == days.to_numpy()).all()
    # every value reads both ways but only month-first increases (2 January, then 1 February)
    two = read(tmp_path, frame_at(["01/02/2017", "02/01/2017", "03/01/2017"]))
    assert list(two["timestamp"]) == [pd.Timestamp(2017, 1, 2), pd.Timestamp(2017, 2, 1), pd.Timestamp(2017, 3, 1)]


def test_ambiguous_or_contradictory_dates_name_the_date_format_option(tmp_path):
    both = [f"{d:02d}.01.2017" for d in range(1, 11)]  # day-first: 1..10 Jan; month-first: 1 Jan..1 Oct
    message = refused(tmp_path, frame_at(both))
    assert "read both day-first and month-first" in message and "market.date_format" in message
    assert read(tmp_path, frame_at(both), "day-first")["timestamp"].iloc[-1] == pd.Timestamp(2017, 1, 10)
    assert read(tmp_path, frame_at(both), "month-first")["timestamp"].iloc[-1] == pd.Timestamp(2017, 10, 1)
    mixed = ["13/01/2017", "01/14/2017", "01/15/2017"]
    message = refused(tmp_path, frame_at(mixed))
    assert "only read day-first (data row 1" in message and "only read month-first (data row 2" in message
    assert "market.date_format" in message


def test_date_format_pattern_mismatch_and_bad_option(tmp_path):
    days = pd.bdate_range("2017-01-02", periods=30)
    message = refused(tmp_path, frame_at(days.strftime("%Y-%m-%d")), "%d.%m.%Y")
    assert "data row 1" in message and "market.date_format '%d.%m.%Y'" in message
    with pytest.raises(UserError, match="market.date_format = 'dmy'"):
        read(tmp_path, frame_at(days.strftime("%Y-%m-%d")), "dmy")


def test_date_format_knob_reaches_the_reader(tmp_path):
    days = pd.bdate_range("2017-01-02", periods=30)
    path = tmp_path / "dates.csv"
    frame_at(days.strftime("%d/%m/%y")).to_csv(path, index=False)
    config = with_overrides(Config(), {"market.data": str(path), "market.date_format": "%d/%m/%y"})
    assert Config().market.date_format == "auto"
    assert (bars_from_config(config.market)["timestamp"].to_numpy() == days.to_numpy()).all()


# ---------------------------------------------------------------------------------------------- time zones
def session_times(start: str, days: int) -> pd.DatetimeIndex:
    """30-minute bars 09:30 .. 15:30 on business days (local wall time)."""
    out = []
    for day in pd.bdate_range(start, periods=days):
        out.extend(pd.date_range(day + pd.Timedelta("9h30min"), periods=13, freq="30min"))
    return pd.DatetimeIndex(out)


def test_daylight_saving_change_keeps_the_local_session_times(tmp_path):
    wall = session_times("2021-03-10", 6)  # New York clocks go forward on Sunday 14 March 2021
    zoned = wall.tz_localize("America/New_York")
    text = [t.isoformat() for t in zoned]
    assert text[0].endswith("-05:00") and text[-1].endswith("-04:00")  # two UTC offsets in one file
    bars = read(tmp_path, frame_at(text))
    assert (bars["timestamp"].to_numpy() == wall.to_numpy()).all()  # 09:30 stays 09:30 on both sides
    assert set(bars["timestamp"].dt.strftime("%H:%M")[::13]) == {"09:30"}
    parquet = tmp_path / "zoned.parquet"
    frame_at(zoned).to_parquet(parquet)  # a tz-aware column: same rule
    assert (read_bars_file(parquet, date_format="auto")["timestamp"].to_numpy() == wall.to_numpy()).all()
    one_offset = read(tmp_path, frame_at([t.isoformat() for t in zoned[:13]]))  # one offset: same rule
    assert (one_offset["timestamp"].to_numpy() == wall[:13].to_numpy()).all()


def test_naive_then_zoned_times_say_what_is_wrong(tmp_path):
    wall = session_times("2021-03-10", 2)
    text = [t.isoformat() for t in wall[:13]] + [t.isoformat() for t in wall[13:].tz_localize("America/New_York")]
    message = refused(tmp_path, frame_at(text))
    assert "mixes times with a UTC offset (data row 14" in message and "without one (data row 1" in message
    assert "give every time with its offset, or none" in message and "ISO" not in message


def test_fall_back_repeat_names_the_daylight_saving_cause(tmp_path):
    utc = pd.date_range("2021-11-07 04:00", periods=6, freq="30min", tz="UTC")
    zoned = utc.tz_convert("America/New_York")  # 00:00 .. 01:30 EDT, then 01:00 .. 01:30 again in EST
    text = [t.isoformat() for t in zoned]
    assert len({t[:19] for t in text}) < len(text)
    message = refused(tmp_path, frame_at(text))
    assert "strictly increase" in message and "daylight saving" in message


# ---------------------------------------------------------------------------------------------- bars per year
def test_bars_per_year_from_the_calendar():
    hourly = pd.date_range("2021-01-01", "2023-12-31 23:00", freq="h")  # 2021-2023: no leap year
    assert bars_per_year(hourly) == 8760  # 24x7 (crypto)
    five_day = hourly[hourly.day_of_week < 5]
    assert 6200 <= bars_per_year(five_day) <= 6270  # 24x5 (forex, futures): 24 x 5 x 52.1
    assert bars_per_year(pd.date_range("2001-01-05", "2010-12-31", freq="W-FRI")) == 52
    assert bars_per_year(synthetic_bars(3000, 0.3, 0)["timestamp"]) == 261  # business days, no holidays
    nyse = pd.bdate_range("2015-01-02", "2018-12-31")
    holidays = pd.DatetimeIndex([d for d in nyse if (d.month, d.day) in ((1, 1), (7, 4), (12, 25))])
    assert bars_per_year(nyse.difference(holidays)) == pytest.approx(261 - 2, abs=1)
    # less than a full year: full weeks inside the data, or the span
    assert bars_per_year(five_day[: 24 * 5 * 6]) == pytest.approx(120 * 365.2425 / 7, rel=1e-6)
    assert bars_per_year(pd.date_range("2021-01-04 09:00", periods=5, freq="h")) == pytest.approx(24 * 365.2425)
    with pytest.raises(UserError):
        bars_per_year(hourly[:1])


def test_builtin_daily_bars_have_about_252_a_year():
    from fitdqn.market.data import builtin_bars

    assert bars_per_year(builtin_bars("sp500")["timestamp"]) == 252


# ---------------------------------------------------------------------------------------------- contracts
def canonical(close, seed: int = 0, decimals: int | None = None) -> pd.DataFrame:
    columns = ohlc(np.asarray(close, dtype=float), seed)
    frame = pd.DataFrame({k.lower(): v for k, v in columns.items()})
    if decimals is not None:
        frame[["open", "high", "low", "close"]] = frame[["open", "high", "low", "close"]].round(decimals)
        frame["high"] = frame[["open", "high", "close"]].max(axis=1)
        frame["low"] = frame[["open", "low", "close"]].min(axis=1)
    frame.insert(0, "timestamp", pd.bdate_range("2010-01-04", periods=len(frame)))
    return frame


def test_price_grid_from_the_decimals():
    assert price_grid(np.array([1.1, 1.1234, 1.0999])) == pytest.approx(1e-4)
    assert price_grid(np.array([2500.25, 2500.5, 2501.75, 2499.0])) == 0.25  # ES's quarter points
    assert price_grid(np.array([105.0, 110.0, 95.0])) == 5.0
    assert price_grid(np.array([1228.099976, 1244.780029, 1228.21337])) == pytest.approx(1e-6)  # float32 noise
    assert price_grid(np.array([1.0 / 3.0, 2.0 / 3.0])) is None  # no grid down to 1e-8


def test_auto_contract_on_a_file_fits_a_price_of_1_1(tmp_path):
    close = 1.1 * np.exp(np.cumsum(np.random.default_rng(3).normal(0, 0.003, 400)))
    bars = canonical(close, decimals=5)
    spec = derive_contract(bars, "'eurusd.csv'")
    typical = float(np.median(bars["close"]))
    assert spec.name == "derived" and spec.multiplier == 1.0 and spec.tick_size == pytest.approx(1e-5)
    assert spec.slippage == pytest.approx(1e-4 * typical, rel=1e-5)  # 1 bp of the price
    assert spec.cost_per_side == pytest.approx(1.5e-4 * typical, rel=1e-5)  # 1.5 bp a side
    assert "derived from the prices of 'eurusd.csv'" in spec.summary and "tick 1e-05" in spec.summary
    path = tmp_path / "eurusd.csv"
    bars.to_csv(path, index=False)
    config = with_overrides(Config(), {"market.data": str(path), "market.episode_length": 32})
    market = load_market(config.market, window=4)
    assert market.contract.tick_size == pytest.approx(1e-5) and market.contract.multiplier == 1.0
    assert market_contract(config.market) == market.contract  # the one resolution act/export use too
    assert any(line.startswith("contract: derived: 1 price units per price point") for line in market.notes)
    with pytest.raises(UserError) as info:  # the ES-like generic spec on a price of 1.1: refused
        load_market(with_overrides(config, {"market.contract": "generic"}).market, window=4)
    message = str(info.value)
    assert "tick of 0.25" in message and "of the median price 1.1" in message and "market.contract = auto" in message


def test_derived_tick_without_a_grid_and_specs_from_the_training_bars_only():
    noisy = canonical(1228.099976 * np.exp(np.cumsum(np.random.default_rng(1).normal(0, 0.01, 300))))
    assert derive_contract(noisy, "x").tick_size == pytest.approx(0.1)  # 10**(3 - 4) for prices ~1,000
    later = pd.concat([noisy, canonical(noisy["close"].to_numpy() * 100)], ignore_index=True)
    assert derive_contract(later.iloc[:300], "x") == derive_contract(noisy, "x")


def test_shipped_specs_fit_their_builtin_bars():
    config = Config()
    for data in ("sp500", "nasdaq", "synthetic"):
        market = load_market(with_overrides(config, {"market.data": data}).market, window=8)
        assert market.notes[0] == f"contract: {market.contract.summary}"
        assert market.contract.name == {"sp500": "es", "nasdaq": "nq", "synthetic": "generic"}[data]
    es = market.contract if data == "es" else parse_contract(
        'name = "es"\nmultiplier = 50\ntick_size = 0.25\ncommission = 2.25\nslippage_ticks = 1\n', "x"
    )
    assert es.summary.startswith("es: 50 USD per price point, tick 0.25, commission 2.25 USD + slippage 1 tick(s)")
    assert "(14.75 USD a side)" in es.summary


@pytest.mark.parametrize(
    "line, expected",
    [
        ("tick_size = -0.25", "tick_size = -0.25; it must be a positive number"),
        ("tick_size = 0", "tick_size = 0.0; it must be a positive number"),
        ("multiplier = 0", "multiplier = 0.0; it must be a positive number"),
        ("multiplier = nan", "multiplier = nan"),
        ("commission = -1", "commission = -1.0; it must be a number >= 0"),
        ("slippage_ticks = inf", "slippage_ticks = inf"),
    ],
)
def test_absurd_contract_specs_are_refused(line, expected):
    fields = {"name": '"x"', "multiplier": "50", "tick_size": "0.25", "commission": "2", "slippage_ticks": "1"}
    key = line.split(" = ")[0]
    text = "\n".join(f"{k} = {v}" for k, v in fields.items() if k != key) + "\n" + line + "\n"
    with pytest.raises(UserError) as info:
        parse_contract(text, "'x.toml'")
    assert expected in str(info.value) and "'x.toml'" in str(info.value)
    with pytest.raises(UserError):
        ContractSpec(name="x", multiplier=50.0, tick_size=-0.25, commission=1.0, slippage_ticks=1.0)


def test_a_position_whose_pnl_overflows_float32_is_refused():
    bars = canonical(np.full(50, 1e13))
    big = ContractSpec(name="big", multiplier=1e6, tick_size=1.0, commission=0.0, slippage_ticks=0.0)
    with pytest.raises(UserError, match="would overflow"):
        check_contract_fits(big, bars, 2, "'x'")
    costly = ContractSpec(name="costly", multiplier=1.0, tick_size=0.01, commission=5.0, slippage_ticks=0.0)
    with pytest.raises(UserError, match="costs 5 per contract per fill"):
        check_contract_fits(costly, canonical(np.full(50, 100.0)), 2, "'x'")


# ---------------------------------------------------------------------------------------------- bad bars
def good(n: int = 400) -> pd.DataFrame:
    return frame_at(pd.bdate_range("2010-01-04", periods=n).strftime("%Y-%m-%d"))


@pytest.mark.parametrize("column, value", [("Low", 0.0), ("Low", -3.0), ("Open", -5.0)])
def test_non_positive_price_names_row_time_and_column(tmp_path, column, value):
    frame = good(30)
    frame.loc[12, column] = value
    message = refused(tmp_path, frame)
    assert f"column '{column}' at data row 13" in message and "(time 2010-01-20" in message
    assert "prices must be positive" in message and "1 such bars in all" in message


@pytest.mark.parametrize("case", ["times_1e36", "drift_to_4e123"])
def test_prices_beyond_float32_are_refused_at_load(tmp_path, case):
    frame = good(400)
    if case == "times_1e36":
        frame[["Open", "High", "Low", "Close"]] *= 1e36
        first = 0
    else:  # a series drifting from 100 to 4e123
        growth = np.exp(np.linspace(0.0, math.log(4e121), len(frame)))
        frame[["Open", "High", "Low", "Close"]] = frame[["Open", "High", "Low", "Close"]].mul(growth, axis=0)
        first = int(np.flatnonzero(frame[["Open", "High", "Low", "Close"]].max(axis=1) > 1e15)[0])
    path = tmp_path / "big.csv"
    frame.to_csv(path, index=False)
    config = with_overrides(Config(), {"market.data": str(path), "market.episode_length": 32})
    with pytest.raises(UserError) as info:
        load_market(config.market, window=4)  # refused before any feature, env or update
    message = str(info.value)
    assert f"at data row {first + 1} " in message and "beyond 1e+15" in message and "float32" in message
    assert "larger unit" in message


def test_bad_canonical_bars_never_reach_the_features():
    bars = synthetic_bars(400, 0.3, 0)
    for column, value, expected in (
        ("low", -1.0, "column 'low' at data row 201"),
        ("close", math.nan, "column 'close' at data row 201"),
        ("volume", math.nan, "data row 201 (1 = first bar) (time 2000-10-09 00:00:00): volume nan is not a finite"),
    ):
        bad = bars.copy()
        bad.loc[200, column] = value
        with pytest.raises(UserError, match=re.escape(expected)):
            compute_features(bad)


def test_infinite_features_of_good_bars_take_the_clip_end_of_their_sign():
    bars = synthetic_bars(400, 0.3, 0)
    flat = bars.loc[300, "close"]
    bars.loc[300:305, ["open", "high", "low", "close"]] = flat  # six identical bars: 5-bar volatility 0
    features = compute_features(bars)
    k = FEATURE_NAMES.index("vol_5_20")
    assert features[305, k] == -CLIP  # log(0 / vol_20) = -inf: the lowest value, not 0
    assert features[304, k] > -CLIP and bool(features.isfinite().all())


# ---------------------------------------------------------------------------------------------- no volume
def test_bars_without_volume_have_the_volume_features_off(tmp_path):
    with_volume = synthetic_bars(1200, 0.3, 0)
    path = tmp_path / "novolume.csv"
    with_volume.drop(columns=["volume"]).to_csv(path, index=False)
    bars = read_bars_file(path, date_format="auto")
    assert (bars["volume"] == 0).all() and bars.attrs["volume_column"] is None
    off, on = compute_features(bars), compute_features(with_volume)
    assert off.shape == on.shape == (1200, len(FEATURE_NAMES))  # the state width does not change
    volume = [FEATURE_NAMES.index(name) for name in VOLUME_FEATURES]
    rest = [k for k in range(len(FEATURE_NAMES)) if k not in volume]
    assert bool((off[:, volume] == 0).all()) and bool((on[WARMUP:, volume] != 0).any())
    assert bool((off[:, rest] == on[:, rest]).all())
    config = with_overrides(Config(), {"market.data": str(path), "market.episode_length": 32})
    market = load_market(config.market, window=4)
    assert not market.volume_features and "volume features off (no volume column)" in market.notes
    assert load_market(with_overrides(config, {"market.data": "synthetic"}).market, window=4).volume_features


def test_a_csv_without_volume_trains(tmp_path):
    from fitdqn.train.run import train

    path = tmp_path / "novolume.csv"
    synthetic_bars(1200, 0.3, 0).drop(columns=["volume"]).to_csv(path, index=False)
    small = {
        "market.data": str(path), "market.episode_length": 32,
        "net.window": 4, "net.trunk_hidden": 64, "net.d_model": 32, "net.stream_hidden": 32, "net.num_atoms": 11,
        "net.iqn_embedding": 16, "net.iqn_quantiles": 8, "net.iqn_act_quantiles": 8, "net.iql_hidden": 32,
        "collect.num_envs": 16, "collect.steps_per_epoch": 16, "replay.capacity": 4096, "replay.min_fill": 128,
        "budget.batch_size": 64, "train.device": "cpu", "train.epochs": 1, "train.eval_every": 1,
        "train.checkpoint_every": 1, "train.eval_seeds": 1, "train.out": str(tmp_path / "run"),
    }
    report = train(with_overrides(Config(), small), tmp_path / "run")
    assert report["updates"] > 0 and report["test"]["agent"]["sharpe"] is not None


def test_a_missing_time_in_a_zoned_or_day_first_file_is_named_as_missing(tmp_path):
    days = pd.bdate_range("2017-01-02", periods=30)
    day_first = frame_at(days.strftime("%d.%m.%Y").tolist())
    day_first.loc[4, "Date"] = None
    assert "missing time (NaN) at data row 5" in refused(tmp_path, day_first)
    zoned = frame_at([t.isoformat() for t in session_times("2021-03-10", 2).tz_localize("America/New_York")])
    zoned.loc[3, "Date"] = None
    assert "missing time (NaN) at data row 4" in refused(tmp_path, zoned)


def test_dates_written_as_digits_are_dates_not_epoch_seconds(tmp_path):
    days = pd.bdate_range("2017-01-02", periods=30)
    assert (read(tmp_path, frame_at(days.strftime("%Y%m%d").astype(int)))["timestamp"] == days).all()
    minutes = pd.date_range("2017-01-02 09:30", periods=30, freq="min")
    assert (read(tmp_path, frame_at(minutes.strftime("%Y%m%d%H%M").astype(int)))["timestamp"] == minutes).all()
    epoch = ((minutes - pd.Timestamp(0)) // pd.Timedelta(seconds=1)).to_numpy()  # epoch seconds stay so
    assert (read(tmp_path, frame_at(epoch))["timestamp"] == minutes).all()
