"""Files that are not text rows are refused before they are parsed whole, in bounded memory; a gap far beyond the
bars' own calendar and zone names are named at load; bars per year never comes out 0."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pandas as pd
import pytest

from fitdqn.errors import UserError
from fitdqn.market import data
from fitdqn.market.data import SCAN_BYTES, bars_per_year, read_bars_file

HEADER = b"timestamp,open,high,low,close,volume\n"
ROW = b"2020-01-02,10,11,9,10.5,100\n"


def bars_frame(stamps) -> pd.DataFrame:
    n = len(stamps)
    close = 100 * np.exp(np.cumsum(np.random.default_rng(0).normal(0, 0.01, n)))
    return pd.DataFrame({"timestamp": stamps, "open": close, "high": close * 1.01, "low": close * 0.99,
                         "close": close, "volume": np.full(n, 1000.0)})


def refused(path) -> str:
    with pytest.raises(UserError) as error:
        read_bars_file(path, date_format="auto")
    return str(error.value)


def test_a_header_then_nul_bytes_is_refused_in_bounded_memory(tmp_path):
    path = tmp_path / "bars.csv"
    size = 8 * SCAN_BYTES  # a few MB stand in for GBs: the reader holds one chunk, whatever the file's size
    path.write_bytes(HEADER + ROW * 3 + b"\0" * size)
    tracemalloc.start()
    try:
        message = refused(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in message and "line 5" in message and f"byte {len(HEADER) + 3 * len(ROW):,}" in message
    assert "NUL bytes" in message and "head -n 4" in message
    assert peak < 2 * SCAN_BYTES < size  # one chunk of the file at a time, never the file


def test_nul_bytes_late_in_a_file_are_found_in_chunks(tmp_path, monkeypatch):
    read = []
    real_open = open

    class Counting:
        def __init__(self, file):
            self.file = file

        def read(self, n):
            chunk = self.file.read(n)
            read.append(len(chunk))
            return chunk

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(data, "open", lambda p, mode="r": Counting(real_open(p, mode)), raising=False)
    path = tmp_path / "bars.csv"
    text_rows = 3 * SCAN_BYTES // len(ROW)
    path.write_bytes(HEADER + ROW * text_rows + b"\0" * (20 * SCAN_BYTES))
    message = refused(path)
    assert f"line {text_rows + 2}" in message
    assert sum(read) < 5 * SCAN_BYTES  # stopped at the first NUL: the 20 MiB after it were never read


def test_a_file_of_nul_bytes_holds_no_rows(tmp_path):
    path = tmp_path / "bars.csv"
    path.write_bytes(b"\0" * (2 * SCAN_BYTES))
    message = refused(path)
    assert "line 1 (byte 0)" in message and "no text rows at all" in message


@pytest.mark.parametrize("head, found", [
    (b"PK\x03\x04\x14\x00\x06\x00" + bytes(range(256)), "zip archive"),
    (b"\x1f\x8b\x08\x00" + bytes(range(256)), "gzip data"),
    (b"\x89PNG\r\n\x1a\n", "PNG image"),
])
def test_a_binary_file_is_named_not_decoded(tmp_path, head, found):
    path = tmp_path / "bars.csv"
    path.write_bytes(head + bytes(1000))
    message = refused(path)
    assert "binary file, not CSV text" in message and found in message and "UnicodeDecodeError" not in message


def test_text_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "bars.csv"
    path.write_bytes(HEADER + ROW + "2020-01-03,10,11,9,10.5,100 caf\xe9\n".encode("latin-1"))
    message = refused(path)
    assert "line 3" in message and "0xe9" in message and "UTF-8" in message


def test_parquet_magic_is_checked(tmp_path):
    path = tmp_path / "bars.parquet"
    path.write_bytes(HEADER + ROW)
    assert "not a Parquet file" in refused(path)
    bars_frame(pd.bdate_range("2020-01-01", periods=300)).to_parquet(path)
    path.write_bytes(path.read_bytes()[:-10])
    assert "cut short or damaged" in refused(path)


def test_a_gap_of_years_is_refused_at_load_naming_the_bars(tmp_path):
    stamps = pd.bdate_range("2000-01-03", periods=400).append(pd.bdate_range("2014-01-01", periods=400))
    path = tmp_path / "bars.csv"
    bars_frame(stamps).to_csv(path, index=False)
    message = refused(path)
    assert "a gap of 12.5 years" in message and "data row 400" in message and "data row 401" in message
    assert "1 day apart" in message and "the 400 bars after it" in message


def test_ordinary_gaps_are_kept(tmp_path):
    stamps = pd.bdate_range("2000-01-03", periods=600)
    stamps = stamps[(stamps < "2001-01-01") | (stamps > "2001-01-20")]  # three weeks missing: a closure
    path = tmp_path / "bars.csv"
    bars_frame(stamps).to_csv(path, index=False)
    assert len(read_bars_file(path, date_format="auto")) == len(stamps)


def test_bars_per_year_skips_years_without_bars():
    stamps = pd.bdate_range("2000-01-03", "2001-12-31").append(pd.bdate_range("2010-01-01", "2011-12-31"))
    assert bars_per_year(stamps) == pytest.approx(261, abs=2)  # the empty years 2002-2009 are a gap


@pytest.mark.parametrize("zone", ["EST", "America/New_York"])
def test_zone_names_are_refused_by_name(tmp_path, zone):
    stamps = [f"{d:%Y-%m-%d} 09:30:00 {zone}" for d in pd.bdate_range("2020-01-01", periods=300)]
    path = tmp_path / "bars.csv"
    bars_frame(stamps).to_csv(path, index=False)
    message = refused(path)
    assert f"time-zone name '{zone}'" in message and "UTC offsets" in message and "date_format" not in message


def test_am_pm_times_are_not_zone_names(tmp_path):
    stamps = [f"{d:%Y-%m-%d} 09:30 AM" for d in pd.bdate_range("2020-01-01", periods=300)]
    path = tmp_path / "bars.csv"
    bars_frame(stamps).to_csv(path, index=False)
    assert read_bars_file(path, date_format="auto")["timestamp"].iloc[0] == pd.Timestamp("2020-01-01 09:30")


def test_utf16_text_is_named(tmp_path):
    path = tmp_path / "bars.csv"
    path.write_bytes((HEADER + ROW).decode().encode("utf-16-le"))
    assert "UTF-16 text" in refused(path)
    path.write_bytes((HEADER + ROW).decode().encode("utf-16"))  # with a byte-order mark: not UTF-8 at byte 0
    assert "line 1 (byte 0) holds 0xff, which is not UTF-8" in refused(path)
