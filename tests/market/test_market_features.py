"""Features: shape and names, no look-ahead on real data, warm-up, TA-Lib agreement, calendar, primitives."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fitdqn.market import features as F
from fitdqn.market.data import builtin_bars
from fitdqn.market.layout import AGENT_FIELDS, NUM_FEATURES, STATE_DIM


@pytest.fixture(scope="module")
def sp500():
    return builtin_bars("sp500")


@pytest.fixture(scope="module")
def sp500_features(sp500):
    return F.compute_features(sp500)


def test_shape_names_and_range(sp500_features):
    assert len(F.FEATURE_NAMES) == len(set(F.FEATURE_NAMES)) == NUM_FEATURES == 80 - len(AGENT_FIELDS) == 72
    assert STATE_DIM == 80
    x = sp500_features
    assert x.shape == (5031, 72) and x.dtype == torch.float32
    assert torch.isfinite(x).all()
    assert x.abs().max() <= F.CLIP
    assert (x[: F.WARMUP] == 0).all()  # warm-up rows are zeros
    body = x[F.WARMUP :]
    std = body.std(dim=0)
    constant = [n for n, s in zip(F.FEATURE_NAMES, std.tolist(), strict=True) if s < 1e-6]
    assert constant == ["time_of_day_sin", "time_of_day_cos"]  # daily bars: no time of day
    assert (std[std > 1e-6] < 2.5).all() and (body.mean(dim=0).abs() < 2.0).all()  # normalised scale


def test_raw_features_need_exactly_the_warmup(sp500):
    raw = torch.stack(list(F.feature_columns(sp500).values()), dim=1)
    assert torch.isfinite(raw[F.WARMUP :]).all()  # every feature exists from the warm-up on
    assert not torch.isfinite(raw[F.WARMUP - 2]).all()  # ... and the warm-up is tight (+1 margin)


@pytest.mark.parametrize("cut", [200, 1000, 2517, 4999])
def test_no_lookahead_by_truncation(sp500, sp500_features, cut):
    """Rows before a cut are the same whether or not the bars after it exist (real sp500 data)."""
    truncated = F.compute_features(sp500.iloc[:cut].reset_index(drop=True))
    torch.testing.assert_close(truncated, sp500_features[:cut], rtol=0, atol=1e-6)
    assert (truncated == sp500_features[:cut]).float().mean() > 0.999


def test_no_lookahead_when_the_future_changes(sp500, sp500_features):
    """Scrambling every bar after t leaves rows <= t untouched."""
    t = 3000
    changed = sp500.copy()
    rng = np.random.default_rng(0)
    factor = np.exp(rng.normal(0, 0.05, len(sp500) - t - 1))
    for column in ("open", "high", "low", "close"):
        changed.loc[t + 1 :, column] = changed.loc[t + 1 :, column].to_numpy() * factor
    changed.loc[t + 1 :, "volume"] = changed.loc[t + 1 :, "volume"].to_numpy()[::-1]
    x = F.compute_features(changed)
    torch.testing.assert_close(x[: t + 1], sp500_features[: t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(x[t + 1 :], sp500_features[t + 1 :])


@pytest.mark.parametrize("name", ["sp500", "nasdaq"])
def test_talib_agreement(name):
    talib = pytest.importorskip("talib")
    b = F.bar_tensors(builtin_bars(name))
    h, low, c = (b[k] for k in ("high", "low", "close"))
    hn, ln, cn = h.numpy(), low.numpy(), c.numpy()

    def same(ours: torch.Tensor, theirs: np.ndarray, what: str):
        ours = ours.numpy()
        assert np.array_equal(np.isnan(ours), np.isnan(theirs)), f"{what}: warm-up rows differ"
        ok = ~np.isnan(theirs)
        np.testing.assert_allclose(ours[ok], theirs[ok], rtol=1e-9, atol=1e-9, err_msg=what)

    for n in (5, 7, 14, 28):
        same(F.rsi(c, n), talib.RSI(cn, n), f"RSI {n}")
        same(F.atr(h, low, c, n), talib.ATR(hn, ln, cn, n), f"ATR {n}")
    for n in (8, 21, 55):
        same(F.ema(c, n), talib.EMA(cn, n), f"EMA {n}")
    same(F.sma(c, 20), talib.SMA(cn, 20), "SMA 20")
    for ours, theirs, what in zip(
        F.macd(c), talib.MACD(cn, 12, 26, 9), ("macd", "signal", "hist"), strict=True
    ):
        same(ours, theirs, f"MACD {what}")
    same(F.true_range(h, low, c), talib.TRANGE(hn, ln, cn), "TRANGE")

    # ... and the state features are those indicators, normalised
    x = F.compute_features(builtin_bars(name)).double()
    rows = slice(F.WARMUP, None)
    rsi14 = (talib.RSI(cn, 14)[rows] - 50) / 25
    np.testing.assert_allclose(x[rows, F.FEATURE_NAMES.index("rsi_14")].numpy(), rsi14, atol=1e-5)
    atr14 = talib.ATR(hn, ln, cn, 14)[rows]
    macd_over_atr = np.clip(talib.MACD(cn, 12, 26, 9)[0][rows] / atr14, -5, 5)
    np.testing.assert_allclose(x[rows, F.FEATURE_NAMES.index("macd")].numpy(), macd_over_atr, atol=1e-5)


def test_calendar_matches_pandas():
    stamps = pd.Series(pd.date_range("1899-12-25 13:45", periods=4000, freq="17h").as_unit("ns"))
    stamps = pd.concat([stamps, pd.Series(pd.date_range("2024-02-27", periods=5, freq="D").as_unit("ns"))])
    ns = torch.tensor(stamps.to_numpy().astype("datetime64[ns]").astype(np.int64))
    weekday, month, fraction = F.calendar_fields(ns)
    assert weekday.tolist() == stamps.dt.day_of_week.tolist()
    assert month.tolist() == stamps.dt.month.tolist()
    seconds = (stamps.dt.hour * 3600 + stamps.dt.minute * 60).to_numpy()
    np.testing.assert_allclose(fraction.numpy(), seconds / 86400)


def test_linear_recurrence_matches_a_loop():
    torch.manual_seed(0)
    b = torch.randn(1000, dtype=torch.float64)
    for decay in (0.0, 0.5, 13 / 14, 0.999):
        expected, y = [], 0.0
        for value in b.tolist():
            y = decay * y + value
            expected.append(y)
        torch.testing.assert_close(F.linear_recurrence(b, decay), torch.tensor(expected, dtype=torch.float64))


def test_rolling_windows_are_trailing():
    x = torch.arange(10, dtype=torch.float64)
    s = F.rolling_sum(x, 3)
    assert torch.isnan(s[:2]).all() and s[2:].tolist() == [3.0 * k for k in range(1, 9)]
    assert F.rolling_max(x, 4)[3:].tolist() == list(map(float, range(3, 10)))
    assert torch.isnan(F.shift(x, 2)[:2]).all() and F.shift(x, 2)[2:].tolist() == x[:-2].tolist()
    corr = F.rolling_corr(x, 2 * x + 1, 5)
    assert torch.allclose(corr[4:], torch.ones(6, dtype=torch.float64))


def test_degenerate_bars_give_finite_features():
    """Flat prices and zero volume (0/0 everywhere) still give finite features."""
    n = 300
    bars = pd.DataFrame(
        {
            "timestamp": pd.date_range("2020-01-01", periods=n, freq="min").as_unit("ns"),
            "open": np.full(n, 50.0),
            "high": np.full(n, 50.0),
            "low": np.full(n, 50.0),
            "close": np.full(n, 50.0),
            "volume": np.zeros(n),
        }
    )
    x = F.compute_features(bars)
    assert torch.isfinite(x).all()
    day = F.FEATURE_NAMES.index("time_of_day_sin")
    assert x[F.WARMUP + 1, day] == pytest.approx(math.sin(2 * math.pi * (F.WARMUP + 1) / 1440), abs=1e-6)


def test_device_argument(sp500):
    x = F.compute_features(sp500.iloc[:400], device="cpu")
    assert x.device.type == "cpu" and x.shape == (400, 72)
