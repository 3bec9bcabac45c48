"""The update step on CPU: outputs, gradients everywhere, determinism, learning, targets, exact resume."""

from __future__ import annotations

import collections
import contextlib
import copy
from unittest import mock

import pytest
import torch
from learn_helpers import SMALL_NET, STATE_DIM, make_batch, make_learner, small_config
from support.reference import losses as reference
from torch.utils._python_dispatch import TorchDispatchMode

from fitdqn.config import Config, NetConfig
from fitdqn.learn import OUTPUT_KEYS, Learner
from fitdqn.learn.losses import weighted_losses
from fitdqn.nets.c51 import BranchingDuelingC51
from fitdqn.ops.casts import casts_once


def test_update_returns_the_contract():
    learner = make_learner()
    out = learner.update(make_batch(32))
    assert set(OUTPUT_KEYS) <= set(out)
    for key, value in out.items():
        assert isinstance(value, torch.Tensor) and not value.requires_grad
        assert torch.isfinite(value).all(), key
        assert value.shape == ((32,) if key == "priorities" else ()), key
    assert torch.all(out["priorities"] > 0)
    expected = out["c51_loss"] + out["iqn_loss"] + out["iql_loss"]  # default loss weights are 1
    torch.testing.assert_close(out["loss"], expected)
    assert int(learner.step) == 1


