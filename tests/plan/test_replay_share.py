import dataclasses

import pytest
from support.replay_reference import sum_tree_bytes, transition_spec

from fitdqn.config import Config, with_overrides
from fitdqn.errors import UserError
from fitdqn.plan.replay_share import replay_component, replay_fixed_bytes
from fitdqn.replay import ReplayBuffer
from fitdqn.transitions import bytes_per_transition


def config(**replay):
    base = Config()
    return dataclasses.replace(base, replay=dataclasses.replace(base.replay, **replay))


def real_bytes(buffer: ReplayBuffer) -> int:
    return sum(t.numel() * t.element_size() for t in buffer.tensors())


@pytest.mark.parametrize(("prioritized", "fanout"), [(True, 64), (True, 8), (False, 64)])
def test_fixed_bytes_equal_a_real_buffer(prioritized, fanout):
    cfg = with_overrides(config(prioritized=prioritized, tree_fanout=fanout),
                         {"collect.num_envs": 8, "replay.min_fill": 10})
    spec = transition_spec()
    component, capacity = replay_component(cfg, spec, free_bytes=10**6, num_envs=8)
    buffer = ReplayBuffer.from_config(cfg, spec, capacity, goal_column=4, device="cpu")
    assert component.fixed_bytes == real_bytes(buffer)
    assert component.name == "replay" and component.per_sample_bytes == 0  # the step's share is traced
    storage = capacity * bytes_per_transition(spec)
    tree = sum_tree_bytes(capacity, fanout) if prioritized else 0
    if prioritized:
        assert buffer.sampler.tree.fanout == fanout
    assert storage + tree <= component.fixed_bytes < storage + tree + 4096
    assert str(capacity) in component.derived_from


def test_capacity_fits_the_share_and_is_a_multiple_of_num_envs():
    cfg = config(capacity=10**9, min_fill=100)
    spec = transition_spec()
    free = 50 * 2**20
    component, capacity = replay_component(cfg, spec, free_bytes=free, num_envs=96)
    share = int(cfg.budget.replay_buffer_vram_fraction * free)
    assert capacity % 96 == 0
    assert component.fixed_bytes <= share
    assert replay_fixed_bytes(cfg, spec, capacity + 96, 96) > share  # the largest that fits
    # the configured capacity caps it when memory is plenty
    _, capped = replay_component(config(capacity=10_000, min_fill=100), spec, free_bytes=2**34, num_envs=96)
    assert capped == 9984


def test_refuses_when_the_share_is_too_small():
    with pytest.raises(UserError, match="replay_buffer_vram_fraction"):
        replay_component(config(), transition_spec(), free_bytes=10**5, num_envs=4096)


def test_meta_counting_is_cheap_at_large_capacity():
    """10^8 transitions are counted on 'meta' (nothing allocated): storage + tree, from the shapes."""
    capacity = 4096 * 25_000
    counted = replay_fixed_bytes(config(), transition_spec(), capacity, 4096)
    assert counted >= capacity * (bytes_per_transition(transition_spec()) + 8)
