"""The activation-memory tracker counts what a step adds, frees what dies, and scales with the batch."""

from __future__ import annotations

import torch
from learn_helpers import make_batch, make_learner

from fitdqn.learn import LiveBytes, measure_step, measure_update, slope


def test_live_bytes_counts_new_storages_not_views_or_existing_ones():
    existing = torch.zeros(1000)
    with LiveBytes() as tracker:
        a = torch.empty(100)  # 400 bytes
        b = a.view(10, 10)  # a view: nothing new
        existing.add_(1.0)  # in place on an existing tensor: nothing new
        c = torch.ones(50)  # 200 more: peak 600
        del a, b
        d = torch.ones(25)  # 100 after 400 was freed
        del c, d
    assert tracker.peak == 600
    assert tracker.current == 0


def test_measure_step_attributes_forward_allocations_to_groups():
    learner = make_learner()
    obs = make_batch(8)["obs"]
    memory = measure_step(lambda: learner.online.features(obs), 8, [learner.online.tokens,
                                                                     learner.online.attention])
    assert memory.peak_by_group["dqn"] > 0 and memory.peak_by_group["attention"] > 0
    assert memory.peak_by_group["iqn"] == 0


def test_update_memory_grows_linearly_with_the_batch():
    learner = make_learner()
    learner.update(make_batch(16))
    small, large = measure_update(learner, make_batch(64)), measure_update(learner, make_batch(256))
    assert small.peak_bytes > 0
    per_sample = slope(small, large)
    assert 0 < per_sample < 1.2 * large.per_sample
    assert sum(large.peak_by_group.values()) == large.peak_bytes
