"""Bars: built-in data sets, a seeded synthetic market and user CSV/Parquet files.

Every source gives the same frame: columns ``timestamp`` (datetime64[ns], naive wall time), ``open``,
``high``, ``low``, ``close``, ``volume`` (float64), one row per bar, strictly increasing timestamps,
``0 < low <= open, close <= high``, prices inside ``[PRICE_MIN, PRICE_MAX]``, ``volume >= 0``. A file that
breaks a rule is a :class:`UserError` naming the column, the row, the bar's time and the fix.

Time: text timestamps are read year-first (ISO), or day-first / month-first as the values show
(``market.date_format`` names the order or a pattern where the values cannot). Times are kept as the file
writes them, as wall-clock time: a UTC offset or zone is dropped, never converted, so an exchange file keeps its
local session times across a daylight-saving change (09:30 stays 09:30 whether the offset is -05:00 or -04:00).
Epoch numbers are UTC. A file whose times carry an offset on some rows and none on others is refused.

No volume column: volume is 0 on every bar, ``bars.attrs["volume_column"]`` is None and the volume features
are off (:func:`fitdqn.market.features.has_volume`).

Splits (train / validation / test, walk-forward folds) are :mod:`fitdqn.market.splits`.

Built-ins: ``sp500`` and ``nasdaq`` are real daily bars (1999-01-04 .. 2018-12-31, 5,031 each) shipped as
package data in ``fitdqn/market/datasets/`` (copies of the ``arch`` package's data sets: see the README
there); ``synthetic`` is :func:`synthetic_bars`.
"""

from __future__ import annotations

import math
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pandas.tseries.api import guess_datetime_format

from fitdqn.config import SYNTHETIC_DATA
from fitdqn.errors import UserError

COLUMNS = ("timestamp", "open", "high", "low", "close", "volume")
PRICE_COLUMNS = ("open", "high", "low", "close")
BUILTIN = ("sp500", "nasdaq", SYNTHETIC_DATA)
DATASETS_PACKAGE = "fitdqn.market"
DATASETS_DIR = "datasets"
BUILTIN_FILES = {"sp500": "sp500.csv.gz", "nasdaq": "nasdaq.csv.gz"}
BUILTIN_DATE_FORMAT = "%m/%d/%Y"  # the shipped files' Date column (1/4/1999 = 4 January 1999)

# The range of prices fitdqn trades. The env keeps prices, P&L and rewards in float32 (largest 3.4e38) and the
# losses square them; features are float64 and square prices (rolling variances). 1e15 leaves room for a
# contract multiplier, the position and those squares; 1e-12 keeps prices far above float32's subnormals.
PRICE_MAX = 1e15
PRICE_MIN = 1e-12
VOLUME_MAX = 1e30  # volume x price sums stay finite in float64

# market.date_format values that name an order rather than a strptime pattern
DATE_ORDERS = ("auto", "day-first", "month-first")

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

# A UTC offset or zone after a time of day: '09:30:00-05:00', '09:30Z', '09:30:00.000 +0100', '09:30 UTC'
# (RE2 syntax: pyarrow runs these over the whole column).
_ZONE = r"(?i)^(?P<wall>.*\d:\d\d(?::\d\d(?:[.,]\d+)?)?)\s*(?P<zone>Z|UTC|GMT|[+-]\d\d(?::?\d\d)?)$"
_ZONE_END = r"(?i)(?:Z|UTC|GMT|[+-]\d\d(?::?\d\d)?)$"  # cheap pre-check of _ZONE
# A zone name after a time of day ('09:30 EST', '09:30:00 America/New_York'): refused by name (Python re)
_ZONE_NAME = r"\d:\d\d(?::\d\d(?:[.,]\d+)?)?\s*(?P<zone>[A-Za-z][A-Za-z_]*(?:/[A-Za-z_+-]+)*)$"
# The first two numbers of a date written day/month/year or month/day/year (any of . / - between them).
_DAY_MONTH = r"^\s*(?P<first>\d{1,2})[./-](?P<second>\d{1,2})[./-]\d{2,4}(?:\D|$)"
_DATE_FORMAT_HELP = (
    "set market.date_format to 'day-first', 'month-first' or the file's pattern (for example "
    "--market.date_format '%d.%m.%Y %H:%M:%S.%f')"
)


