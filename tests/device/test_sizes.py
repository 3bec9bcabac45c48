import pytest

from fitdqn.device import format_bytes, parse_size
from fitdqn.errors import UserError


@pytest.mark.parametrize(
    "text, expected",
    [("1.7GiB", int(1.7 * 2**30)), ("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("123456B", 123456),
     ("123456 b", 123456), ("2 gib", 2 * 2**30), ("0.5TB", 5 * 10**11), ("64k", 64 * 1024)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1.7Gx", "GiB", "", "-4GB", "1.2.3GB", "four GB"])
def test_malformed_size_is_a_clear_error(text):
    with pytest.raises(UserError, match="cannot read the size"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(int(1.7 * 2**30)) == "1.7 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3 MiB"


@pytest.mark.parametrize("text", ["1.7", "123456", " 4 "])
def test_size_without_a_unit_is_refused(text):
    with pytest.raises(UserError, match=r"has no unit: give a unit \(GiB, MB, \.\.\.\)"):
        parse_size(text)


def test_int_is_a_byte_count():
    assert parse_size(312475648) == 312475648
