"""What the device is, how much is free, and the tested GPU profiles."""

from fitdqn.device.probe import DeviceInfo, probe, resolve_device, what_if
from fitdqn.device.profiles import Profile, load_profiles, match_profile
from fitdqn.device.sizes import format_bytes, parse_size

__all__ = [
    "DeviceInfo", "Profile", "format_bytes", "load_profiles", "match_profile", "parse_size", "probe",
    "resolve_device", "what_if",
]