def _key(name: object) -> str:
    return str(name).strip().lower().replace(" ", "").replace("_", "").replace("-", "")


def _row(i: int) -> str:
    return f"data row {i + 1} (1 = first bar)"


def _when(stamp) -> str:
    return str(pd.Timestamp(stamp))  # 2017-01-06 03:00:00, not numpy's 2017-01-06T03:00:00.000000000


# ---------------------------------------------------------------------------------------------- columns
def _find_columns(frame: pd.DataFrame, source: str) -> dict[str, str | tuple[str, str] | None]:
    """Map canonical names to the frame's columns; ``timestamp`` may be a (date, time) pair or the index
    (None), ``volume`` None when the file has none."""
    keys: dict[str, str] = {}
    for column in frame.columns:
        keys.setdefault(_key(column), column)
    found: dict[str, str | tuple[str, str] | None] = {}
    for canonical in COLUMNS[1:]:
        match = next((keys[a] for a in ALIASES[canonical] if a in keys), None)
        if match is None and canonical != "volume":
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


# ---------------------------------------------------------------------------------------------- time
def check_date_format(date_format: str) -> None:
    """UserError unless ``market.date_format`` is an order name or a strptime pattern."""
    if date_format not in DATE_ORDERS and "%" not in date_format:
        raise UserError(
            f"market.date_format = {date_format!r} is neither one of {', '.join(DATE_ORDERS)} nor a strptime "
            "pattern; give for example 'day-first' or '%d.%m.%Y %H:%M'"
        )


def _arrow(text: pd.Series) -> pa.Array:
    return pa.array(text.astype("string[pyarrow]").array)


def _extract(text: pd.Series, pattern: str) -> pd.DataFrame:
    """``text.str.extract(pattern)``: one column per named group, NaN where a value does not match; run by
    pyarrow's RE2 over the whole column (pandas' own extract costs ~10 us a row)."""
    groups = pc.extract_regex(_arrow(text), pattern)  # struct array, null where no match
    columns = {groups.type.field(k).name: pc.struct_field(groups, k).to_pandas() for k in range(groups.type.num_fields)}
    return pd.DataFrame(columns).set_axis(text.index)


def _strip_zones(text: pd.Series, source: str, column: str) -> tuple[pd.Series, bool]:
    """Wall-clock times without their UTC offsets (the local-time rule), and whether any row had one."""
    if not pc.any(pc.match_substring_regex(_arrow(text), _ZONE_END)).as_py():
        return text, False  # fast path: no value ends like an offset
    parts = _extract(text, _ZONE)  # [N, 2]: wall, zone (NaN where no offset)
    zoned = parts["zone"].notna().to_numpy()
    naive = ~zoned & text.notna().to_numpy()  # a missing time is neither (it is refused later)
    if not zoned.any():
        return text, False
    if naive.any():
        with_zone, without = int(np.flatnonzero(zoned)[0]), int(np.flatnonzero(naive)[0])
        raise UserError(
            f"{source}: column '{column}' mixes times with a UTC offset ({_row(with_zone)}: "
            f"{text.iloc[with_zone]!r}) and times without one ({_row(without)}: {text.iloc[without]!r}), so "
            "they cannot be put on one clock; give every time with its offset, or none"
        )
    return parts["wall"], True


def _day_first(wall: pd.Series, source: str, column: str, date_format: str) -> tuple[bool | None, str]:
    """Whether to read numeric dates day-first, from ``market.date_format`` or (auto) from the values:
    ``(flag, how)``; ``flag`` None when both orders fit every value (the caller tries both)."""
    if date_format == "day-first":
        return True, "day-first (market.date_format)"
    if date_format == "month-first":
        return False, "month-first (market.date_format)"
    present = wall.dropna()
    if present.empty or not re.match(_DAY_MONTH, str(present.iloc[0])):  # year-first (ISO) or written out
        return False, ""
    fields = _extract(wall, _DAY_MONTH)[wall.notna()]  # [N, 2] first and second number, NaN when not d/m/y
    if fields["first"].isna().any():  # some rows are not d/m/y: one order cannot be chosen from them
        return False, ""
    first, second = fields["first"].astype(int).to_numpy(), fields["second"].astype(int).to_numpy()
    rows = np.arange(len(wall))[wall.notna().to_numpy()]  # positions of the present values
    day_first_rows, month_first_rows = rows[first > 12], rows[second > 12]
    if len(day_first_rows) and len(month_first_rows):
        i, j = int(day_first_rows[0]), int(month_first_rows[0])
        raise UserError(
            f"{source}: column '{column}' has dates that only read day-first ({_row(i)}: {wall.iloc[i]!r}) and "
            f"dates that only read month-first ({_row(j)}: {wall.iloc[j]!r}); fix the file so every date is "
            f"written one way, or {_DATE_FORMAT_HELP}"
        )
    if len(day_first_rows):
        return True, f"day-first (a first field above 12 at {_row(int(day_first_rows[0]))})"
    if len(month_first_rows):
        return False, f"month-first (a second field above 12 at {_row(int(month_first_rows[0]))})"
    return None, ""


