"""The training budget: rules at the base batch, exact update totals, schedules as fractions of the run."""

from __future__ import annotations

import math

import pytest
import torch
from learn_helpers import STATE_DIM, small_config

from fitdqn.config import AUTO_NUM_ENVS, SMALL_NET, Config, ConfigError, NetConfig, for_device, with_overrides
from fitdqn.learn import Learner, Schedule, lr_factor, scaled_lr, target_period_at, target_tau_at, updates_owed
from fitdqn.learn.target import update_target


def learn(**values):
    return with_overrides(Config(), {f"learn.{k}": v for k, v in values.items()}).learn


def test_sqrt_rule_from_the_base_batch_capped_at_lr_max():
    cfg = learn(lr=5e-4, base_batch=256, lr_scaling="sqrt", lr_max=1e-3)
    assert scaled_lr(cfg, 256) == pytest.approx(5e-4)
    assert scaled_lr(cfg, 1024) == pytest.approx(1e-3)  # x sqrt(4)
    assert scaled_lr(cfg, 64) == pytest.approx(2.5e-4)  # x sqrt(1/4)
    assert scaled_lr(cfg, 16384) == pytest.approx(1e-3)  # 4e-3 by the rule, capped
    assert scaled_lr(learn(lr=1e-4, lr_scaling="linear", lr_max=1.0), 1024) == pytest.approx(4e-4)
    assert scaled_lr(learn(lr=1e-4, lr_scaling="none"), 16384) == pytest.approx(1e-4)
    assert scaled_lr(learn(lr=2e-3, lr_max=1e-3), 16384) == pytest.approx(2e-3)  # a given lr above the cap stays


def test_lr_decay_shares_of_the_batch_rate():
    assert lr_factor(learn(lr_decay="none"), 0.7) == 1.0
    cosine = learn(lr_decay="cosine", lr_final=0.1)
    assert lr_factor(cosine, 0.0) == pytest.approx(1.0)
    assert lr_factor(cosine, 0.5) == pytest.approx(0.55)  # halfway between 1 and 0.1
    assert lr_factor(cosine, 1.0) == pytest.approx(0.1)
    assert lr_factor(cosine, 0.25) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_factor(learn(lr_decay="linear", lr_final=0.0), 0.25) == pytest.approx(0.75)
    assert lr_factor(cosine, 3.0) == pytest.approx(0.1)  # clamped past the end


def test_the_optimizer_steps_with_the_scheduled_rate_and_a_load_keeps_the_rate_tensor():
    config = small_config(lr=1e-3, base_batch=256, lr_max=1e-3, lr_decay="linear", lr_final=0.0)
    torch.manual_seed(0)
    learner = Learner(config, STATE_DIM, "cpu")
    learner.set_batch_size(256)
    learner.set_lr_progress(0.75)
    assert learner.optimizer.param_groups[0]["lr"] is learner.lr
    assert learner.lr.item() == pytest.approx(2.5e-4)
    rate = learner.lr
    other = Learner(config, STATE_DIM, "cpu")
    other.set_batch_size(256)
    learner.load_state_dict(other.state_dict())  # saved at progress 0: the rate 1e-3, copied in place
    assert learner.lr is rate and learner.optimizer.param_groups[0]["lr"] is rate
    assert learner.lr.item() == pytest.approx(1e-3)
    # one Adam step moves each weight by about lr (the first step's update is lr x sign(grad))
    learner.set_lr_progress(0.5)
    weight = next(learner.online.parameters())
    before = weight.detach().clone()
    for p in learner.params:
        p.grad = torch.ones_like(p)
    learner.optimizer.step()
    assert (before - weight.detach()).abs().max().item() == pytest.approx(5e-4, rel=1e-3)