def test_every_parameter_gets_a_gradient():
    learner = make_learner()
    learner.update(make_batch(64))
    for name, p in [*learner.online.named_parameters(), *learner.value.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(not p.requires_grad for p in learner.target.parameters())


def test_two_seeded_updates_are_identical():
    outs, params = [], []
    for _ in range(2):
        learner = make_learner(seed=3)
        batch = make_batch(32, seed=4)
        torch.manual_seed(5)
        out = [learner.update(batch) for _ in range(2)][-1]
        outs.append(out)
        params.append([p.detach().clone() for p in learner.params])
    for key in outs[0]:
        assert torch.equal(outs[0][key], outs[1][key]), key
    for a, b in zip(*params, strict=True):
        assert torch.equal(a, b)


def test_loss_falls_on_a_fixed_toy_batch():
    """Terminal transitions (discount 0): the C51 and IQN targets are the rewards, fixed, so the loss must
    fall steadily (with bootstrapping the targets move with the nets and the curve is not monotone)."""
    learner = make_learner(config=small_config(lr=3e-3, target_tau=0.05))
    batch = make_batch(64, seed=1)
    batch["discount"].zero_()
    torch.manual_seed(0)
    outs = [learner.update(batch) for _ in range(60)]
    for key in ("loss", "c51_loss", "iqn_loss"):
        first = torch.stack([o[key] for o in outs[:3]]).mean()
        last = torch.stack([o[key] for o in outs[-3:]]).mean()
        assert last < 0.6 * first, key


def test_parameters_move_and_soft_target_follows():
    learner = make_learner(config=small_config(target_update="soft", target_tau=0.1))
    before_online = [p.detach().clone() for p in learner.online_params]
    before_target = [p.detach().clone() for p in learner.target_params]
    learner.update(make_batch(16))
    for old_t, old_o, online, target in zip(before_target, before_online, learner.online_params,
                                            learner.target_params, strict=True):
        torch.testing.assert_close(target, old_t + 0.1 * (online - old_t))
        assert not torch.equal(old_o, online) or old_o.numel() == 0


def test_hard_target_copies_exactly_every_period():
    learner = make_learner(config=small_config(target_update="hard", target_period=3))
    initial = [p.detach().clone() for p in learner.target_params]
    batch = make_batch(16)
    for _ in range(2):
        learner.update(batch)
        assert all(torch.equal(a, b) for a, b in zip(initial, learner.target_params, strict=True))
    learner.update(batch)
    assert all(torch.equal(a, b) for a, b in zip(learner.online_params, learner.target_params, strict=True))
    learner.update(batch)
    assert not all(torch.equal(a, b) for a, b in zip(learner.online_params, learner.target_params, strict=True))


def test_exact_resume_from_state_dict():
    learner = make_learner(seed=0)
    batch = make_batch(16)
    learner.update(batch)
    saved = copy.deepcopy(learner.state_dict())
    torch.manual_seed(7)
    expected = learner.update(batch)
    other = make_learner(seed=1)  # different weights, then loaded in place
    addresses = [p.data_ptr() for p in other.params]
    other.load_state_dict(saved)
    assert [p.data_ptr() for p in other.params] == addresses
    assert int(other.step) == 1
    torch.manual_seed(7)
    got = other.update(batch)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    for a, b in zip(learner.params, other.params, strict=True):
        assert torch.equal(a, b)
    assert int(other.step) == 2


def test_state_dict_mismatch_is_refused():
    small = make_learner()
    bigger = Learner(Config(net=NetConfig(**{**SMALL_NET.__dict__, "iql_hidden": 8})), STATE_DIM, "cpu")
    with pytest.raises((ValueError, RuntimeError)):
        bigger.load_state_dict(small.state_dict())


@pytest.mark.parametrize("options", [
    {"iql_in_target": True},
    {"precision": "bf16"},
    {"risk": "cvar", "iqn_loss_weight": 0.5, "iql_loss_weight": 2.0},
])
def test_update_variants_run_and_stay_finite(options):
    learner = make_learner(config=small_config(**options))
    out = learner.update(make_batch(32))
    assert all(torch.isfinite(v).all() for v in out.values())
    if "iqn_loss_weight" in options:
        expected = out["c51_loss"] + 0.5 * out["iqn_loss"] + 2.0 * out["iql_loss"]
        torch.testing.assert_close(out["loss"], expected)


def test_iql_in_target_changes_the_td_target():
    outs = []
    for flag in (False, True):
        learner = make_learner(config=small_config(iql_in_target=flag))
        torch.nn.init.constant_(learner.value.fc3.bias, 5.0)  # V(s') far from the target net's Q
        torch.manual_seed(0)
        outs.append(learner.update(make_batch(32)))
    assert not torch.equal(outs[0]["c51_loss"], outs[1]["c51_loss"])
    assert not torch.equal(outs[0]["iqn_loss"], outs[1]["iqn_loss"])
    torch.testing.assert_close(outs[0]["iql_loss"], outs[1]["iql_loss"])


def test_unequal_branches():
    config = Config(net=NetConfig(**{**SMALL_NET.__dict__, "branches": (5, 3, 2)}))
    learner = make_learner(config=config)
    out = learner.update(make_batch(32, config=config))
    assert torch.isfinite(out["loss"])
    actions = learner.act(torch.randn(500, SMALL_NET.window, STATE_DIM), torch.tensor(1.0))
    assert torch.all(actions < torch.tensor([5, 3, 2])) and torch.all(actions >= 0)
    assert set(actions[:, 2].tolist()) == {0, 1}


def test_observations_in_the_autocast_dtype_update_as_float32_ones():
    """The replay builds learner batches' observations in the autocast dtype (``system.build_system``): every
    network reads them through linear layers, which autocast casts to that dtype anyway, so the update is the one
    of float32 observations, bit for bit (losses, priorities, parameters)."""
    config = small_config(precision="bf16")
    batch = make_batch(32, config=config)
    low = {**batch, "obs": batch["obs"].bfloat16(), "next_obs": batch["next_obs"].bfloat16()}
    outs, learners = [], []
    for made in (batch, low):
        learner = make_learner(config=config)
        torch.manual_seed(3)
        outs.append(learner.update(made))
        learners.append(learner)
    for key in outs[0]:
        assert torch.equal(outs[0][key], outs[1][key]), key
    for a, b in zip(learners[0].params, learners[1].params, strict=True):
        assert torch.equal(a, b)


def test_the_update_runs_the_weighted_loss_operators_as_the_plain_function_does():
    """The weighted loss is ``fitdqn::weighted_losses`` and its backward, once each an update; on the update's own
    inputs the plain autograd function (``tests/support/reference``) gives the same gradients and priorities, bit
    for bit (the CPU kernels), and the same losses within fp32 summation order."""
    config = small_config(precision="bf16")
    learner, batch = make_learner(config=config), make_batch(32, config=config)
    calls = []

    def recorded(*args):
        calls.append(args)
        return weighted_losses(*args)

    class Census(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func)] += 1
            return func(*args, **(kwargs or {}))

    census = Census()
    with mock.patch("fitdqn.learn.learner.weighted_losses", recorded), census:
        learner.update(batch)
    assert len(calls) == 1
    operators = [census.counts[f"fitdqn.weighted_losses{suffix}.default"] for suffix in ("", "_backward")]
    assert operators == [1, 1]
    c51_target, log_probs, iqn, v, *rest = [arg.detach() if isinstance(arg, torch.Tensor) else arg
                                            for arg in calls[0]]
    runs = []
    for function in (reference.weighted_losses, weighted_losses):
        leaves = [tensor.clone().requires_grad_() for tensor in (log_probs, iqn, v)]
        loss, means, priorities = function(c51_target, *leaves, *rest)
        loss.backward()
        runs.append([loss.detach(), means, priorities, *[leaf.grad for leaf in leaves]])
    for index, (got, expected) in enumerate(zip(*runs, strict=True)):
        if index < 2:  # the loss and the means: sums over the batch
            torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-7)
        else:
            assert torch.equal(got, expected), index