def _read_wall(wall: pd.Series, date_format: str, day_first: bool) -> pd.Series:
    """Text wall-clock times -> datetimes (NaT where a value does not parse)."""
    if date_format not in DATE_ORDERS:
        try:
            return pd.to_datetime(wall, format=date_format, errors="coerce")
        except ValueError as error:
            raise UserError(f"market.date_format {date_format!r}: {error}; {_DATE_FORMAT_HELP}") from None
    first = wall.dropna().iloc[0] if wall.notna().any() else ""
    pattern = guess_datetime_format(str(first).strip(), dayfirst=day_first)
    stamps = pd.to_datetime(wall, format=pattern, errors="coerce") if pattern else None
    if stamps is None or (stamps.isna() & wall.notna()).any():  # one pattern does not fit every row
        stamps = pd.to_datetime(wall, format="mixed", dayfirst=day_first, errors="coerce")
    return stamps


def _increasing(stamps: pd.Series) -> bool:
    values = stamps.to_numpy()
    return bool((values[1:] > values[:-1]).all()) and not stamps.isna().any()


def _parse_text_timestamps(raw: pd.Series, source: str, column: str, date_format: str) -> tuple[pd.Series, str]:
    text = raw.astype("string").str.strip()
    wall, zoned = _strip_zones(text, source, column)
    if date_format not in DATE_ORDERS:  # the user's strptime pattern
        day_first, how = False, ""
    else:
        day_first, how = _day_first(wall, source, column, date_format)
    if day_first is None:  # every date reads both ways: keep the order that gives increasing times
        by_day, by_month = _read_wall(wall, date_format, True), _read_wall(wall, date_format, False)
        fits = [flag for flag, stamps in ((True, by_day), (False, by_month)) if _increasing(stamps)]
        if len(fits) == 2 and not by_day.equals(by_month):
            raise UserError(
                f"{source}: column '{column}': dates such as {wall.iloc[0]!r} read both day-first and "
                f"month-first, and both give increasing times; {_DATE_FORMAT_HELP}"
            )
        day_first = fits[0] if fits else False
        how = "day-first (the order that gives increasing times)" if day_first else (
            "month-first (the order that gives increasing times)" if fits else
            "month-first (both orders fit every value; neither gives increasing times)"
        )
        stamps = by_day if day_first else by_month
    else:
        stamps = _read_wall(wall, date_format, day_first)
    bad = stamps.isna() & raw.notna()
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        named = re.search(_ZONE_NAME, str(raw.iloc[i]).strip())
        if named and named.group("zone").upper() not in ("AM", "PM"):
            raise UserError(
                f"{source}: column '{column}' {_row(i)}: {raw.iloc[i]!r} ends in the time-zone name "
                f"{named.group('zone')!r}, which fitdqn does not read (a name's offset changes with daylight saving "
                "and abbreviations are ambiguous); times are kept as wall-clock times, so drop the zone names from "
                "the column, or write UTC offsets such as 09:30:00-05:00"
            )
        fix = (
            f"the value does not match market.date_format {date_format!r}; fix the value or the pattern"
            if date_format not in DATE_ORDERS
            else f"write times as ISO dates such as 2020-01-31 or 2020-01-31 09:30:00, or {_DATE_FORMAT_HELP}"
        )
        raise UserError(f"{source}: column '{column}' {_row(i)}: cannot read {raw.iloc[i]!r} as a time; {fix}")
    notes = []
    if how:
        notes.append(f"dates were read {how}; if that is wrong {_DATE_FORMAT_HELP}")
    if zoned:
        notes.append(
            "the times carry UTC offsets: their wall-clock (local) times are kept, so where the clocks go back "
            "for daylight saving an hour of bars repeats; drop or merge the repeated bars"
        )
    return stamps, "; ".join(notes)


