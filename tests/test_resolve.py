"""The resolve step's device-dependent values: the learning rate's base batch is the device profile's batch."""

from __future__ import annotations

import pytest

from fitdqn.config import Config, for_device, with_overrides
from fitdqn.device.probe import what_if
from fitdqn.device.profiles import load_profiles, match_profile
from fitdqn.learn import scaled_lr
from fitdqn.resolve import resolve_for_device


@pytest.mark.parametrize("name", ["h200", "a100", "NVIDIA GeForce RTX 3050 Laptop GPU"])
def test_the_rate_is_given_at_the_profile_batch(name):
    device = what_if(name, 8 * 2**30, None)
    profile_batch = match_profile(device.name, load_profiles()).batch_size
    learn = resolve_for_device(Config(), device).learn
    assert learn.lr_base_batch == profile_batch
    assert scaled_lr(learn, profile_batch) == pytest.approx(learn.lr)
    assert scaled_lr(learn, profile_batch // 8) == pytest.approx(learn.lr / 8)  # linear below the profile's batch
    assert scaled_lr(learn, profile_batch * 4) == pytest.approx(learn.lr)  # never above learn.lr_max (= learn.lr)


def test_a_given_base_batch_is_kept():
    config = with_overrides(Config(), {"learn.lr_base_batch": 1000})
    assert resolve_for_device(config, what_if("h200", None, None)).learn.lr_base_batch == 1000


def test_validation_every_epoch_on_a_gpu_and_every_five_on_the_cpu():
    assert for_device(Config(), "cuda").train.eval_every == 1
    assert for_device(Config(), "cpu").train.eval_every == 5
    given = with_overrides(Config(), {"train.eval_every": 3})
    assert for_device(given, "cuda").train.eval_every == 3
