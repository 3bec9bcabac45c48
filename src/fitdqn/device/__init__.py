"""What the device is, how much is free, and the tested GPU profiles.

Names load on first use (:mod:`fitdqn.lazy`): the profiles and sizes need no torch, so ``fitdqn gpu-profiles``
runs without importing it."""

from fitdqn.lazy import lazy_names

_HOMES = {
    "DeviceInfo": "probe", "resolve_device": "probe", "what_if": "probe",  # probe(): fitdqn.device.probe.probe
    "Profile": "profiles", "load_profiles": "profiles", "match_profile": "profiles",
    "format_bytes": "sizes", "parse_size": "sizes",
}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