# Whole numbers that are dates written as digits (20170113, 201701130930, 20170113093000), not epoch counts
# (as epoch seconds or milliseconds they would all fall in 1970-1976).
_DIGIT_DATES = (
    (19000101, 21001231, "%Y%m%d"),
    (190001010000, 210012312359, "%Y%m%d%H%M"),
    (19000101000000, 21001231235959, "%Y%m%d%H%M%S"),
)


def _digit_dates(raw: pd.Series) -> pd.Series | None:
    """Datetimes from a numeric column of YYYYMMDD[HHMM[SS]] numbers, or None when it is not one."""
    values = raw.to_numpy(dtype="float64")
    present = values[np.isfinite(values)]
    if not len(present) or not np.all(present == np.round(present)):
        return None
    for low, high, pattern in _DIGIT_DATES:
        if np.all((present >= low) & (present <= high)):
            text = pd.Series(np.where(np.isfinite(values), values, 0).astype(np.int64)).astype("string")
            stamps = pd.to_datetime(text.where(np.isfinite(values)), format=pattern, errors="coerce")
            if not (stamps.isna() & np.isfinite(values)).any():
                return stamps
    return None


def _parse_timestamps(raw: pd.Series, source: str, column: str, date_format: str) -> tuple[pd.Series, str]:
    """Datetimes (naive wall time, ns) from a column, and a note on how text was read (for order errors)."""
    check_date_format(date_format)
    hint = ""
    if pd.api.types.is_datetime64_any_dtype(raw):
        stamps = raw
    elif pd.api.types.is_numeric_dtype(raw) and not pd.api.types.is_bool_dtype(raw):
        stamps = _digit_dates(raw)
        if stamps is None:
            values = pd.to_numeric(raw)
            top = float(np.nanmax(np.abs(values.to_numpy(dtype="float64")))) if len(values) else 0.0
            unit = "s" if top < 1e11 else "ms" if top < 1e14 else "us" if top < 1e17 else "ns"
            stamps = pd.to_datetime(values, unit=unit, errors="coerce")  # epoch numbers: UTC
    else:
        stamps, hint = _parse_text_timestamps(raw, source, column, date_format)
    if getattr(stamps.dt, "tz", None) is not None:
        stamps = stamps.dt.tz_localize(None)  # keep the local wall time (calendar features use it)
    missing = stamps.isna().to_numpy()
    if missing.any():
        i = int(np.flatnonzero(missing)[0])
        raise UserError(
            f"{source}: column '{column}' has a missing time (NaN) at {_row(i)} "
            f"({int(missing.sum())} missing in all); fill it or drop the row"
        )
    return stamps.astype("datetime64[ns]").reset_index(drop=True), hint


def normalise_bars(frame: pd.DataFrame, source: str = "bars", *, date_format: str) -> pd.DataFrame:
    """The canonical bar frame from any frame with recognisable OHLCV columns, validated.

    Column names are matched case-insensitively with aliases (``Date``, ``Datetime``, ``Time``, ``Vol`` ...);
    a DatetimeIndex serves as the timestamp when there is no timestamp column; extra columns are ignored; a
    missing volume column gives volume 0 (``attrs["volume_column"]`` None). ``date_format`` is
    ``market.date_format`` ('auto' infers the order of text dates).
    """
    found = _find_columns(frame, source)
    stamp_column = found["timestamp"]
    if stamp_column is None:
        stamp_name = "index"
        stamps, hint = _parse_timestamps(pd.Series(frame.index), source, stamp_name, date_format)
    elif isinstance(stamp_column, tuple):
        joined = frame[stamp_column[0]].astype("string") + " " + frame[stamp_column[1]].astype("string")
        stamp_name = f"{stamp_column[0]} + {stamp_column[1]}"
        stamps, hint = _parse_timestamps(joined.reset_index(drop=True), source, stamp_name, date_format)
    else:
        stamp_name = str(stamp_column)
        stamps, hint = _parse_timestamps(frame[stamp_column].reset_index(drop=True), source, stamp_name, date_format)
    out = {"timestamp": stamps}
    names = {"timestamp": stamp_name}
    for canonical in COLUMNS[1:]:
        column = found[canonical]
        if column is None:  # no volume column: volume 0, volume features off
            out[canonical] = pd.Series(np.zeros(len(stamps)), dtype="float64")
            names[canonical] = "volume (no such column: 0)"
            continue
        names[canonical] = str(column)
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
    validate_bars(bars, source, names=names, hint=hint)
    check_gaps(bars["timestamp"], source)
    bars.attrs["volume_column"] = None if found["volume"] is None else str(found["volume"])
    return bars


