"""From config + device to a Plan: match the profile, gather every component, let the planner choose."""

from __future__ import annotations

from fitdqn.budget.planner import Plan, make_plan
from fitdqn.config import Config
from fitdqn.device.probe import DeviceInfo
from fitdqn.device.profiles import load_profiles, match_profile


def plan_for_device(config: Config, device: DeviceInfo) -> Plan:
    profiles = load_profiles(config.budget.profiles_dir or None)
    profile = match_profile(device.name, profiles)
    components, replay_capacity = [], None  # the component model lands with the planner (issue 4)
    return make_plan(device, profile, config.budget, components, replay_capacity)
