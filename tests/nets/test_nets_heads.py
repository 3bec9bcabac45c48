"""Trunk attention, dueling aggregation, branch padding, the heads' operators against their plain references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support.reference.nets import c51_head, dueling, iqn_head
from support.reference.nets import fold as plain_fold

from fitdqn.config import NetConfig
from fitdqn.nets import BranchingDuelingC51, IQNHead, LastTokenAttention, QNetwork, ValueNet
from fitdqn.ops.fold import folded_output
from fitdqn.ops.iqn import CHUNK, chunked_quantile_grads, chunked_quantiles, cosine_embedding, iqn_quantile_head

SMALL = NetConfig(window=4, trunk_hidden=32, d_model=16, attention_heads=4, stream_hidden=16, num_atoms=11,
                  iqn_embedding=8, iqn_quantiles=8, iqn_act_quantiles=4, iql_hidden=16)


def test_dueling_aggregation_matches_formula():
    torch.manual_seed(0)
    value, advantage = torch.randn(4, 11), torch.randn(4, 5, 11)
    out = dueling(value, advantage)
    for b in range(4):
        for a in range(5):
            expected = value[b] + advantage[b, a] - advantage[b].mean(dim=0)
            torch.testing.assert_close(out[b, a], expected)
    # the advantage part has zero mean over sub-actions: the mean over actions is the value stream
    torch.testing.assert_close(out.mean(dim=1), value)


def test_c51_head_shapes_and_padding_of_unequal_branches():
    torch.manual_seed(0)
    head = BranchingDuelingC51(16, 8, (5, 3, 4), 11)
    logits = head(torch.randn(6, 16))
    assert logits.shape == (6, 3, 5, 11)
    assert torch.all(logits[:, 1, 3:] == 0) and torch.all(logits[:, 2, 4:] == 0)
    net = QNetwork(NetConfig(**{**SMALL.__dict__, "branches": (5, 3, 4)}), state_dim=10)
    q = torch.randn(200, 3, 5)
    q[:, 1, 3:] = 100.0  # padded sub-actions must never win
    q[:, 2, 4] = 100.0
    greedy = net.greedy(q)
    assert torch.all(greedy[:, 1] < 3) and torch.all(greedy[:, 2] < 4)


def full_self_attention_last_row(block: LastTokenAttention, tokens: torch.Tensor) -> torch.Tensor:
    """Reference: full W x W multi-head self-attention with explicit weights, then the last token."""
    batch, window, d = tokens.shape
    heads, dh = block.heads, d // block.heads
    q = block.query(tokens).view(batch, window, heads, dh).transpose(1, 2)  # [B, H, W, dh]
    k, v = block.key_value(tokens).view(batch, window, 2, heads, dh).unbind(2)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)  # [B, H, W, W]
    out = (weights @ v).transpose(1, 2).reshape(batch, window, d)  # [B, W, d]
    return F.layer_norm(tokens + block.out(out), (d,), block.norm.weight, block.norm.bias)[:, -1]


def test_last_token_attention_is_the_last_row_of_full_self_attention():
    torch.manual_seed(0)
    block = LastTokenAttention(16, 4)
    tokens = torch.randn(5, 6, 16)
    torch.testing.assert_close(block(tokens), full_self_attention_last_row(block, tokens))


def test_cosine_embedding():
    taus = torch.tensor([[0.0, 0.25, 1.0]])
    frequencies = math.pi * torch.arange(4.0)
    emb = cosine_embedding(taus, frequencies)
    assert emb.shape == (1, 3, 4)
    torch.testing.assert_close(emb[0, 1], torch.cos(math.pi * torch.arange(4.0) * 0.25))


@pytest.mark.parametrize("quantiles", [8, CHUNK, 2 * CHUNK + 3])  # one chunk, exactly one, three (a short last)
def test_iqn_head_matches_plain_autograd(quantiles):
    torch.manual_seed(0)
    head = IQNHead(16, 8, 15).double()
    features = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    taus = torch.rand(4, quantiles, dtype=torch.float64)
    upstream = torch.randn(4, quantiles, 15, dtype=torch.float64)
    out = head(features, taus)
    grads = torch.autograd.grad((out * upstream).sum(), [features, *head.parameters()])
    ref = iqn_head(head, features, taus)
    grads_ref = torch.autograd.grad((ref * upstream).sum(), [features, *head.parameters()])
    torch.testing.assert_close(out.double(), ref.double())
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk", [1, 3, 8, 20])
def test_chunked_maths_is_the_same_at_any_chunk(chunk):
    """The CPU kernels' chunk only bounds the transients: every chunk gives the one-chunk values (fp64)."""
    torch.manual_seed(0)
    head = IQNHead(16, 8, 15).double()
    features, taus = torch.randn(4, 16, dtype=torch.float64), torch.rand(4, 9, dtype=torch.float64)
    grad_out = torch.randn(4, 9, 15, dtype=torch.float64)
    params = (head.frequencies.double(), head.embed.weight, head.embed.bias, head.out.weight)
    with torch.no_grad():
        whole = chunked_quantiles(features, taus, *params, head.out.bias, torch.float64, chunk=9)
        torch.testing.assert_close(chunked_quantiles(features, taus, *params, head.out.bias, torch.float64,
                                                     chunk=chunk), whole)
        for got, want in zip(chunked_quantile_grads(grad_out, features, taus, *params, torch.float64, chunk=chunk),
                             chunked_quantile_grads(grad_out, features, taus, *params, torch.float64, chunk=9),
                             strict=True):
            torch.testing.assert_close(got, want)


