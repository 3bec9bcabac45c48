"""Bars: built-in data sets, a seeded synthetic market, user CSV/Parquet files, and time-ordered splits.

Every source gives the same frame: columns ``timestamp`` (datetime64[ns], naive wall time), ``open``,
``high``, ``low``, ``close``, ``volume`` (float64), one row per bar, strictly increasing timestamps,
``low <= open, close <= high``, ``volume >= 0``. A file that breaks a rule is a :class:`UserError` naming the
column, the row and the fix.

Built-ins: ``sp500`` and ``nasdaq`` are the real daily bars (1999-01-04 .. 2018-12-31, 5,031 each) shipped
with the ``arch`` package; ``synthetic`` is :func:`synthetic_bars`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from fitdqn.errors import UserError

COLUMNS = ("timestamp", "open", "high", "low", "close", "volume")
BUILTIN = ("sp500", "nasdaq", "synthetic")

# Accepted column names (compared lower-case with spaces, '-' and '_' removed), best first.
ALIASES: dict[str, tuple[str, ...]] = {
    "timestamp": (
        "timestamp",
        "datetime",
        "datetimeutc",
        "timestamputc",
        "time",
        "date",
        "ts",
        "dt",
        "bartime",
    ),
    "open": ("open", "o", "openprice", "opening"),
    "high": ("high", "h", "highprice", "max"),
    "low": ("low", "l", "lowprice", "min"),
    "close": ("close", "c", "closeprice", "last", "settle", "closing"),
    "volume": ("volume", "vol", "v", "qty", "quantity", "tickvolume", "totalvolume"),
}
FILE_SUFFIXES = (".csv", ".txt", ".parquet", ".pq")


def _key(name: object) -> str:
    return str(name).strip().lower().replace(" ", "").replace("_", "").replace("-", "")


def _row(i: int) -> str:
    return f"data row {i + 1} (1 = first bar)"


# ---------------------------------------------------------------------------------------------- columns
def _find_columns(frame: pd.DataFrame, source: str) -> dict[str, str | tuple[str, str] | None]:
    """Map canonical names to the frame's columns; ``timestamp`` may be a (date, time) pair or the index."""
    keys: dict[str, str] = {}
    for column in frame.columns:
        keys.setdefault(_key(column), column)
    found: dict[str, str | tuple[str, str] | None] = {}
    for canonical in COLUMNS[1:]:
        match = next((keys[a] for a in ALIASES[canonical] if a in keys), None)
        if match is None:
            raise UserError(
                f"{source}: no '{canonical}' column (accepted, any case: {', '.join(ALIASES[canonical])}); "
                f"columns found: {', '.join(map(str, frame.columns))}; rename the column holding {canonical}"
            )
        found[canonical] = match
    if "date" in keys and "time" in keys and not any(a in keys for a in ALIASES["timestamp"][:4]):
        found["timestamp"] = (keys["date"], keys["time"])  # separate date and time-of-day columns
    else:
        found["timestamp"] = next((keys[a] for a in ALIASES["timestamp"] if a in keys), None)
    if found["timestamp"] is None and not isinstance(frame.index, pd.DatetimeIndex):
        raise UserError(
            f"{source}: no timestamp column (accepted names: {', '.join(ALIASES['timestamp'])}, any case, "
            f"or separate Date and Time columns); columns found: {', '.join(map(str, frame.columns))}; "
            "add a column of bar times"
        )
    return found


def _parse_timestamps(raw: pd.Series, source: str, column: str) -> pd.Series:
    if pd.api.types.is_datetime64_any_dtype(raw):
        stamps = raw
    elif pd.api.types.is_numeric_dtype(raw) and not pd.api.types.is_bool_dtype(raw):
        values = pd.to_numeric(raw)
        top = float(np.nanmax(np.abs(values.to_numpy(dtype="float64")))) if len(values) else 0.0
        unit = "s" if top < 1e11 else "ms" if top < 1e14 else "us" if top < 1e17 else "ns"
        stamps = pd.to_datetime(values, unit=unit, errors="coerce")
    else:
        text = raw.astype("string")
        try:
            stamps = pd.to_datetime(text, errors="coerce", format="mixed")
        except (ValueError, TypeError):
            stamps = pd.to_datetime(text, errors="coerce", utc=True)
        bad = stamps.isna() & raw.notna()
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise UserError(
                f"{source}: column '{column}' {_row(i)}: cannot read {raw.iloc[i]!r} as a time; "
                "write times as ISO dates such as 2020-01-31 or 2020-01-31 09:30:00"
            )
    if getattr(stamps.dt, "tz", None) is not None:
        stamps = stamps.dt.tz_localize(None)  # keep the local wall time (calendar features use it)
    missing = stamps.isna().to_numpy()
    if missing.any():
        i = int(np.flatnonzero(missing)[0])
        raise UserError(
            f"{source}: column '{column}' has a missing time (NaN) at {_row(i)} "
            f"({int(missing.sum())} missing in all); fill it or drop the row"
        )
    return stamps.astype("datetime64[ns]").reset_index(drop=True)


