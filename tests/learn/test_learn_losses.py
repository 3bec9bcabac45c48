"""The three losses against plain references: C51 projection, quantile Huber (and its gradient), expectile."""

from __future__ import annotations

import pytest
import torch
from support.projection_reference import project_loop
from support.reference import losses as reference

from fitdqn.learn.losses import categorical_projection, quantile_huber_loss, weighted_losses


def test_projection_matches_per_sample_loop_on_random_inputs():
    torch.manual_seed(0)
    support = torch.linspace(-10.0, 10.0, 51)
    probs = torch.softmax(torch.randn(12, 3, 51), dim=-1)
    rewards = torch.randn(12) * 8.0
    rewards[0], rewards[1] = 30.0, -25.0  # far beyond the support
    discounts = torch.full((12,), 0.99**3)
    discounts[2:4] = 0.0  # terminal: all mass near the reward
    got = categorical_projection(probs, rewards, discounts, support)
    torch.testing.assert_close(got.double(), project_loop(probs, rewards, discounts, support), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(12, 3))  # mass is conserved


def test_projection_stays_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    support = torch.linspace(-10.0, 10.0, 51)
    probs = torch.softmax(torch.randn(64, 3, 51), dim=-1)
    rewards, discounts = torch.randn(64) * 3.0, torch.full((64,), 0.97)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as in the update (CUDA autocast runs matmuls in bf16 too)
        got = categorical_projection(probs, rewards, discounts, support)
    assert got.dtype == torch.float32
    # bf16 would be off by up to ~4e-3 of a probability: the target would not even sum to 1 within 1e-3
    torch.testing.assert_close(got.double(), project_loop(probs, rewards, discounts, support), atol=1e-6, rtol=0)


def test_projection_of_targets_landing_exactly_on_atoms():
    support = torch.linspace(-10.0, 10.0, 11)  # dz = 2
    probs = torch.softmax(torch.randn(2, 11), dim=-1)
    rewards, discounts = torch.tensor([2.0, -4.0]), torch.tensor([1.0, 0.0])
    got = categorical_projection(probs, rewards, discounts, support)
    expected = project_loop(probs, rewards, discounts, support)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
    # r = 2, discount 1: every atom moves one atom up, the top two pile up at v_max
    torch.testing.assert_close(got[0, 1:-1], probs[0, :-2])
    # terminal with r = -4 (an atom): everything on that atom
    assert float(got[1, 3]) == pytest.approx(1.0, abs=1e-6)


def test_projection_broadcasts_per_branch_rewards():
    torch.manual_seed(1)
    support = torch.linspace(-5.0, 5.0, 21)
    probs = torch.softmax(torch.randn(4, 3, 21), dim=-1)
    rewards, discounts = torch.randn(4, 3), torch.rand(4)
    got = categorical_projection(probs, rewards, discounts, support)
    for branch in range(3):
        expected = categorical_projection(probs[:, branch], rewards[:, branch], discounts, support)
        torch.testing.assert_close(got[:, branch], expected)


def quantile_huber_reference(pred, target, taus, kappa):
    """Direct pairwise form: u [B, N, N', ...], rho = |tau - 1{u<0}| Huber(u) / kappa; sum_i mean_j."""
    u = target.unsqueeze(1) - pred.unsqueeze(2)  # [B, N, N', ...]
    huber = torch.where(u.abs() <= kappa, 0.5 * u.square(), kappa * (u.abs() - 0.5 * kappa))
    tau = taus.reshape(taus.shape + (1,) * (u.dim() - 2))
    rho = (tau - (u.detach() < 0).to(u.dtype)).abs() * huber / kappa
    return rho.mean(dim=2).sum(dim=1).flatten(1).mean(dim=1)  # [B]


@pytest.mark.parametrize("kappa", [1.0, 0.25, 3.0])
def test_quantile_huber_matches_pairwise_reference_and_its_gradient(kappa):
    torch.manual_seed(0)
    pred = (torch.randn(6, 7, 3, dtype=torch.float64) * 2).requires_grad_()
    target = torch.randn(6, 9, 3, dtype=torch.float64) * 2
    target[0, :3] = pred[0, :3].detach()  # ties: u = 0 exactly
    target[1, 0] = pred[1, 0].detach() + kappa  # u = kappa exactly
    taus = torch.rand(6, 7, dtype=torch.float64)
    got, ref = quantile_huber_loss(pred, target, taus, kappa), quantile_huber_reference(pred, target, taus, kappa)
    torch.testing.assert_close(got, ref)
    upstream = torch.randn(6, dtype=torch.float64)
    (grad_got,) = torch.autograd.grad((got * upstream).sum(), pred)
    (grad_ref,) = torch.autograd.grad((ref * upstream).sum(), pred)
    torch.testing.assert_close(grad_got, grad_ref)