def test_the_rate_tensor_steps_like_a_python_float_rate_on_the_cpu():
    torch.manual_seed(0)
    learner = Learner(small_config(lr=1e-3, lr_decay="none"), STATE_DIM, "cpu")
    learner.set_batch_size(256)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in learner.params]
    reference = torch.optim.Adam(copies, lr=scaled_lr(learner.learn_config, 256),
                                 eps=learner.learn_config.adam_eps, fused=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(learner.params, copies, strict=True):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        learner.optimizer.step()
        reference.step()
    for p, q in zip(learner.params, copies, strict=True):
        assert torch.equal(p.detach(), q.detach())  # bit for bit: the run's results do not move with the tensor


def test_weight_decay_shrinks_the_weights_by_the_rate_times_the_decay_each_update():
    """learn.weight_decay is AdamW's decoupled decay: with zero gradients (no Adam move) an update multiplies every
    weight by 1 - lr x decay; 0 keeps plain Adam."""
    learner = Learner(small_config(lr=1e-3, lr_decay="none", weight_decay=0.5), STATE_DIM, "cpu")
    learner.set_batch_size(256)
    assert isinstance(learner.optimizer, torch.optim.AdamW)
    before = [p.detach().clone() for p in learner.params]
    for p in learner.params:
        p.grad = torch.zeros_like(p)
    learner.optimizer.step()
    shrink = 1.0 - scaled_lr(learner.learn_config, 256) * 0.5
    for p, b in zip(learner.params, before, strict=True):
        torch.testing.assert_close(p.detach(), b * shrink)
    plain = Learner(small_config(lr=1e-3), STATE_DIM, "cpu")
    assert type(plain.optimizer) is torch.optim.Adam


def test_soft_target_keeps_its_time_constant_in_samples():
    """The online net's share in the target after S samples is 1 - (1 - tau)^(S / base_batch) at every batch."""
    cfg = learn(target_tau=0.005, base_batch=256)
    samples = 256 * 64
    for batch in (64, 256, 2048, 16384):
        tau = target_tau_at(cfg, batch)
        remaining = (1.0 - tau) ** (samples // batch)
        assert remaining == pytest.approx(0.995**64, rel=1e-9)
    assert target_tau_at(cfg, 256) == pytest.approx(0.005)


def test_soft_target_on_tensors_matches_the_rule():
    """64 updates at batch 256 and 1 update at batch 16384 move a target the same way towards a fixed online."""
    cfg = learn(target_tau=0.01, base_batch=256)
    online = [torch.ones(3)]
    small, large = [torch.zeros(3)], [torch.zeros(3)]
    for _ in range(64):
        update_target(small, online, target_tau_at(cfg, 256))
    update_target(large, online, target_tau_at(cfg, 16384))
    torch.testing.assert_close(small[0], large[0], rtol=1e-5, atol=1e-6)


def test_hard_period_is_a_number_of_samples():
    cfg = learn(target_period=1000, base_batch=256)
    assert target_period_at(cfg, 256) == 1000
    assert target_period_at(cfg, 2048) == 125
    assert target_period_at(cfg, 16384) == 16  # 15.6 rounded
    assert target_period_at(learn(target_period=2, base_batch=256), 16384) == 1  # at least every update


def test_fractional_updates_are_carried_so_the_total_is_exact():
    reuse, per_epoch, batch, epochs = 1.5, 1000, 256, 7
    done = samples = 0
    per_epoch_updates = []
    for epoch in range(1, epochs + 1):
        owed = updates_owed(reuse, epoch * per_epoch, samples, batch)
        per_epoch_updates.append(owed)
        done += owed
        samples += owed * batch
    assert done == math.floor(reuse * per_epoch * epochs / batch) == 41
    assert set(per_epoch_updates) == {5, 6}  # 5.86 per epoch on average
    # a batch halved mid-run (OOM guard) owes the remaining samples at the new batch
    assert updates_owed(reuse, 2000, 5 * 256, 128) == math.floor((3000 - 1280) / 128)


def test_schedule_of_a_run():
    config = with_overrides(for_device(Config(), "cuda"), {"train.epochs": 20, "train.sample_reuse": 8.0})
    schedule = Schedule.from_config(config, 16384)
    assert schedule.env_steps == 20 * 16 * 4096
    assert schedule.updates == 8 * 20 * 16 * 4096 // 16384 == 640
    assert schedule.samples == 640 * 16384
    assert schedule.epsilon_decay_steps == round(config.learn.epsilon_decay_fraction * schedule.env_steps)
    assert schedule.min_fill == min(config.replay.min_fill, 16 * 4096)
    assert schedule.warning() is None
    rows = dict(schedule.rows())
    assert "640" in rows["updates"] and "1,310,720" in rows["env steps"]


def test_the_same_config_draws_the_same_samples_at_any_batch():
    config = for_device(Config(), "cuda")
    for batch in (256, 2048, 16384):
        schedule = Schedule.from_config(config, batch)
        assert schedule.samples == schedule.updates * batch
        assert abs(schedule.samples - config.train.sample_reuse * schedule.env_steps) < batch


def test_min_fill_never_delays_the_first_epoch():
    config = for_device(Config(), "cpu")  # 32 envs x 64 steps = 2,048 per epoch < min_fill 10,000
    assert config.replay.min_fill > config.collect.num_envs * config.collect.steps_per_epoch
    assert Schedule.from_config(config, 256).min_fill == 2048


def test_a_run_below_the_floor_makes_the_floor_of_updates_and_says_so():
    config = with_overrides(for_device(Config(), "cpu"), {"train.epochs": 2})  # 4,096 env steps x 8 = 32,768 samples
    schedule = Schedule.from_config(config, 16384)  # 2 updates by reuse alone
    assert schedule.floored and schedule.updates == config.train.min_updates == 200
    assert schedule.samples == 200 * 16384 and schedule.sample_reuse == pytest.approx(200 * 16384 / 4096)
    warning = schedule.warning()
    assert warning is not None and "train.sample_reuse" in warning and "train.min_updates" in warning
    assert "floor" in dict(schedule.rows())["samples"]
    unfloored = Schedule.from_config(with_overrides(config, {"train.min_updates": 0}), 16384)
    assert unfloored.updates == 2 and unfloored.warning() is None


def test_above_the_floor_the_samples_do_not_move_and_below_it_the_updates_do_not():
    config = for_device(Config(), "cpu")  # 40,960 env steps x 8 = 327,680 samples
    updates = {batch: Schedule.from_config(config, batch).updates for batch in (64, 256, 1024, 2048, 16384)}
    assert updates == {64: 5120, 256: 1280, 1024: 320, 2048: 200, 16384: 200}  # 2048: 160 by reuse, floored
    assert not Schedule.from_config(config, 1024).floored and Schedule.from_config(config, 2048).floored


def test_the_trainer_spreads_the_floor_over_the_epochs():
    config = with_overrides(for_device(Config(), "cpu"), {"train.epochs": 4, "train.min_updates": 10})
    schedule = Schedule.from_config(config, 16384)
    per_epoch, owed, done = schedule.env_steps_per_epoch, [], 0
    for epoch in range(1, 5):
        count = updates_owed(schedule.sample_reuse, epoch * per_epoch, done * 16384, 16384)
        owed.append(count)
        done += count
    assert owed == [2, 3, 2, 3] and done == 10


def test_renamed_keys_name_their_replacement():
    with pytest.raises(ConfigError, match="train.sample_reuse"):
        with_overrides(Config(), {"train.replay_ratio": 2.0})
    with pytest.raises(ConfigError, match="learn.epsilon_decay_fraction"):
        with_overrides(Config(), {"learn.epsilon_decay_steps": 1000})


def test_for_device_sizes_the_nets_and_is_idempotent():
    cpu = for_device(Config(), "cpu")
    assert cpu.net.size == "small" and cpu.collect.num_envs == AUTO_NUM_ENVS["cpu"]
    assert {k: getattr(cpu.net, k) for k in SMALL_NET} == SMALL_NET
    assert for_device(cpu, "cpu") == cpu
    cuda = for_device(Config(), "cuda")
    assert cuda.net.size == "small" and {k: getattr(cuda.net, k) for k in SMALL_NET} == SMALL_NET
    assert cuda.collect.num_envs == AUTO_NUM_ENVS["cuda"]
    full = for_device(with_overrides(Config(), {"net.size": "full"}), "cuda")
    assert full.net.trunk_hidden == NetConfig().trunk_hidden
    with pytest.raises(ConfigError, match="net.size must be 'full' or 'small', got 'auto'"):  # older files' 'auto'
        with_overrides(Config(), {"net.size": "auto"})
    mine = for_device(with_overrides(Config(), {"net.trunk_hidden": 256}), "cpu")
    assert mine.net.trunk_hidden == 256 and mine.net.d_model == SMALL_NET["d_model"]  # a width given is kept


def test_learner_follows_the_batch():
    config = small_config(lr=2e-4, base_batch=256, lr_scaling="sqrt", lr_max=1.0, target_tau=0.01)
    learner = Learner(config, STATE_DIM, "cpu")
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    learner.set_batch_size(1024)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(4e-4)
    assert learner.target_tau == pytest.approx(1 - 0.99**4)


def test_the_run_clock_is_the_share_of_the_runs_env_steps():
    """Beta and the learning rate's decay read ``Schedule.progress``: env steps collected over the run's, capped."""
    config = for_device(with_overrides(Config(), {"collect.num_envs": 8, "collect.steps_per_epoch": 4,
                                                  "train.epochs": 10}), "cpu")
    schedule = Schedule.from_config(config, 256)
    assert schedule.env_steps == 320
    assert [schedule.progress(n) for n in (0, 80, 320, 640)] == [0.0, 0.25, 1.0, 1.0]
