"""Whole plans cached on disk: `fitdqn plan` for a config and device it has planned before answers at once.

The traces behind a plan are cached one by one (``trace_cache``); the rest of a plan (counting the bars,
sizing the replay by bisection on 'meta' tensors, the networks' bytes) also costs seconds, mostly in imports.
So a finished plan is stored too, under a key of everything it was computed from: the whole config, the
device as probed or described (name, memory, compute capability, SMs), the market data (a file's size and
time, or the version of the package that ships a built-in dataset), the environment variables the plan
reads, the user's profiles, and the versions and source of torch and fitdqn (``trace_cache.trace_key``).
A real GPU's free memory moves between probes, so its plans are rarely found here; its traces still are.

This module stays light (no market, network or replay imports): a plan found here needs none of them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

from fitdqn.config import Config, config_to_dict
from fitdqn.device.probe import DeviceInfo
from fitdqn.device.profiles import load_profiles
from fitdqn.memory.component import Component
from fitdqn.plan.planner import Plan
from fitdqn.plan.trace_cache import TraceCache, cache_folder, data_provenance, trace_key

PLAN_ENVIRONMENT = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
                    "TORCH_CUBLASLT_WORKSPACE_SIZE")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _folder_digest(folder: str) -> str | None:
    if not folder or not Path(folder).is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*.toml")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def plan_key(config: Config, device: DeviceInfo, inputs=None) -> dict[str, Any]:
    """Everything a plan is computed from (module docstring)."""
    data = ({"num_bars": inputs.num_bars, "market_bytes": inputs.market_bytes, "world_size": inputs.world_size}
            if inputs is not None else data_provenance(config.market.data))
    return trace_key(what="plan", config=config_to_dict(config), device=device.to_json(), data=data,
                     environment={name: os.environ.get(name) for name in PLAN_ENVIRONMENT},
                     profiles=_folder_digest(config.budget.profiles_dir),
                     triton=_version("triton") if importlib.util.find_spec("triton") else None)


def plan_to_json(plan: Plan) -> dict[str, Any]:
    return plan.to_json()


def plan_from_json(data: dict[str, Any], config: Config) -> Plan:
    device = dict(data["device"])
    capability = device.get("compute_capability")
    device["compute_capability"] = tuple(capability) if capability else None
    profile = load_profiles(config.budget.profiles_dir or None)[data["profile"]]
    return Plan(
        device=DeviceInfo(**device), profile=profile, batch_size=int(data["batch_size"]),
        batch_source=str(data["batch_source"]), components=tuple(Component(**c) for c in data["components"]),
        headroom_bytes=int(data["headroom_bytes"]), replay_capacity=data["replay_capacity"],
        max_fitting_batch=data["max_fitting_batch"], notes=tuple(data["notes"]),
    )


def plan_cache(config: Config) -> TraceCache:
    return TraceCache(cache_folder(config.budget.trace_cache_dir))


def cached_plan(config: Config, device: DeviceInfo, inputs=None) -> tuple[Plan | None, dict[str, Any]]:
    """The stored plan for this config and device (None if there is none), and its key."""
    key = plan_key(config, device, inputs)
    data = plan_cache(config).get_value(key)
    if data is None:
        return None, key
    try:
        plan = plan_from_json(data, config)
    except (KeyError, TypeError, ValueError):
        return None, key  # written by another layout: planned again and rewritten
    return (plan if plan.to_json() == data else None), key


def store_plan(config: Config, key: dict[str, Any], plan: Plan) -> None:
    plan_cache(config).put_value(key, plan_to_json(plan))


def plan_for_device(config: Config, device: DeviceInfo, inputs=None) -> Plan:
    """``fitdqn.plan.build.plan_for_device``, answered from the cache when this exact plan was made before."""
    plan, key = cached_plan(config, device, inputs)
    if plan is not None:
        return plan
    # imported here, not above: a plan found in the cache needs none of the system's modules (seconds of imports)
    from fitdqn.plan import build

    plan = build.plan_for_device(config, device, inputs)
    store_plan(config, key, plan)
    return plan