def validate_bars(
    bars: pd.DataFrame, source: str = "bars", *, names: dict[str, str] | None = None, hint: str = ""
) -> None:
    """Raise a UserError if a canonical bar frame breaks a rule: time order, positive prices inside
    ``[PRICE_MIN, PRICE_MAX]``, OHLC consistency, volume sign and size. ``names`` maps canonical columns to the
    file's own names (for the message); ``hint`` says how the times were read (added to an order error)."""
    names = {k: names.get(k, k) for k in COLUMNS} if names else {k: k for k in COLUMNS}
    if len(bars) < 2:
        raise UserError(f"{source}: {len(bars)} bar(s); give at least a few hundred bars")
    stamps = bars["timestamp"].to_numpy()
    step_ok = stamps[1:] > stamps[:-1]
    if not step_ok.all():
        i = int(np.flatnonzero(~step_ok)[0]) + 1
        raise UserError(
            f"{source}: timestamps must strictly increase, but column '{names['timestamp']}' at {_row(i)} "
            f"({_when(stamps[i])}) is not after {_row(i - 1)} ({_when(stamps[i - 1])}); sort the file by time "
            "and drop duplicate bars" + (f" ({hint})" if hint else "")
        )
    prices = bars[list(PRICE_COLUMNS)].to_numpy(dtype=np.float64)  # [T, 4] open, high, low, close
    rules = (
        (~(prices > 0), "{value!r} is not positive: prices must be positive", "check the price column and its "
         "units, and fix or drop the bar"),
        (prices < PRICE_MIN, f"{{value!r}} is below {PRICE_MIN:g}, the smallest price fitdqn trades",
         "quote the prices in a smaller unit (multiply them by a power of ten)"),
        (prices > PRICE_MAX, f"{{value!r}} is beyond {PRICE_MAX:g}, the largest price fitdqn trades (prices, P&L "
         "and rewards are float32 on the device and would overflow)",
         "quote the prices in a larger unit (divide them by a power of ten) or fix the bad bars"),
    )
    for bad, text, fix in rules:
        if bad.any():
            i, k = (int(x) for x in np.argwhere(bad)[0])
            column = names[PRICE_COLUMNS[k]]
            raise UserError(
                f"{source}: column '{column}' at {_row(i)} (time {_when(stamps[i])}): "
                + text.format(value=float(prices[i, k]))
                + f" ({int(bad.any(axis=1).sum())} such bars in all); {fix}"
            )
    o, h, low, c, v = (bars[k].to_numpy() for k in ("open", "high", "low", "close", "volume"))
    tol = 1e-9 * np.maximum(np.abs(h), 1.0)
    checks = (
        (h < low - tol, "high {h} is below low {l}"),
        (o > h + tol, "open {o} is above high {h}"),
        (o < low - tol, "open {o} is below low {l}"),
        (c > h + tol, "close {c} is above high {h}"),
        (c < low - tol, "close {c} is below low {l}"),
        (~np.isfinite(v), "volume {v} is not a finite number"),
        (v < 0, "volume {v} is negative"),
        (v > VOLUME_MAX, f"volume {{v}} is beyond {VOLUME_MAX:g}"),
    )
    for bad, text in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            message = text.format(o=o[i], h=h[i], l=low[i], c=c[i], v=v[i])
            raise UserError(
                f"{source}: {_row(i)} (time {_when(stamps[i])}): {message} ({int(bad.sum())} such bars in all); "
                "fix or drop the bad bars (every bar needs low <= open, close <= high and volume >= 0)"
            )