def normalise_bars(frame: pd.DataFrame, source: str = "bars") -> pd.DataFrame:
    """The canonical bar frame from any frame with recognisable OHLCV columns, validated.

    Column names are matched case-insensitively with aliases (``Date``, ``Datetime``, ``Time``, ``Vol`` ...);
    a DatetimeIndex serves as the timestamp when there is no timestamp column; extra columns are ignored.
    """
    found = _find_columns(frame, source)
    stamp_column = found["timestamp"]
    if stamp_column is None:
        stamps = _parse_timestamps(pd.Series(frame.index), source, "index")
        stamp_name = "index"
    elif isinstance(stamp_column, tuple):
        joined = frame[stamp_column[0]].astype("string") + " " + frame[stamp_column[1]].astype("string")
        stamp_name = f"{stamp_column[0]} + {stamp_column[1]}"
        stamps = _parse_timestamps(joined.reset_index(drop=True), source, stamp_name)
    else:
        stamps = _parse_timestamps(frame[stamp_column].reset_index(drop=True), source, str(stamp_column))
        stamp_name = str(stamp_column)
    out = {"timestamp": stamps}
    for canonical in COLUMNS[1:]:
        column = found[canonical]
        raw = frame[column].reset_index(drop=True)
        values = pd.to_numeric(raw, errors="coerce") if not pd.api.types.is_numeric_dtype(raw) else raw
        bad = (values.isna() & raw.notna()).to_numpy()
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise UserError(
                f"{source}: column '{column}' {_row(i)}: {raw.iloc[i]!r} is not a number; "
                "fix the value or drop the row"
            )
        values = values.astype("float64")
        missing = ~np.isfinite(values.to_numpy())
        if missing.any():
            i = int(np.flatnonzero(missing)[0])
            raise UserError(
                f"{source}: column '{column}' has a missing or infinite value (NaN) at {_row(i)} "
                f"(time {stamps.iloc[i]}; {int(missing.sum())} such rows in all); fill the gap or drop the "
                "row"
            )
        out[canonical] = values
    bars = pd.DataFrame(out)
    validate_bars(bars, source, stamp_name)
    return bars


def validate_bars(bars: pd.DataFrame, source: str = "bars", stamp_name: str = "timestamp") -> None:
    """Raise a UserError if a canonical bar frame breaks a rule (order, OHLC consistency, volume sign)."""
    if len(bars) < 2:
        raise UserError(f"{source}: {len(bars)} bar(s); give at least a few hundred bars")
    stamps = bars["timestamp"].to_numpy()
    step_ok = stamps[1:] > stamps[:-1]
    if not step_ok.all():
        i = int(np.flatnonzero(~step_ok)[0]) + 1
        raise UserError(
            f"{source}: timestamps must strictly increase, but column '{stamp_name}' at {_row(i)} "
            f"({stamps[i]}) is not after {_row(i - 1)} ({stamps[i - 1]}); sort the file by time "
            "and drop duplicate bars"
        )
    o, h, low, c, v = (bars[k].to_numpy() for k in ("open", "high", "low", "close", "volume"))
    tol = 1e-9 * np.maximum(np.abs(h), 1.0)
    checks = (
        (h < low - tol, "high {h} is below low {l}"),
        (o > h + tol, "open {o} is above high {h}"),
        (o < low - tol, "open {o} is below low {l}"),
        (c > h + tol, "close {c} is above high {h}"),
        (c < low - tol, "close {c} is below low {l}"),
        (v < 0, "volume {v} is negative"),
    )
    for bad, text in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            message = text.format(o=o[i], h=h[i], l=low[i], c=c[i], v=v[i])
            raise UserError(
                f"{source}: {_row(i)} (time {stamps[i]}): {message} ({int(bad.sum())} such bars in all); "
                "fix or drop the bad bars (every bar needs low <= open, close <= high and volume >= 0)"
            )
    if not (np.all(np.abs(o) > 0) and np.all(c > 0)):
        raise UserError(f"{source}: prices must be positive; check the price columns and their units")


