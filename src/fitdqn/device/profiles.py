"""GPU profiles: versioned TOML files whose header says where each number came from.

A profile holds the tested batch size of one GPU model and the provenance of that number. Shipped
profiles live beside this file in ``profiles/``; a user directory (``budget.profiles_dir``) adds to and
overrides them by name. ``default`` is used for any GPU no profile matches.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fitdqn.device.sizes import parse_size
from fitdqn.errors import UserError

DEFAULT_PROFILE = "default"
REQUIRED_FIELDS = ("name", "match", "batch_size", "source")
REQUIRED_SOURCE_FIELDS = ("kind", "description", "date")


@dataclass(frozen=True)
class Profile:
    name: str
    match: tuple[str, ...]  # case-insensitive regular expressions searched in the device name
    batch_size: int
    source: dict[str, Any]  # kind ("plan" | "measured"), description, date, command, card, ...
    total_memory_bytes: int | None = None  # the card's usual total memory, for what-if plans by alias
    path: str = ""
    measurements: tuple[dict[str, Any], ...] = field(default=())
    # memory the driver takes outside PyTorch's allocator in a training process (kernel images loaded lazily,
    # cuBLAS handles, CUDA-graph executables), measured by `fitdqn profile`; None: not measured
    driver_bytes: int | None = None

    def matches(self, device_name: str) -> bool:
        return any(re.search(pattern, device_name, re.IGNORECASE) for pattern in self.match)


def parse_profile(text: str, origin: str) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"profile {origin} is not valid TOML: {error}") from None
    missing = [key for key in REQUIRED_FIELDS if key not in data]
    if missing:
        raise UserError(
            f"profile {origin} lacks the field(s) {', '.join(missing)}; "
            f"a profile needs {', '.join(REQUIRED_FIELDS)} (see the shipped profiles for the format)"
        )
    source = data["source"]
    missing_source = [key for key in REQUIRED_SOURCE_FIELDS if not isinstance(source, dict) or key not in source]
    if missing_source:
        raise UserError(f"profile {origin}: [source] lacks {', '.join(missing_source)} (where the numbers came from)")
    batch = data["batch_size"]
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        raise UserError(f"profile {origin}: batch_size must be a positive integer, got {batch!r}")
    match = data["match"]
    if not isinstance(match, list) or not all(isinstance(p, str) for p in match):
        raise UserError(f"profile {origin}: match must be a list of regular expressions (strings)")
    for pattern in match:
        try:
            re.compile(pattern)
        except re.error as error:
            raise UserError(f"profile {origin}: bad match pattern {pattern!r}: {error}") from None
    known = set(REQUIRED_FIELDS) | {"total_memory", "measurements", "driver_bytes"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"profile {origin}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    total = data.get("total_memory")
    driver = data.get("driver_bytes")
    driver_bytes = parse_size(driver) if isinstance(driver, str) else driver
    if driver is not None and (not isinstance(driver_bytes, int) or isinstance(driver_bytes, bool) or driver_bytes < 0):
        raise UserError(f"profile {origin}: driver_bytes must be a byte count >= 0 (e.g. 312000000 or '300MiB'), "
                        f"got {driver!r}")
    return Profile(
        name=str(data["name"]), match=tuple(match), batch_size=batch, source=dict(source),
        total_memory_bytes=parse_size(total) if total is not None else None, path=origin,
        measurements=tuple(data.get("measurements", ())), driver_bytes=driver_bytes,
    )


def shipped_profile_texts() -> dict[str, str]:
    folder = resources.files("fitdqn.device") / "profiles"
    return {entry.name: entry.read_text() for entry in folder.iterdir() if entry.name.endswith(".toml")}


def load_profiles(user_dir: str | Path | None = None) -> dict[str, Profile]:
    """Shipped profiles, then the user's (same name replaces). Keyed by profile name."""
    profiles: dict[str, Profile] = {}
    for file_name, text in sorted(shipped_profile_texts().items()):
        profile = parse_profile(text, f"fitdqn/device/profiles/{file_name}")
        profiles[profile.name] = profile
    if user_dir:
        folder = Path(user_dir)
        if not folder.is_dir():
            raise UserError(f"profiles directory '{folder}' does not exist (budget.profiles_dir)")
        for path in sorted(folder.glob("*.toml")):
            profile = parse_profile(path.read_text(), str(path))
            profiles[profile.name] = profile
    if DEFAULT_PROFILE not in profiles:
        raise UserError("no 'default' profile found: the package is incomplete, reinstall fitdqn")
    return profiles


def match_profile(device_name: str, profiles: dict[str, Profile]) -> Profile:
    """The profile whose pattern matches the device name, else ``default``.

    A profile named exactly like the device (``--gpu h100``) wins; otherwise the first match in name
    order. ``default`` itself never matches by pattern.
    """
    lowered = device_name.strip().lower()
    if lowered in profiles:
        return profiles[lowered]
    for name in sorted(profiles):
        if name != DEFAULT_PROFILE and profiles[name].matches(device_name):
            return profiles[name]
    return profiles[DEFAULT_PROFILE]


def profile_with_note(device_name: str, profiles: dict[str, Profile]) -> tuple[Profile, str]:
    """``match_profile`` and, when no profile of its own matched, a note naming the one used instead."""
    profile = match_profile(device_name, profiles)
    if profile.name != DEFAULT_PROFILE:
        return profile, ""
    return profile, (f"no GPU profile matches '{device_name}': the '{DEFAULT_PROFILE}' profile is used (batch "
                     f"{profile.batch_size}, {profile.source['description']}); `fitdqn profile` on the card writes "
                     "its own")