# A gap between two bars far beyond the data's own calendar: longer than GAP_STEPS typical (median) steps and
# than GAP_FLOOR (a weekend, holidays, a closed week stay far below both). Such a file is refused at load, never
# split: fitdqn trains on one continuous series, and the features, the episodes and the bars-per-year calendar
# would run across the gap.
GAP_STEPS = 100
GAP_FLOOR = pd.Timedelta(days=31)


def check_gaps(stamps: pd.Series, source: str) -> None:
    """UserError naming the longest gap when it is far beyond the bars' own spacing (``GAP_STEPS`` median
    steps and ``GAP_FLOOR``), with the rows on either side and what to do."""
    values = stamps.to_numpy()
    if len(values) < 3:
        return
    steps = np.diff(values)  # [T-1] timedelta64
    typical = pd.Timedelta(np.median(steps))
    i = int(np.argmax(steps))
    gap = pd.Timedelta(steps[i])
    if gap <= max(GAP_STEPS * typical, GAP_FLOOR):
        return
    raise UserError(
        f"{source}: a gap of {gap_text(gap)} between {_row(i)}, {_when(values[i])}, and data row {i + 2}, "
        f"{_when(values[i + 1])}, where the bars are {gap_text(typical)} apart (median): fitdqn trains on one "
        f"continuous series, and its features, episodes and calendar would run across the gap; keep the bars on "
        f"one side of it (the {len(values) - i - 1} bars after it, or the {i + 1} before) in a file of their own"
    )