# ---------------------------------------------------------------------------------------------- sources
def read_bars_file(path: str | Path) -> pd.DataFrame:
    """Bars from a CSV (``.csv``/``.txt``) or Parquet (``.parquet``/``.pq``) file, validated."""
    path = Path(path)
    source = f"bars file '{path}'"
    if not path.is_file():
        raise UserError(
            f"market.data: file '{path}' not found; give a CSV/Parquet path or one of {', '.join(BUILTIN)}"
        )
    suffix = path.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            frame = pd.read_parquet(path)
        elif suffix in (".csv", ".txt"):
            frame = pd.read_csv(path, sep=None, engine="python") if suffix == ".txt" else pd.read_csv(path)
        else:
            raise UserError(
                f"{source}: unsupported file type '{suffix}'; save the bars as CSV (.csv) or Parquet "
                "(.parquet)"
            )
    except UserError:
        raise
    except Exception as error:  # the reader's own message says what is wrong with the bytes
        raise UserError(
            f"{source}: cannot be read ({type(error).__name__}: {error}); check the file"
        ) from None
    if frame.empty:
        raise UserError(f"{source}: no rows; give a file with one bar per row")
    return normalise_bars(frame, source)


def builtin_bars(name: str) -> pd.DataFrame:
    """The real daily bars shipped with ``arch``: ``'sp500'`` or ``'nasdaq'`` (5,031 bars, 1999-2018)."""
    if name == "sp500":
        from arch.data import sp500 as module
    elif name == "nasdaq":
        from arch.data import nasdaq as module
    else:
        raise UserError(f"unknown built-in data '{name}'; use one of {', '.join(BUILTIN)}")
    frame = module.load()  # Date index; Open, High, Low, Close, Adj Close, Volume
    return normalise_bars(frame, f"built-in '{name}'")


def synthetic_bars(num_bars: int = 6000, signal: float = 0.3, seed: int = 0) -> pd.DataFrame:
    """A seeded synthetic daily market with a planted predictable component (business-day timestamps from
    2000-01-03; one-minute timestamps beyond 60,000 bars).

    Realism: two volatility regimes (calm ~0.7 %/bar, stressed ~1.8 %/bar, persistent Markov switching) times
    a slow log-normal volatility wander; overnight gaps with rare jumps (~1 % of bars, 4 sigma); intrabar
    wicks; volume that rises with volatility and with the size of the move, with its own persistence.

    The planted component: the open-to-close log return of bar t has mean
    ``signal * sigma_t * clip(z_{t-1}, -3, 3)``, where ``z_{t-1}`` is the previous bar's close-to-close log
    return in units of its volatility (the agent sees it as the ``ret_1`` feature, and the previous bars in
    its window). ``signal = 0`` is an unpredictable market; 0.3 gives a momentum edge that a policy following
    the last bar's direction turns into a test Sharpe well above 1 after costs.
    """
    if num_bars < 2:
        raise UserError("market.synthetic_bars must be at least 2 (a few thousand is typical)")
    rng = np.random.default_rng(seed)
    n = int(num_bars)
    # volatility regimes (Markov) x slow log-normal wander (AR(1) in log space)
    regime = np.zeros(n, dtype=np.int64)
    switch = rng.random(n)
    for t in range(1, n):
        stay = 0.99 if regime[t - 1] == 0 else 0.96
        regime[t] = regime[t - 1] if switch[t] < stay else 1 - regime[t - 1]
    wander = np.zeros(n)
    shocks = rng.normal(0.0, 0.08, n)
    for t in range(1, n):
        wander[t] = 0.98 * wander[t - 1] + shocks[t]
    sigma = np.where(regime == 0, 0.007, 0.018) * np.exp(wander)
    eps = rng.normal(0.0, 1.0, n)
    gap_noise = rng.normal(0.0, 0.15, n)
    jumps = (rng.random(n) < 0.01) * rng.normal(0.0, 4.0, n)
    wick_up = np.abs(rng.normal(0.0, 0.4, n))
    wick_down = np.abs(rng.normal(0.0, 0.4, n))
    vol_noise = rng.normal(0.0, 0.25, n)

    log_open = np.zeros(n)
    log_close = np.zeros(n)
    log_close_prev = math.log(2000.0)
    z_prev = 0.0
    drift = 0.01  # a small upward drift in sigma units (buy-and-hold earns a little)
    for t in range(n):
        s = sigma[t]
        log_open[t] = log_close_prev + s * (gap_noise[t] + jumps[t])
        mean = s * (drift + signal * min(max(z_prev, -3.0), 3.0))
        log_close[t] = log_open[t] + mean + s * eps[t]
        z_prev = (log_close[t] - log_close_prev) / s
        log_close_prev = log_close[t]
    open_ = np.exp(log_open)
    close = np.exp(log_close)
    high = np.maximum(open_, close) * np.exp(sigma * wick_up)
    low = np.minimum(open_, close) * np.exp(-sigma * wick_down)
    open_, high, low, close = (np.round(x, 2) for x in (open_, high, low, close))
    high = np.maximum(high, np.maximum(open_, close))
    low = np.minimum(low, np.minimum(open_, close))
    move = np.abs(log_close - np.concatenate([[log_close[0]], log_close[:-1]])) / sigma
    log_volume = np.zeros(n)
    level = 0.0
    for t in range(n):
        level = 0.9 * level + vol_noise[t]
        log_volume[t] = math.log(2e6) + 0.8 * math.log(sigma[t] / 0.01) + 0.15 * min(move[t], 5.0) + level
    volume = np.round(np.exp(log_volume))
    if n <= 60_000:  # business days (60,000 of them end in 2229, inside datetime64[ns])
        stamps = pd.bdate_range("2000-01-03", periods=n).as_unit("ns")
    else:  # more bars than business days fit: one-minute bars
        stamps = pd.date_range("2000-01-03", periods=n, freq="min").as_unit("ns")
    bars = pd.DataFrame(
        {"timestamp": stamps, "open": open_, "high": high, "low": low, "close": close, "volume": volume}
    )
    validate_bars(bars, "synthetic bars")
    return bars