def _parameter_casts(learner: Learner, batch: dict) -> collections.Counter:
    """How many times one update casts each parameter (``aten._to_copy`` of a parameter's storage)."""
    names = {p.data_ptr(): name for network in ("online", "target", "value")
             for name, p in getattr(learner, network).named_parameters(prefix=network)}

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()
            self.one_by_one = 0  # casts of a parameter on its own (``Tensor.to``)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in names:
                self.counts[names[args[0].data_ptr()]] += 1
                self.one_by_one += 1
            if func is torch.ops.aten._foreach_copy_.default:  # the up-front casts: (copies, sources)
                for copy, source in zip(*args[:2], strict=True):
                    if source.data_ptr() in names and copy.dtype != source.dtype:
                        self.counts[names[source.data_ptr()]] += 1
            return func(*args, **(kwargs or {}))

    casts = Casts()
    with casts:
        learner.update(batch)
    casts.counts["one by one"] = casts.one_by_one
    return casts.counts


def test_each_parameter_is_cast_once_an_update_with_the_same_result():
    """The online net runs twice an update (next_obs, obs): each parameter is cast to bf16 once all the same
    (``fitdqn.ops.casts``), and the update is the one that casts at every use, bit for bit."""
    config = small_config(precision="bf16")
    batch = make_batch(32, config=config)
    def every_use(*_):
        return contextlib.nullcontext()

    counts = _parameter_casts(make_learner(config=config), batch)
    assert counts["online.tokens.fc1.weight"] == 1 and counts["target.tokens.fc1.weight"] == 1
    assert counts.pop("one by one") == 0  # all up front, in one multi-tensor copy
    assert max(counts.values()) == 1
    folds = []
    fold = BranchingDuelingC51._fold

    def counted(self):
        folds.append(self)
        return fold(self)

    with mock.patch.object(BranchingDuelingC51, "_fold", counted):
        learner = make_learner(config=config)
        learner.update(batch)
        assert len(folds) == 2  # the C51 folded weight: the online network's once for both passes, the target's
        with mock.patch("fitdqn.learn.learner.casts_once", every_use):
            learner.update(batch)
        assert len(folds) == 5
    with mock.patch("fitdqn.learn.learner.casts_once", every_use):  # cast at every use
        assert _parameter_casts(make_learner(config=config), batch)["online.tokens.fc1.weight"] == 2
    outs, learners = [], []
    for scope in (casts_once, every_use):
        learner = make_learner(config=config)
        torch.manual_seed(3)
        with mock.patch("fitdqn.learn.learner.casts_once", scope):
            outs.append([learner.update(batch) for _ in range(2)][-1])
        learners.append(learner)
    for key in outs[0]:
        assert torch.equal(outs[0][key], outs[1][key]), key
    for a, b in zip(learners[0].params, learners[1].params, strict=True):
        assert torch.equal(a, b)


def test_gradients_stay_at_their_addresses_and_hold_this_updates():
    """Backward writes fresh gradients that the update copies into the ones allocated at construction (fixed
    addresses for graph capture and the all-reduce): the same tensors after every update, each holding autograd's
    gradient of this update's loss (not a sum over updates)."""
    learner = make_learner(seed=3)
    kept = [p.grad for p in learner.params]
    batch = make_batch(32, seed=4)
    learner.update(batch)
    twin = copy.deepcopy(learner)
    torch.manual_seed(0)
    learner.update(batch)
    assert all(p.grad is g for p, g in zip(learner.params, kept, strict=True))
    torch.manual_seed(0)
    with mock.patch.object(Learner, "_keep_gradients", lambda self: None):  # .grad: what backward wrote
        twin.update(batch)
    for p, q in zip(learner.params, twin.params, strict=True):
        assert q.grad is not None and torch.equal(p.grad, q.grad)