def test_iqn_operator_gradcheck():
    torch.manual_seed(0)
    head = IQNHead(6, 4, 5).double()
    features = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    taus = torch.rand(3, 5, dtype=torch.float64)
    params = [p.detach().requires_grad_() for p in head.parameters()]

    def fn(x, w1, b1, w2, b2):
        return iqn_quantile_head(x, taus, head.frequencies.double(), w1, b1, w2, b2, torch.float64)

    assert torch.autograd.gradcheck(fn, (features, *params))


def test_iqn_head_under_bf16_autocast_is_close_to_reference():
    torch.manual_seed(0)
    head = IQNHead(16, 8, 15)
    features = torch.randn(4, 16)
    taus = torch.rand(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, ref = head(features, taus), iqn_head(head, features, taus)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, ref, atol=3e-2, rtol=3e-2)


def test_qnetwork_and_value_net_shapes():
    torch.manual_seed(0)
    net = QNetwork(SMALL, state_dim=10)
    obs = torch.randn(3, SMALL.window, 10)
    features = net.features(obs)
    assert features.shape == (3, SMALL.d_model)
    logits = net.c51_logits(features)
    assert logits.shape == (3, 3, 5, SMALL.num_atoms)
    q = net.q_values(logits)
    assert q.shape == (3, 3, 5) and torch.all(q.abs() <= SMALL.v_max)
    assert net.quantiles(features, torch.rand(3, 7)).shape == (3, 7, 3, 5)
    assert ValueNet(10, 16)(obs[:, -1]).shape == (3,)


@pytest.mark.parametrize("branches", [(5, 5, 5), (5, 3, 4), (2,)])
def test_folded_c51_head_equals_per_branch_dueling_with_the_same_gradients(branches):
    torch.manual_seed(0)
    head = BranchingDuelingC51(16, 8, branches, 11).double()
    features = torch.randn(7, 16, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(7, len(branches), max(branches), 11, dtype=torch.float64)
    folded, plain = head(features), c51_head(head, features)
    torch.testing.assert_close(folded, plain)
    params = [features, *head.parameters()]
    grads_folded = torch.autograd.grad((folded * upstream).sum(), params)
    grads_plain = torch.autograd.grad((plain * upstream).sum(), params)
    for got, expected in zip(grads_folded, grads_plain, strict=True):
        torch.testing.assert_close(got, expected)
    # the padding rows of the output layers (aligned widths) never get a gradient
    by_name = dict(zip([name for name, _ in head.named_parameters()], grads_folded[1:], strict=True))
    for index, n in enumerate(branches):
        assert torch.all(by_name[f"advantages.{index}.weight"][n * 11:] == 0)
    assert torch.all(by_name["value.weight"][11:] == 0)


def _output_layers(head: BranchingDuelingC51) -> list[torch.Tensor]:
    """The fold's parameters, in its order, with the padding rows made non-zero (the fold must not read them)."""
    params = [head.value.weight, head.value.bias, *[layer.weight for layer in head.advantages],
              *[layer.bias for layer in head.advantages]]
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p))
    return params


@pytest.mark.parametrize(("branches", "atoms", "hidden"), [((5, 5, 5), 51, 64), ((3, 5, 2), 11, 8)])
def test_folded_output_equals_the_plain_fold_with_the_same_gradients(branches, atoms, hidden):
    torch.manual_seed(0)
    head = BranchingDuelingC51(16, hidden, branches, atoms)
    assert head.padding_rows > 0
    params = _output_layers(head)
    weight, bias = head._fold()  # [rows, (1 + br) h], [rows]
    expected_weight, expected_bias = plain_fold(head)
    tight = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(weight, expected_weight, **tight)
    torch.testing.assert_close(bias, expected_bias, **tight)
    upstream_weight, upstream_bias = torch.randn_like(weight), torch.randn_like(bias)  # padding rows too
    grads = torch.autograd.grad((weight * upstream_weight).sum() + (bias * upstream_bias).sum(), params)
    expected = torch.autograd.grad(
        (expected_weight * upstream_weight).sum() + (expected_bias * upstream_bias).sum(), params)
    for p, got, want in zip(params, grads, expected, strict=True):
        assert got.shape == p.shape
        torch.testing.assert_close(got, want, **tight)
    # the padding rows of the output layers (aligned widths) get exact zeros
    assert torch.all(grads[0][atoms:] == 0) and torch.all(grads[1][atoms:] == 0)
    for index, n in enumerate(branches):
        assert torch.all(grads[2 + index][n * atoms:] == 0)
        assert torch.all(grads[2 + len(branches) + index][n * atoms:] == 0)


@pytest.mark.parametrize("branches", [(5, 5, 5), (3, 5, 2)])
def test_folded_output_without_a_graph_and_under_autocast(branches):
    torch.manual_seed(0)
    head = BranchingDuelingC51(16, 8, branches, 11)
    _output_layers(head)
    expected_weight, expected_bias = plain_fold(head)
    with torch.no_grad():  # the target network's pass
        weight, bias = head._fold()
    assert weight.grad_fn is None and not weight.requires_grad and not bias.requires_grad
    torch.testing.assert_close(weight, expected_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias, expected_bias, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 parameters: the fold stays in fp32
        weight, bias = head._fold()
    assert weight.dtype == bias.dtype == torch.float32
    torch.testing.assert_close(weight, expected_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bias, expected_bias, rtol=1e-6, atol=1e-6)


def test_folded_output_gradcheck():
    torch.manual_seed(0)
    head = BranchingDuelingC51(4, 2, (2, 3), 3).double()
    params = [p.detach().clone().requires_grad_() for p in _output_layers(head)]
    branches = len(head.branches)

    def fold(value_weight, value_bias, *advantages):
        return folded_output(value_weight, value_bias, list(advantages[:branches]), list(advantages[branches:]),
                             head.branches, head.atoms, head.padding_rows)

    assert torch.autograd.gradcheck(fold, params)
