"""The replay's entries in the VRAM plan: capacity from the replay share, bytes from the real objects.

Fixed bytes are counted from a :class:`ReplayBuffer` built on the 'meta' device (same constructor, same
shapes and dtypes, nothing allocated). Per-sample bytes come from the shapes a batch row creates.
"""

from __future__ import annotations

from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.memory.component import Component, ComponentName, tensor_bytes
from fitdqn.replay.buffer import ReplayBuffer
from fitdqn.transitions import TransitionSpec, bytes_per_transition


class ReplayTooSmall(UserError):
    """The replay's share of the free memory cannot hold its smallest buffer; ``needed_bytes``: the free memory
    (beyond CUDA's own) whose share would."""

    def __init__(self, message: str, needed_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


def meta_buffer(config, spec: TransitionSpec, capacity: int, num_envs: int) -> ReplayBuffer:
    """The buffer the trainer would build, on the 'meta' device (shapes only)."""
    return ReplayBuffer.from_config(config, spec, capacity, goal_column=0, device="meta", num_envs=num_envs)


def replay_fixed_bytes(config, spec: TransitionSpec, capacity: int, num_envs: int) -> int:
    """Storage + sum tree + index/scratch buffers of a buffer of ``capacity`` transitions."""
    buffer = meta_buffer(config, spec, capacity, num_envs)
    return sum(tensor_bytes(t.shape, t.dtype) for t in buffer.tensors())


def plan_capacity(config, spec: TransitionSpec, free_bytes: int, num_envs: int) -> int:
    """min(replay.capacity, what the replay share holds), a multiple of num_envs; refuses if too small."""
    share = int(config.budget.replay_buffer_vram_fraction * free_bytes)
    per_transition = bytes_per_transition(spec)
    # the largest step count whose real fixed bytes fit the share (bytes grow with capacity: bisect)
    low, high = 0, min(config.replay.capacity, share // max(per_transition, 1)) // num_envs
    while low < high:
        mid = (low + high + 1) // 2
        # below n_step steps no buffer can be built; the check after the loop refuses those anyway
        if mid < config.learn.n_step or replay_fixed_bytes(config, spec, mid * num_envs,
                                                                                    num_envs) <= share:
            low = mid
        else:
            high = mid - 1
    capacity = low * num_envs
    smallest = max(config.learn.n_step * num_envs, config.replay.min_fill)
    fraction = config.budget.replay_buffer_vram_fraction
    if capacity < smallest <= config.replay.capacity and fraction > 0:  # the memory is short, not replay.capacity
        rounded = -(-smallest // num_envs) * num_envs
        smallest_bytes = replay_fixed_bytes(config, spec, rounded, num_envs)
        needed = int(smallest_bytes / fraction) + 1  # fraction in (0, 1): config.validate
        raise ReplayTooSmall(
            f"the replay's smallest buffer ({rounded} transitions: max(learn.n_step x collect.num_envs, "
            f"replay.min_fill) = {smallest}, a multiple of {num_envs} envs) takes {format_bytes(smallest_bytes)}, "
            f"budget.replay_buffer_vram_fraction = {fraction:g} of the free memory, so it needs "
            f"{format_bytes(needed)} free where there is {format_bytes(free_bytes)}; give a device with more free "
            "memory, or lower collect.num_envs or replay.min_fill",
            needed,
        )
    if capacity < smallest:
        raise UserError(
            f"replay: capacity {capacity} (the smaller of replay.capacity={config.replay.capacity} and what "
            f"{config.budget.replay_buffer_vram_fraction:g} x {free_bytes} free bytes holds at "
            f"{per_transition} B per transition + sum tree, rounded down to a multiple of {num_envs} envs) "
            f"is below {smallest} = max(learn.n_step x collect.num_envs, replay.min_fill); raise "
            "replay.capacity or budget.replay_buffer_vram_fraction, or lower collect.num_envs or "
            "replay.min_fill"
        )
    return capacity


def replay_component(config, spec: TransitionSpec, free_bytes: int, num_envs: int) -> tuple[Component, int]:
    """The 'replay' component's fixed bytes and the capacity it was sized for (its per-sample bytes are the traced
    update's sampling, added by ``fitdqn.plan.build``)."""
    capacity = plan_capacity(config, spec, free_bytes, num_envs)
    kind = f"sum tree fanout {config.replay.tree_fanout} f64" if config.replay.prioritized else "uniform"
    component = Component(
        name=ComponentName.REPLAY,
        fixed_bytes=replay_fixed_bytes(config, spec, capacity, num_envs),
        per_sample_bytes=0,  # the step's share: traced (``fitdqn.plan.build.build_components``)
        derived_from=(
            f"{capacity} transitions x {bytes_per_transition(spec)} B ({len(spec)} fields) + {kind}; "
            f"capacity = min(replay.capacity, {config.budget.replay_buffer_vram_fraction:g} x free), "
            f"multiple of {num_envs} envs"
        ),
    )
    return component, capacity
