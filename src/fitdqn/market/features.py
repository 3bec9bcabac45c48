"""Causal technical features, computed in torch on the device.

``compute_features(bars) -> [T, Fm]`` float32 with ``Fm = len(FEATURE_NAMES) = 72`` (the agent state adds
``Fa = 8`` columns, so the state is 80 wide). Row t uses bars ``<= t`` only: every statistic is a trailing
window or a recursion that starts at the first bar (no whole-series mean, no centred window), so rows before t
are the same whether or not bars after t exist. Scale comes from the bars' own trailing statistics (returns
over trailing volatility, distances over ATR, rolling z-scores), so sp500 points, NQ points and a synthetic
market give features of the same size. Every feature is clipped to [-5, 5]; a degenerate value of valid bars
(a flat bar, zero volume: 0/0) becomes 0, a ratio over a vanished scale (+-inf) the clip's end of its sign;
bad bars never get here (they are refused first). Bars without volume (no volume column) have the volume
features (``VOLUME_FEATURES``) at 0 and the same width. The first ``WARMUP`` rows (too little history for the
longest window) are 0 and the environment starts episodes at or after ``WARMUP``.

RSI, ATR and MACD use TA-Lib's definitions exactly (Wilder smoothing seeded with a simple average; MACD's
EMAs seeded the way TA-Lib seeds them), in :func:`rsi`, :func:`atr`, :func:`macd`, then are normalised.
Everything is computed in float64 and returned as float32.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from fitdqn.config import MarketConfig
from fitdqn.market.data import COLUMNS, normalise_bars, validate_bars
from fitdqn.market.layout import (
    CHANNELS,
    EMA_PERIODS,
    FEATURE_NAMES,
    LAGS,
    LONG,
    RETURN_HORIZONS,
    SMA_PERIODS,
    VOLUME_FEATURES,
    WARMUP,
)

CLIP = 5.0
_SCAN_CHUNK = 128  # rows per block of the blocked linear-recurrence scan
_ROLL_CHUNK = 65_536  # output rows per block of rolling windows (bounds memory at chunk x window)


# ---------------------------------------------------------------------------------------------- primitives
def _nan(like: Tensor, n: int) -> Tensor:
    return torch.full((n, *like.shape[1:]), math.nan, dtype=like.dtype, device=like.device)


def shift(x: Tensor, k: int) -> Tensor:
    """``x[t - k]`` at row t (NaN for t < k)."""
    if k == 0:
        return x
    k = min(k, x.shape[0])
    return torch.cat([_nan(x, k), x[: x.shape[0] - k]])


def rolling(x: Tensor, n: int, reduce) -> Tensor:
    """``reduce(windows [rows, n]) -> [rows]`` over trailing windows ``x[t-n+1 .. t]``; NaN for t < n - 1.

    Each row is reduced on its own window (blocks of rows bound the memory), so a row never depends on later
    bars or on the series length.
    """
    T = x.shape[0]
    out = torch.full((T,), math.nan, dtype=x.dtype, device=x.device)
    for first in range(0, max(T - n + 1, 0), _ROLL_CHUNK):
        rows = min(_ROLL_CHUNK, T - n + 1 - first)
        windows = x[first : first + rows + n - 1].unfold(0, n, 1)  # [rows, n] view
        out[first + n - 1 : first + n - 1 + rows] = reduce(windows)
    return out


def rolling_mean(x: Tensor, n: int) -> Tensor:
    return rolling(x, n, lambda w: w.mean(dim=1))


def rolling_sum(x: Tensor, n: int) -> Tensor:
    return rolling(x, n, lambda w: w.sum(dim=1))


def rolling_std(x: Tensor, n: int) -> Tensor:
    """Sample standard deviation over the trailing ``n`` values."""
    return rolling(x, n, lambda w: w.std(dim=1))


def rolling_max(x: Tensor, n: int) -> Tensor:
    return rolling(x, n, lambda w: w.amax(dim=1))


def rolling_min(x: Tensor, n: int) -> Tensor:
    return rolling(x, n, lambda w: w.amin(dim=1))


def rolling_zscore(x: Tensor, n: int) -> Tensor:
    """``(x - trailing mean) / trailing std`` over ``n`` values (the current one included)."""
    return (x - rolling_mean(x, n)) / rolling_std(x, n)


def _rolling_skew(w: Tensor) -> Tensor:
    c = w - w.mean(dim=1, keepdim=True)
    return (c**3).mean(dim=1) / (c**2).mean(dim=1).pow(1.5)


def rolling_corr(x: Tensor, y: Tensor, n: int) -> Tensor:
    """Pearson correlation of ``x`` and ``y`` over trailing windows of ``n``."""
    pair = torch.stack([x, y], dim=1)  # [T, 2]

    def reduce(w: Tensor) -> Tensor:  # w [rows, 2, n]
        c = w - w.mean(dim=2, keepdim=True)
        cov = (c[:, 0] * c[:, 1]).sum(dim=1)
        return cov / (c[:, 0].pow(2).sum(dim=1) * c[:, 1].pow(2).sum(dim=1)).sqrt()

    T = x.shape[0]
    out = torch.full((T,), math.nan, dtype=x.dtype, device=x.device)
    for first in range(0, max(T - n + 1, 0), _ROLL_CHUNK):
        rows = min(_ROLL_CHUNK, T - n + 1 - first)
        out[first + n - 1 : first + n - 1 + rows] = reduce(pair[first : first + rows + n - 1].unfold(0, n, 1))
    return out


def linear_recurrence(b: Tensor, decay: float) -> Tensor:
    """``y[t] = decay * y[t-1] + b[t]`` with ``y[-1] = 0``, for ``b [T]`` (float64).

    Blocked scan: inside a block of ``_SCAN_CHUNK`` rows it is one matrix product with the lower-triangular
    matrix ``decay ** (i - j)``; blocks are chained through their last value. Blocks start at row 0 whatever
    the length (the tail block is zero-padded), so a row's value does not depend on later rows.
    """
    T = b.shape[0]
    L = _SCAN_CHUNK
    blocks = max(1, math.ceil(T / L))
    padded = torch.zeros(blocks * L, dtype=b.dtype, device=b.device)
    padded[:T] = b
    i = torch.arange(L, device=b.device)
    power = (i[:, None] - i[None, :]).to(b.dtype)  # [L, L]
    M = torch.where(
        power >= 0, torch.full_like(power, decay).pow(power.clamp(min=0)), torch.zeros_like(power)
    )
    carry = torch.full((L,), decay, dtype=b.dtype, device=b.device).pow((i + 1).to(b.dtype))  # [L]
    out = torch.empty_like(padded)
    previous = torch.zeros((), dtype=b.dtype, device=b.device)
    for k in range(blocks):
        block = M @ padded[k * L : (k + 1) * L] + carry * previous  # [L]
        out[k * L : (k + 1) * L] = block
        previous = block[-1]
    return out[:T]


def seeded_ema(x: Tensor, alpha: float, seed_index: int, seed_value: Tensor) -> Tensor:
    """``y[s] = seed_value``, ``y[t] = y[t-1] + alpha * (x[t] - y[t-1])`` for t > s; NaN before s."""
    T = x.shape[0]
    out = torch.full_like(x, math.nan)
    if seed_index >= T:
        return out
    b = torch.zeros_like(x)
    b[seed_index] = seed_value
    b[seed_index + 1 :] = alpha * x[seed_index + 1 :]
    out[seed_index:] = linear_recurrence(b, 1.0 - alpha)[seed_index:]
    return out


def sma(x: Tensor, n: int) -> Tensor:
    """Simple moving average (TA-Lib SMA)."""
    return rolling_mean(x, n)


def ema(x: Tensor, n: int, start: int = 0) -> Tensor:
    """TA-Lib EMA: ``k = 2 / (n + 1)``, seeded with the mean of the first ``n`` values from ``start``."""
    seed_index = start + n - 1
    if seed_index >= x.shape[0]:
        return torch.full_like(x, math.nan)
    return seeded_ema(x, 2.0 / (n + 1), seed_index, x[start : seed_index + 1].mean())


def wilder(x: Tensor, n: int, start: int) -> Tensor:
    """Wilder smoothing (``alpha = 1 / n``) seeded with the mean of ``x[start .. start + n - 1]``."""
    seed_index = start + n - 1
    if seed_index >= x.shape[0]:
        return torch.full_like(x, math.nan)
    return seeded_ema(x, 1.0 / n, seed_index, x[start : seed_index + 1].mean())


def true_range(high: Tensor, low: Tensor, close: Tensor) -> Tensor:
    """TA-Lib TRANGE (row 0, with no previous close, is NaN)."""
    prev = shift(close, 1)
    return torch.maximum(high, prev) - torch.minimum(low, prev)


def atr(high: Tensor, low: Tensor, close: Tensor, n: int = 14) -> Tensor:
    """TA-Lib ATR: Wilder average of the true range, first value at row ``n`` (NaN before)."""
    return wilder(true_range(high, low, close), n, start=1)


def rsi(close: Tensor, n: int = 14) -> Tensor:
    """TA-Lib RSI (0..100): Wilder averages of gains and losses, first value at row ``n``."""
    change = close - shift(close, 1)
    gain = wilder(change.clamp(min=0), n, start=1)
    loss = wilder((-change).clamp(min=0), n, start=1)
    total = gain + loss
    return torch.where(total.abs() < 1e-8, torch.zeros_like(total), 100.0 * gain / total)


def macd(close: Tensor, fast: int = 12, slow: int = 26, signal: int = 9) -> tuple[Tensor, Tensor, Tensor]:
    """TA-Lib MACD ``(macd, signal, histogram)``, first values at row ``slow + signal - 2``.

    As in TA-Lib both EMAs start at row ``slow - 1``: the slow one seeded with the mean of rows
    ``0 .. slow-1``, the fast one with the mean of the ``fast`` rows ending there.
    """
    first = slow - 1
    T = close.shape[0]
    if first + signal - 1 >= T:
        nan = torch.full_like(close, math.nan)
        return nan, nan.clone(), nan.clone()
    slow_ema = seeded_ema(close, 2.0 / (slow + 1), first, close[: first + 1].mean())
    fast_ema = seeded_ema(close, 2.0 / (fast + 1), first, close[first - fast + 1 : first + 1].mean())
    line = fast_ema - slow_ema  # valid from `first`
    signal_line = ema(line, signal, start=first)  # valid from first + signal - 1
    valid = torch.arange(T, device=close.device) >= first + signal - 1
    line = torch.where(valid, line, torch.full_like(line, math.nan))
    return line, signal_line, line - signal_line


# ---------------------------------------------------------------------------------------------- calendar
def calendar_fields(ns: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(day of week 0=Mon, month 1..12, fraction of the day) from int64 epoch nanoseconds (wall time)."""
    day_ns = 86_400 * 10**9
    days = torch.div(ns, day_ns, rounding_mode="floor")  # days since 1970-01-01 (a Thursday)
    day_fraction = (ns - days * day_ns).to(torch.float64) / day_ns
    weekday = torch.remainder(days + 3, 7)
    # civil-from-days (H. Hinnant): month of the proleptic Gregorian calendar
    z = days + 719_468
    era = torch.div(z, 146_097, rounding_mode="floor")
    doe = z - era * 146_097
    yoe = torch.div(doe - doe // 1460 + doe // 36_524 - doe // 146_096, 365, rounding_mode="floor")
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = torch.div(5 * doy + 2, 153, rounding_mode="floor")
    month = torch.where(mp < 10, mp + 3, mp - 9)
    return weekday, month, day_fraction


# ---------------------------------------------------------------------------------------------- features
# the feature names, their window constants and WARMUP live in fitdqn.market.layout (no pandas: the planner
# reads them)


def has_volume(bars: pd.DataFrame) -> bool:
    """Whether the bars carry volume (a file without a volume column has 0 on every bar): the volume
    features are off (0) when they do not."""
    return bool((bars["volume"].to_numpy() > 0).any())


def bar_tensors(bars: pd.DataFrame, device=None) -> dict[str, Tensor]:
    """The bar columns as float64 tensors (``ns``: int64 epoch nanoseconds) on ``device``; any frame is
    validated first (a canonical one too: a bad price must not reach the features)."""
    if list(bars.columns[:6]) == list(COLUMNS):
        validate_bars(bars, "bars")
        frame = bars
    else:
        frame = normalise_bars(bars, date_format=MarketConfig().date_format)  # a frame given directly
    out = {k: torch.tensor(frame[k].to_numpy(dtype=np.float64), device=device) for k in COLUMNS[1:]}
    stamps = frame["timestamp"].to_numpy().astype("datetime64[ns]").astype(np.int64)
    out["ns"] = torch.tensor(stamps, device=device)
    return out


def feature_columns(bars: pd.DataFrame, device=None) -> dict[str, Tensor]:
    """The raw features ``{name: [T] float64}`` in FEATURE_NAMES order, before cleaning: NaN where the
    history is too short (and where a ratio is 0/0)."""
    b = bar_tensors(bars, device)
    o, h, low, c, v = b["open"], b["high"], b["low"], b["close"], b["volume"]
    logc = c.log()
    r1 = logc - shift(logc, 1)  # [T] close-to-close log return
    vol = {n: rolling_std(r1, n) for n in (5, 10, 20, 60, 120)}
    v20 = vol[20]
    atr14 = atr(h, low, c, 14)
    bar_range = h - low
    safe_range = torch.where(bar_range > 0, bar_range, torch.full_like(bar_range, math.nan))
    f: dict[str, Tensor] = {}

    z1 = r1 / v20
    for n in RETURN_HORIZONS:
        f[f"ret_{n}"] = (logc - shift(logc, n)) / (v20 * math.sqrt(n))
    for k in LAGS:
        f[f"ret_1_lag{k}"] = shift(z1, k)
    f["gap"] = (o.log() - shift(logc, 1)) / v20
    f["open_to_close"] = (logc - o.log()) / v20

    f["candle_body"] = (c - o) / safe_range
    f["candle_upper_wick"] = (h - torch.maximum(o, c)) / safe_range
    f["candle_lower_wick"] = (torch.minimum(o, c) - low) / safe_range
    f["range_atr"] = bar_range / atr14 - 1.0
    f["true_range_atr"] = true_range(h, low, c) / atr14 - 1.0

    f["vol_5_20"] = (vol[5] / v20).log()
    f["vol_10_20"] = (vol[10] / v20).log()
    f["vol_20_60"] = (v20 / vol[60]).log()
    f["vol_60_120"] = (vol[60] / vol[120]).log()
    f["vol_20_z"] = rolling_zscore(v20.log(), LONG)
    parkinson = (rolling_mean((h / low).log().pow(2), 20) / (4.0 * math.log(2.0))).sqrt()
    f["parkinson_20"] = (parkinson / v20).log()
    f["atr_pct_z"] = rolling_zscore((atr14 / c).log(), LONG)
    f["atr_5_14"] = (atr(h, low, c, 5) / atr14).log()

    for n in (7, 14, 28):
        f[f"rsi_{n}"] = (rsi(c, n) - 50.0) / 25.0
    line, signal_line, hist = macd(c)
    f["macd"] = line / atr14
    f["macd_signal"] = signal_line / atr14
    f["macd_hist"] = hist / atr14
    f["macd_hist_change"] = (hist - shift(hist, 1)) / atr14

    # distances from a trailing average grow like sqrt(window) in a random walk: scale them by it
    smas = {n: sma(c, n) for n in SMA_PERIODS}
    for n in SMA_PERIODS:
        f[f"dist_sma_{n}"] = (c - smas[n]) / (atr14 * 0.5 * math.sqrt(n))
    for n in EMA_PERIODS:
        f[f"dist_ema_{n}"] = (c - ema(c, n)) / (atr14 * 0.5 * math.sqrt(n))
    f["sma_20_slope"] = (smas[20] - shift(smas[20], 5)) / atr14
    f["sma_50_slope"] = (smas[50] - shift(smas[50], 10)) / atr14

    for n in CHANNELS:
        top, bottom = rolling_max(h, n), rolling_min(low, n)
        f[f"channel_{n}"] = (c - bottom) / (top - bottom) - 0.5
    f["dist_high_20"] = (rolling_max(h, 20) - c) / (atr14 * 0.5 * math.sqrt(20))
    f["dist_low_20"] = (c - rolling_min(low, 20)) / (atr14 * 0.5 * math.sqrt(20))
    std20 = rolling_std(c, 20)
    f["bollinger_z"] = (c - smas[20]) / std20
    f["bollinger_width_z"] = rolling_zscore((std20 / smas[20]).log(), LONG)

    f["skew_20"] = rolling(r1, 20, _rolling_skew)
    f["autocorr_20"] = rolling_corr(r1, shift(r1, 1), 20)
    up = (r1 > 0).to(c.dtype)
    f["up_fraction_10"] = rolling_mean(up, 10) - 0.5
    f["up_fraction_20"] = rolling_mean(up, 20) - 0.5
    step_size = (c - shift(c, 1)).abs()
    for n in (10, 30):
        f[f"efficiency_{n}"] = (c - shift(c, n)) / rolling_sum(step_size, n)

    log_volume = v.log1p()
    volume_z20 = rolling_zscore(log_volume, 20)
    f["volume_z_20"] = volume_z20
    f["volume_z_60"] = rolling_zscore(log_volume, 60)
    f["volume_5_20"] = sma(v, 5).log1p() - sma(v, 20).log1p()
    f["volume_change"] = log_volume - shift(log_volume, 1)
    f["signed_volume"] = torch.sign(r1) * volume_z20
    direction = torch.sign(c - shift(c, 1))
    f["obv_10"] = rolling_sum(direction * v, 10) / rolling_sum(v, 10)
    clv = torch.nan_to_num(((c - low) - (h - c)) / safe_range, nan=0.0)
    f["cmf_20"] = rolling_sum(clv * v, 20) / rolling_sum(v, 20)
    typical = (h + low + c) / 3.0
    f["dist_vwap_20"] = (c - rolling_sum(typical * v, 20) / rolling_sum(v, 20)) / atr14

    weekday, month, day_fraction = calendar_fields(b["ns"])
    for name, angle in (
        ("weekday", 2 * math.pi * weekday.to(c.dtype) / 7.0),
        ("month", 2 * math.pi * (month.to(c.dtype) - 1.0) / 12.0),
        ("time_of_day", 2 * math.pi * day_fraction),
    ):
        f[f"{name}_sin"] = angle.sin()
        f[f"{name}_cos"] = angle.cos()

    assert list(f) == FEATURE_NAMES, "feature order drifted from FEATURE_NAMES"
    return f


def compute_features(bars: pd.DataFrame, device=None) -> Tensor:
    """Causal features ``[T, Fm]`` float32 on ``device``: columns named by FEATURE_NAMES, rows < WARMUP 0."""
    f = feature_columns(bars, device)
    if not has_volume(bars):  # no volume column: the volume features are off (0), the width stays Fm
        for name in VOLUME_FEATURES:
            f[name] = torch.zeros_like(f[name])
    first = f[FEATURE_NAMES[0]]
    T = first.shape[0]
    out = torch.empty((T, len(FEATURE_NAMES)), dtype=torch.float32, device=first.device)  # [T, Fm]
    for j, name in enumerate(FEATURE_NAMES):  # one float64 column at a time: no [T, Fm] float64 copy
        # The bars are validated (positive, bounded prices), so a non-finite value is a degenerate window of
        # good bars: NaN is 0/0 (a flat stretch, no history), no information, so 0; +-inf is a ratio whose
        # denominator vanished (log of a zero volatility), so the clip's end of its own sign.
        column = torch.nan_to_num(f.pop(name), nan=0.0, posinf=CLIP, neginf=-CLIP).clamp_(-CLIP, CLIP)
        out[:, j] = column  # float64 -> float32, as the stacked cast did
    out[: min(WARMUP, T)] = 0.0
    return out
