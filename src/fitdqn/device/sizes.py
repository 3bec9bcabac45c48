"""Byte sizes as people write them: ``1.7GiB``, ``4GB``, ``512MiB``, ``123456B``: always with a unit."""

from __future__ import annotations

import re

from fitdqn.errors import UserError

UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
DEVICE_MEMORY_MAX = 2**50  # 1 PiB: thousands of times the largest card; a device size beyond it is a typo


def parse_size(text: str | int) -> int:
    """``'1.7GiB'`` -> 1825361100; decimal (GB) and binary (GiB) units, ``B`` for bytes. A string without a unit
    is refused (``1.7`` is far more likely meant as GiB than as 1.7 bytes); an ``int`` is already a byte count."""
    if isinstance(text, int):
        return text
    match = SIZE_PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if unit == "":
        raise UserError(
            f"the size {text!r} has no unit: give a unit (GiB, MB, ...), e.g. {match.group(1)}GiB, "
            f"{match.group(1)}GB, or {match.group(1)}B for bytes"
        )
    if match is None or unit not in UNITS:
        raise UserError(
            f"cannot read the size {text!r}: write a number and a unit, e.g. 1.7GiB, 4GB, 512MiB"
        )
    return int(float(match.group(1)) * UNITS[unit])


def device_memory_size(text: str, option: str) -> int:
    """A device memory size the user typed (``--total-memory``): :func:`parse_size`, above 0 and at most
    ``DEVICE_MEMORY_MAX``."""
    size = parse_size(text)
    if not 0 < size <= DEVICE_MEMORY_MAX:
        raise UserError(f"{option} {text}: {'no memory' if size <= 0 else 'more memory than any device has'}; give "
                        "the card's memory, above 0 and at most 1 PiB (e.g. 80GB)")
    return size


def format_bytes(count: float) -> str:
    """Binary units, three significant figures: 1825361100 -> '1.70 GiB'."""
    sign = "-" if count < 0 else ""
    count = abs(count)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{sign}{count / size:.3g} {unit}"
    return f"{sign}{int(count)} B"
