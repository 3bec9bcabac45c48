"""Each run's share of the GPU, from its own plan: the free memory at which its plan is the one it would make on
the whole card, plus the planner's headroom and a margin (``packing.share_bytes``).

The shares are planned in a separate process (``python -m fitdqn.schedule.shares DEVICE CONFIGS.json``) before any
run starts: it probes the device (or, for a run queued once others hold the GPU, such as a tune trial sampled later,
takes the device probed before them as a what-if description, with no GPU visible), plans each distinct config there
(cached on disk: ``plan.plan_cache``; the seed and the run directory move no byte, so every member of a study is one
plan) and prints the shares, so the scheduler holds no CUDA context of its own. A plan that grows with the memory it
is given (an auto batch or a replay not yet at its cap fills the card) would be another plan within a smaller share:
such a run is given the whole free memory and runs alone, as it would by itself."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fitdqn.config import Config, config_from_dict, config_to_dict
from fitdqn.device.probe import DeviceInfo
from fitdqn.errors import UserError
from fitdqn.schedule.packing import share_bytes

SHARE_MARGIN_BYTES = 64 * 2**20  # beyond the plan: the allocator's rounding to whole segments
SHARE_RESOLUTION_BYTES = 16 * 2**20  # how close the least free memory giving a run its own plan is found


def planning_config(config: Config) -> Config:
    """The config as far as its memory goes: the seed and run directory set aside (every member one plan)."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, seed=0, out=""))


def run_share(config: Config, device: DeviceInfo, plan: Callable | None = None) -> int:
    """The free memory the run of ``config`` is given on ``device`` (its ``free_bytes``: the whole free memory).

    At least its planned bytes with the planner's headroom and a margin; where the plan made there is not the one
    made on the whole free memory (its replay is a share of the free memory, ``budget.replay_buffer_vram_fraction``,
    up to replay.capacity; an auto batch up to budget.max_batch), the least free memory at which it is (to
    ``SHARE_RESOLUTION_BYTES``), found by bisection: the whole free memory for a plan that grows with it."""
    if plan is None:
        from fitdqn.plan.plan_cache import plan_for_device as plan  # the planner: only when a share is planned
    from fitdqn.plan.planner import InfeasiblePlan

    free = device.free_bytes
    config = planning_config(config)
    whole = plan(config, device)
    wanted = (whole.batch_size, whole.replay_capacity)

    def same_plan(share: int) -> bool:
        try:
            within = plan(config, dataclasses.replace(device, free_bytes=share))
        except InfeasiblePlan:
            return False
        return (within.batch_size, within.replay_capacity) == wanted

    low = share_bytes(whole.planned_bytes, config.budget.headroom_fraction, SHARE_MARGIN_BYTES)
    if low >= free:
        return free
    if same_plan(low):
        return low
    high = free  # the same plan, by definition
    while high - low > SHARE_RESOLUTION_BYTES:
        middle = (low + high) // 2
        low, high = (low, middle) if same_plan(middle) else (middle, high)
    return high if high < free else free


def device_from_json(data: dict[str, Any]) -> DeviceInfo:
    capability = data.get("compute_capability")
    return DeviceInfo(**{**data, "compute_capability": tuple(capability) if capability else None})


def plan_shares(device_spec: str, configs: list[dict[str, Any]], described: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The probed device (JSON) and, on a GPU, each config's share (None on a CPU: memory is not packed).

    ``described``: a device probed before (its JSON), planned on the what-if path instead of probed again (runs
    hold the GPU by then: its free memory is the one probed before they started, and this process, started with
    no GPU visible, makes no CUDA context)."""
    from fitdqn.device.probe import probe

    if described is not None:
        device = dataclasses.replace(device_from_json(described), what_if=True)
    else:
        device = probe(device_spec)
    shares: list[int | None] = [None] * len(configs)
    if device.kind == "cuda":
        known: dict[str, int] = {}
        for index, data in enumerate(configs):
            config = planning_config(config_from_dict(data))
            key = json.dumps(config_to_dict(config), sort_keys=True)
            if key not in known:
                known[key] = run_share(config, device)
            shares[index] = known[key]
    return {"device": device.to_json(), "shares": shares}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        described = json.loads(Path(argv[2]).read_text()) if len(argv) > 2 else None
        result = plan_shares(argv[0], json.loads(Path(argv[1]).read_text()), described)
    except UserError as error:
        result = {"error": str(error)}
    print(json.dumps(result))
    return 0 if "error" not in result else 2


if __name__ == "__main__":
    raise SystemExit(main())
