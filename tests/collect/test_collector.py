"""The collector: epsilon's schedule, every env step written into the replay with its sums, and a restored state
that collects what the saved one would have."""

import pytest
import torch
from support.small_run import SMALL_RUN

from fitdqn.collect.collector import COLLECT_STAT_KEYS, epsilon_at
from fitdqn.config import Config, LearnConfig, for_device, with_overrides
from fitdqn.market.loader import load_market
from fitdqn.resolve import resolve_for_market
from fitdqn.system import build_system
from fitdqn.transitions import EPISODE_END

STEPS = 40  # episodes of 32 steps: every env ends at least one


def small_system():
    config = for_device(with_overrides(Config(), SMALL_RUN), "cpu")
    market = load_market(config.market, window=config.net.window, device="cpu")
    config, _ = resolve_for_market(config, market)
    torch.manual_seed(0)
    return build_system(config, market, torch.device("cpu"), capacity=4096, batch_size=64, epsilon_decay_steps=1000)


def test_epsilon_falls_linearly_over_its_steps_then_holds():
    learn = LearnConfig(epsilon_start=1.0, epsilon_end=0.1)
    steps = torch.tensor([0, 250, 500, 1000, 5000])
    assert torch.allclose(epsilon_at(steps, learn, 1000), torch.tensor([1.0, 0.775, 0.55, 0.1, 0.1]))


def test_every_env_step_lands_in_the_replay_with_the_sums_of_what_was_written():
    system = small_system()
    collector, storage = system.collector, system.replay.storage
    num_envs = system.env.num_envs
    collector.run(STEPS)
    assert int(storage.written) == STEPS and int(collector.env_steps) == STEPS * num_envs
    rows = STEPS * num_envs  # the ring is not full: rows [0, rows) hold the steps
    stats = collector.take_stats()
    assert set(stats) == set(COLLECT_STAT_KEYS)
    assert stats["reward"] == pytest.approx(float(storage.fields["reward"][:rows].double().sum()), rel=1e-5, abs=1e-6)
    ended = int((storage.fields["flags"][:rows] & EPISODE_END).ne(0).sum())
    assert stats["episodes_done"] == ended >= num_envs
    assert all(value == 0 for value in collector.take_stats().values())  # taken: the sums start again


def test_a_restored_collector_writes_what_the_saved_one_wrote():
    system = small_system()
    collector, storage = system.collector, system.replay.storage
    collector.run(10)
    saved = collector.state_dict()
    act_state = system.act_generator.get_state()
    collector.run(20)
    first = {name: storage.fields[name][160:480].clone() for name in ("action", "reward", "flags")}
    collector.load_state_dict(saved)
    system.act_generator.set_state(act_state)
    collector.run(20)  # into the next rows of the ring
    again = {name: storage.fields[name][480:800] for name in first}
    for name in first:
        assert torch.equal(first[name], again[name]), name