def load_bars(
    data: str, *, synthetic_bars_count: int = 6000, synthetic_signal: float = 0.3, seed: int = 0
) -> pd.DataFrame:
    """Bars for ``market.data``: a built-in name or a CSV/Parquet path."""
    if data in ("sp500", "nasdaq"):
        return builtin_bars(data)
    if data == "synthetic":
        return synthetic_bars(synthetic_bars_count, synthetic_signal, seed)
    path = Path(data)
    if path.suffix.lower() not in FILE_SUFFIXES and not path.exists():
        raise UserError(
            f"market.data: '{data}' is neither a built-in data set ({', '.join(BUILTIN)}) nor a CSV/Parquet "
            "file path; give one of those"
        )
    return read_bars_file(path)


def bars_from_config(market) -> pd.DataFrame:
    """Bars for a :class:`fitdqn.config.MarketConfig`."""
    return load_bars(
        market.data,
        synthetic_bars_count=market.synthetic_bars,
        synthetic_signal=market.synthetic_signal,
        seed=market.seed,
    )


# ---------------------------------------------------------------------------------------------- splits
@dataclass(frozen=True)
class Split:
    """Bars ``[start, stop)`` of the full series. Features are computed on the whole series (they are causal),
    so a later split's first bars see the history before it."""

    name: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def split_bars(num_bars: int, train_fraction: float, validation_fraction: float) -> dict[str, Split]:
    """Time-ordered ``train``, ``validation``, ``test`` splits (the test split is the rest)."""
    if not (0 < train_fraction and 0 < validation_fraction and train_fraction + validation_fraction < 1):
        raise UserError(
            "market.train_fraction and market.validation_fraction must be positive with a sum below 1"
        )
    train_stop = int(round(num_bars * train_fraction))
    validation_stop = int(round(num_bars * (train_fraction + validation_fraction)))
    return {
        "train": Split("train", 0, train_stop),
        "validation": Split("validation", train_stop, validation_stop),
        "test": Split("test", validation_stop, num_bars),
    }


def walk_forward(
    num_bars: int,
    folds: int,
    validation_bars: int,
    *,
    end: int | None = None,
    train_bars: int | None = None,
) -> Iterator[tuple[Split, Split]]:
    """Successive ``(train, validation)`` ranges: ``folds`` back-to-back validation blocks of
    ``validation_bars`` ending at ``end`` (default: all bars; pass the test split's start to keep the test
    split untouched), each trained on the bars before it: all of them (anchored, ``train_bars=None``) or the
    last ``train_bars`` (rolling)."""
    end = num_bars if end is None else end
    first = end - folds * validation_bars
    if folds < 1 or validation_bars < 1 or first <= 0 or end > num_bars:
        raise UserError(
            f"walk-forward: {folds} folds of {validation_bars} validation bars do not fit before bar {end} "
            f"of {num_bars}; use fewer folds or shorter validation blocks"
        )
    for k in range(folds):
        v_start = first + k * validation_bars
        t_start = 0 if train_bars is None else max(0, v_start - train_bars)
        yield (
            Split(f"train_{k}", t_start, v_start),
            Split(f"validation_{k}", v_start, v_start + validation_bars),
        )


def walk_forward_from_config(market, num_bars: int, folds: int) -> Iterator[tuple[Split, Split]]:
    """Walk-forward folds over the train + validation part of a MarketConfig's split (test kept out); each
    validation block is ``validation_fraction / folds`` of the bars."""
    splits = split_bars(num_bars, market.train_fraction, market.validation_fraction)
    block = max(1, len(splits["validation"]) // folds)
    return walk_forward(num_bars, folds, block, end=splits["validation"].stop)