def gap_text(span: pd.Timedelta) -> str:
    """A span in the largest unit that fits: '12.5 years', '3 days', '1 day', '5 minutes'."""
    seconds = span.total_seconds()
    for unit, length in (("year", DAYS_PER_YEAR * 86400), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= length:
            value = seconds / length
            return f"{value:.3g} {unit}" + ("" if value == 1 else "s")
    return f"{seconds:.3g} seconds"


# ---------------------------------------------------------------------------------------------- sources
def read_bars_file(path: str | Path, *, date_format: str) -> pd.DataFrame:
    """Bars from a CSV (``.csv``/``.txt``) or Parquet (``.parquet``/``.pq``) file, validated; ``date_format``
    is ``market.date_format``."""
    path = Path(path)
    source = f"bars file '{path}'"
    if not path.is_file():
        raise UserError(
            f"market.data: file '{path}' not found; give a CSV/Parquet path or one of {', '.join(BUILTIN)}"
        )
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        check_parquet_file(path, source)
    elif suffix in (".csv", ".txt"):
        check_text_file(path, source)
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
    return normalise_bars(frame, source, date_format=date_format)


SNIFF_BYTES = 64 * 1024  # the start of a text file checked for binary content before it is parsed
SCAN_BYTES = 1024 * 1024  # the chunk a text file is scanned in for NUL bytes (memory stays at this)
CONTROL_BYTES = bytes(set(range(32)) - set(b"\t\n\r\f\v\x1a"))  # never in text rows (0x1a: an old end-of-file mark)
PARQUET_MAGIC = b"PAR1"  # at the start and the end of every Parquet file


def check_text_file(path: Path, source: str) -> None:
    """Refuse a CSV/text file that is not text rows before it is parsed whole: a control byte or bytes that are
    not UTF-8 near its start (a binary file), or NUL bytes anywhere (a damaged or zero-filled file). The file
    is scanned in ``SCAN_BYTES`` chunks, so memory stays bounded whatever its size; the message names the row,
    the byte offset and what was found there."""
    rows, offset = 0, 0
    try:
        with open(path, "rb") as file:
            head = file.read(SNIFF_BYTES)
            check_text_start(head, source)
            chunk = head
            while chunk:
                nul = chunk.find(b"\0")
                if nul >= 0:
                    row = rows + chunk.count(b"\n", 0, nul) + 1
                    if utf16_like(head):
                        raise UserError(f"{source}: UTF-16 text (every other byte is 0x00): save the file as UTF-8 "
                                        "CSV")
                    raise UserError(
                        f"{source}: line {row} (byte {offset + nul:,}) holds NUL bytes (0x00), not text: the file "
                        "is damaged or was never fully written (a disk or copy that failed); "
                        + ("it holds no text rows at all; " if offset + nul == 0 else
                           f"the {row - 1} line(s) before it may be whole: keep those (e.g. head -n {row - 1}); ")
                        + "give the bars as a CSV of text rows")
                rows += chunk.count(b"\n")
                offset += len(chunk)
                chunk = file.read(SCAN_BYTES)
    except OSError as error:
        raise UserError(f"{source}: cannot be read ({error.strerror or error}); check the file") from None


def utf16_like(head: bytes) -> bool:
    """Text saved as UTF-16 without a byte-order mark: ASCII letters with a 0x00 between each two."""
    sample = head[:1024]
    even, odd = sample[0::2], sample[1::2]
    zeros = (even.count(0), odd.count(0))
    return len(sample) >= 8 and ((zeros[1] > 0.9 * len(odd) and zeros[0] == 0)
                                 or (zeros[0] > 0.9 * len(even) and zeros[1] == 0))


def check_text_start(head: bytes, source: str) -> None:
    """UserError when the first bytes of a text file are binary: a known binary format, control bytes, or not
    UTF-8."""
    if binary_kind(head):
        raise UserError(f"{source}: this is a binary file, not CSV text{binary_kind(head)}; give the bars as a CSV "
                        "of text rows or as Parquet (.parquet)")
    control = next((i for i, byte in enumerate(head) if byte in CONTROL_BYTES and byte != 0), None)
    if control is not None:
        row = head.count(b"\n", 0, control) + 1
        raise UserError(f"{source}: line {row} (byte {control:,}) holds the control byte 0x{head[control]:02x}: "
                        f"this is a binary file, not CSV text{binary_kind(head)}; give the bars as a CSV of text rows "
                        "or as Parquet (.parquet)")
    text = head[: len(head) - 3] if len(head) == SNIFF_BYTES else head  # a character may be cut at the chunk's end
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as error:
        row = head.count(b"\n", 0, error.start) + 1
        raise UserError(f"{source}: line {row} (byte {error.start:,}) holds 0x{head[error.start]:02x}, which is "
                        f"not UTF-8 text{binary_kind(head)}; save the file as UTF-8 CSV (or give Parquet)") from None


BINARY_KINDS = ((b"PK\x03\x04", "a zip archive (an Excel .xlsx, a torch checkpoint?)"), (b"\x1f\x8b", "gzip data"),
                (PARQUET_MAGIC, "a Parquet file: name it .parquet"), (b"\x89PNG", "a PNG image"),
                (b"\xd0\xcf\x11\xe0", "an old Excel .xls / Office file"), (b"\x7fELF", "a program"))


def binary_kind(head: bytes) -> str:
    """' (it starts like ...)' for a few well-known binary formats, else ''."""
    kind = next((what for magic, what in BINARY_KINDS if head.startswith(magic)), None)
    return f" (it starts like {kind})" if kind else ""


def check_parquet_file(path: Path, source: str) -> None:
    """UserError unless the file starts and ends with Parquet's magic bytes (read: 8 bytes)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(len(PARQUET_MAGIC))
            file.seek(max(size - len(PARQUET_MAGIC), 0))
            tail = file.read(len(PARQUET_MAGIC))
    except OSError as error:
        raise UserError(f"{source}: cannot be read ({error.strerror or error}); check the file") from None
    if head != PARQUET_MAGIC:
        raise UserError(f"{source}: not a Parquet file: it does not start with {PARQUET_MAGIC!r}{binary_kind(head)}; "
                        "give a Parquet file, or a CSV named .csv")
    if tail != PARQUET_MAGIC:
        raise UserError(f"{source}: a Parquet file cut short or damaged (its last bytes are not {PARQUET_MAGIC!r}, "
                        f"size {size:,} bytes); copy or write it again")


def builtin_bars(name: str) -> pd.DataFrame:
    """The real daily bars shipped in ``fitdqn/market/datasets/``: ``'sp500'`` or ``'nasdaq'`` (5,031 bars,
    1999-2018; provenance and licence in that folder's README)."""
    if name not in BUILTIN_FILES:
        raise UserError(f"unknown built-in data '{name}'; use one of {', '.join(BUILTIN)}")
    resource = resources.files(DATASETS_PACKAGE).joinpath(DATASETS_DIR, BUILTIN_FILES[name])
    with resource.open("rb") as handle:
        frame = pd.read_csv(handle, compression="gzip")  # Date, Open, High, Low, Close, Adj Close, Volume
    return normalise_bars(frame, f"built-in '{name}'", date_format=BUILTIN_DATE_FORMAT)


def synthetic_bars(num_bars: int, signal: float, seed: int) -> pd.DataFrame:
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
    try:
        validate_bars(bars, "synthetic bars")
    except UserError as error:  # e.g. a long series whose random walk leaves the price range
        raise UserError(f"{error}; for the synthetic market lower market.synthetic_bars") from None
    return bars


def load_bars(
    data: str, *, date_format: str, synthetic_bars_count: int, synthetic_signal: float, seed: int
) -> pd.DataFrame:
    """Bars for ``market.data``: a built-in name or a CSV/Parquet path (text times read by ``date_format``); the
    synthetic market of ``synthetic_bars_count`` bars (``market.synthetic_bars``), ``synthetic_signal`` and
    ``seed``."""
    if data in ("sp500", "nasdaq"):
        return builtin_bars(data)
    if data == SYNTHETIC_DATA:
        return synthetic_bars(synthetic_bars_count, synthetic_signal, seed)
    path = Path(data)
    if path.suffix.lower() not in FILE_SUFFIXES and not path.exists():
        raise UserError(
            f"market.data: '{data}' is neither a built-in data set ({', '.join(BUILTIN)}) nor a CSV/Parquet "
            "file path; give one of those"
        )
    return read_bars_file(path, date_format=date_format)


def bars_from_config(market) -> pd.DataFrame:
    """Bars for a :class:`fitdqn.config.MarketConfig`."""
    return load_bars(
        market.data,
        date_format=market.date_format,
        synthetic_bars_count=market.synthetic_bars,
        synthetic_signal=market.synthetic_signal,
        seed=market.seed,
    )


# ---------------------------------------------------------------------------------------------- calendar
DAYS_PER_YEAR = 365.2425  # Gregorian
FULL_YEAR_SLACK = pd.Timedelta(days=7)  # a year counts as full when the data covers it to within a week


def bars_per_year(timestamps) -> float:
    """Bars per year from the data's own spacing and calendar (annualises Sharpe, volatility, returns).

    With at least one full calendar year (the data covering it to within a week at either end): the median
    bar count of the full years, so holidays, sessions and weekends count as the data has them (about 252
    daily exchange bars, 52 weekly, ~6,200 hourly bars of a 24x5 market, 8,760 of a 24x7 one). With less:
    the bars of the full weeks inside the data per week, times the weeks of a year; with less than one full
    week, the bars per day of the covered span, times the days of a year.
    """
    stamps = pd.DatetimeIndex(pd.to_datetime(pd.Series(timestamps))).sort_values()
    if len(stamps) < 2:
        raise UserError(f"bars per year: {len(stamps)} bar(s); give at least two timestamps")
    first, last = stamps[0], stamps[-1]
    years = pd.Series(stamps.year)
    full_years = [
        y
        for y in range(first.year, last.year + 1)
        if (y > first.year or first <= pd.Timestamp(y, 1, 1) + FULL_YEAR_SLACK)
        and (y < last.year or last >= pd.Timestamp(y, 12, 31) - FULL_YEAR_SLACK)
    ]
    counts = years.value_counts()
    full_years = [y for y in full_years if y in counts.index]  # a year without a bar is a gap, not the calendar
    if full_years:
        return float(np.median([int(counts[y]) for y in full_years]))
    week_start = (stamps - pd.to_timedelta(stamps.day_of_week, unit="D")).normalize()  # Monday 00:00 of each bar
    weeks = pd.Series(week_start).value_counts()
    inside = weeks.index[(weeks.index > week_start[0]) & (weeks.index < week_start[-1])]
    if len(inside):  # full weeks; weeks with no bar count as 0
        span_weeks = (week_start[-1] - week_start[0]).days // 7 - 1
        return float(weeks[inside].sum() / span_weeks * DAYS_PER_YEAR / 7.0)
    span_days = (last - first) / pd.Timedelta(days=1)
    return float((len(stamps) - 1) / span_days * DAYS_PER_YEAR)
