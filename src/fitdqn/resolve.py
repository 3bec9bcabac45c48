"""One resolve step: every 'auto' of a config settled once, for one device (and the data, where it matters).

The plan, the trainer, the checkpoint and the run's ``config.toml`` all see the resolved form: no part of the
library decodes an 'auto' of its own. What depends on the device kind alone (``collect.num_envs``,
``collect.steps_per_epoch``, ``net.size``) is ``fitdqn.config.for_device``'s table; the precision and
the learning rate's base batch (the profile's tested batch) depend on the device itself; the reward scale on the
training split's bars. The batch is the plan's to choose (it needs the memory): ``fitdqn.config.batch_choice`` is
the one reading of ``budget.batch_size``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fitdqn.config import Config, for_device
from fitdqn.device.probe import DeviceInfo
from fitdqn.device.profiles import load_profiles, match_profile

if TYPE_CHECKING:  # the market's data pipeline (pandas): not imported to plan from a stored trace
    from fitdqn.market.env import RewardScale
    from fitdqn.market.loader import Market


def resolved_precision(precision: str, device: DeviceInfo) -> str:
    """``learn.precision`` on ``device``: 'auto' is bf16 on a CUDA device with native bf16, else fp32."""
    if precision != "auto":
        return precision
    return "bf16" if device.kind == "cuda" and device.bf16 else "fp32"


def resolve_for_device(config: Config, device: DeviceInfo) -> Config:
    """``config`` with every device-dependent 'auto' settled for ``device``; idempotent."""
    config = for_device(config, device.kind)
    learn = dataclasses.replace(config.learn, precision=resolved_precision(config.learn.precision, device),
                                lr_base_batch=resolved_lr_base_batch(config, device))
    return dataclasses.replace(config, learn=learn)


def resolved_lr_base_batch(config: Config, device: DeviceInfo) -> int:
    """``learn.lr_base_batch`` on ``device``: 'auto' (0) is the tested batch of the device's profile."""
    if config.learn.lr_base_batch:
        return config.learn.lr_base_batch
    return match_profile(device.name, load_profiles(config.budget.profiles_dir or None)).batch_size


def resolve_for_market(config: Config, market: Market) -> tuple[Config, RewardScale]:
    """``config`` with the values it leaves to the data resolved for ``market``: the volatility sizing's target
    (``market.target_volatility`` under ``market.position_sizing = 'volatility'``: the derived value when it is 0)
    and then ``market.reward_scale`` (the derived value when it is 0), and what the scale does
    (:class:`fitdqn.market.env.RewardScale`). The one place a run's reward scale is settled: training, backtests
    and deploy read it from the resolved config."""
    from fitdqn.market.env import (  # lazy by design: resolve_for_device (the plan's) needs no market
        derive_reward_scale,
        derive_target_volatility,
        derives_target,
    )

    m = config.market
    if derives_target(m):
        derived = derive_target_volatility(market, config.net.window)
        config = dataclasses.replace(config, market=dataclasses.replace(m, target_volatility=derived))
    info = derive_reward_scale(market, config)
    resolved = dataclasses.replace(config, market=dataclasses.replace(config.market, reward_scale=info.scale))
    return resolved, info


def resolve_run(config: Config, device: DeviceInfo, market: Market) -> tuple[Config, RewardScale]:
    """The run's config, resolved for ``device`` and ``market`` (the reward scale derived from the training
    split when ``market.reward_scale`` is 0), and what that scale does to the split's returns."""
    return resolve_for_market(resolve_for_device(config, device), market)