def test_quantile_huber_gradcheck_and_fp32():
    torch.manual_seed(2)
    target = torch.randn(3, 5, 2, dtype=torch.float64)
    taus = torch.rand(3, 4, dtype=torch.float64)
    pred = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p: quantile_huber_loss(p, target, taus, 1.0), (pred,))
    pred32 = torch.randn(16, 64, 3) * 5
    target32, taus32 = torch.randn(16, 64, 3) * 5, torch.rand(16, 64)
    got = quantile_huber_loss(pred32, target32, taus32, 1.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, quantile_huber_reference(pred32, target32, taus32, 1.0), rtol=1e-5, atol=1e-5)


def test_quantile_huber_rejects_bad_shapes_and_kappa():
    with pytest.raises(ValueError):
        quantile_huber_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), kappa=0.0)
    with pytest.raises(ValueError):
        quantile_huber_loss(torch.zeros(2, 3, 2), torch.zeros(2, 4, 3), torch.zeros(2, 3), 1.0)


def test_expectile_loss():
    diff = torch.tensor([-2.0, -0.5, 0.0, 0.5, 2.0])
    got = reference.expectile_loss(diff, 0.7)
    torch.testing.assert_close(got, torch.tensor([0.3 * 4, 0.3 * 0.25, 0.0, 0.7 * 0.25, 0.7 * 4]))


def reference_losses(c51_target, log_probs, iqn, v, v_target, weight, loss_weights, expectile):
    """The weighted loss as autograd's plain lines (the learner's before ``weighted_losses``)."""
    cross_entropy = -(c51_target * log_probs).sum(-1)  # [B, br]
    c51 = cross_entropy.mean(-1)  # [B]
    iql = reference.expectile_loss(v_target - v, expectile)  # [B]
    means = torch.stack([(weight * c51).mean(), (weight * iqn).mean(), (weight * iql).mean()])  # [3]
    return (means * loss_weights).sum(), means, c51


ORACLES = {"operator": weighted_losses, "plain function": reference.weighted_losses}


@pytest.mark.parametrize("function", ORACLES)
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_weighted_losses_equal_autograds_lines_and_their_gradients(v_dtype, function):
    generator = torch.Generator().manual_seed(0)
    batch, branches, atoms = 64, 3, 11
    c51_target = torch.softmax(torch.randn(batch, branches, atoms, generator=generator), -1)  # [B, br, A]
    logits = torch.randn(batch, branches, atoms, generator=generator)
    iqn = torch.rand(batch, generator=generator)  # [B]
    v = torch.randn(batch, generator=generator).to(v_dtype)  # [B]
    v_target = torch.randn(batch, generator=generator)  # [B]: both signs of the difference
    weight = torch.rand(batch, generator=generator) + 0.1  # [B]
    loss_weights = torch.tensor([1.0, 0.5, 2.0])
    runs = []
    for losses in (ORACLES[function], reference_losses):
        inputs = [logits.clone().requires_grad_(), iqn.clone().requires_grad_(), v.clone().requires_grad_()]
        log_probs = torch.log_softmax(inputs[0], -1)
        loss, means, priorities = losses(c51_target, log_probs, inputs[1], inputs[2], v_target, weight, loss_weights,
                                         0.7)
        loss.backward()
        runs.append((loss, means, priorities, *[tensor.grad for tensor in inputs]))
    for got, expected in zip(*runs, strict=True):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-6 if got.dtype == torch.float32 else 1e-2, atol=1e-7)
    loss, means, priorities = runs[0][:3]
    torch.testing.assert_close(loss, means @ loss_weights)
    assert not means.requires_grad and not priorities.requires_grad


@pytest.mark.parametrize("function", ORACLES)
def test_weighted_losses_follow_the_importance_weights(function):
    """A sample of weight 0 moves nothing; doubling every weight doubles the loss and every gradient."""
    c51_target = torch.softmax(torch.randn(4, 2, 5), -1)
    log_probs = torch.log_softmax(torch.randn(4, 2, 5), -1).requires_grad_()
    iqn, v = torch.rand(4).requires_grad_(), torch.randn(4).requires_grad_()
    weight, loss_weights = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(3)
    loss, _, _ = ORACLES[function](c51_target, log_probs, iqn, v, torch.randn(4), weight, loss_weights, 0.7)
    loss.backward()
    assert log_probs.grad[1].abs().sum() == 0 and iqn.grad[1] == 0 and v.grad[1] == 0
    assert torch.all(iqn.grad[[0, 2, 3]] == 0.25)  # d mean_B(w * iqn) / d iqn_i = w_i / B
