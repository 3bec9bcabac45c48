"""Memory groups: every parameter in exactly one group; submodules tagged for forward hooks."""

from __future__ import annotations

import pytest
from torch import nn

from fitdqn.config import NetConfig
from fitdqn.nets import MEMORY_GROUPS, QNetwork, ValueNet, group_of, parameter_groups, tag

SMALL = NetConfig(window=4, trunk_hidden=32, d_model=16, attention_heads=4, stream_hidden=16, num_atoms=11,
                  iqn_embedding=8, iqn_quantiles=8, iqn_act_quantiles=4, iql_hidden=16)


def test_every_parameter_in_exactly_one_group():
    qnet, value = QNetwork(SMALL, 10), ValueNet(10, 16)
    groups = parameter_groups([qnet, value])
    assert tuple(groups) == MEMORY_GROUPS
    seen = [id(p) for g in groups.values() for p in g.parameters()]
    assert len(seen) == len(set(seen))
    assert set(seen) == {id(p) for p in [*qnet.parameters(), *value.parameters()]}
    assert groups["attention"].modules == (qnet.attention,)
    assert groups["iqn"].modules == (qnet.iqn,)
    assert groups["iql"].modules == (value,)
    assert groups["dqn"].modules == (qnet.tokens, qnet.c51)
    assert [g.target_copy for g in groups.values()] == [True, True, True, False]


def test_paper_sizes_of_default_heads():
    groups = parameter_groups([QNetwork(NetConfig(), 80), ValueNet(80, 128)])
    assert groups["iqn"].numel() == 64 * 256 + 256 + 256 * 15 + 15  # 20,495 as in the original plan
    assert groups["iql"].numel() == 80 * 128 + 128 + 128 * 128 + 128 + 128 + 1
    assert groups["attention"].numel() == 4 * (256 * 256 + 256) + 2 * 256
    assert groups["dqn"].parameter_bytes() == 4 * groups["dqn"].numel()


def test_submodules_are_tagged_for_hooks():
    qnet = QNetwork(SMALL, 10)
    assert group_of(qnet) is None
    assert group_of(qnet.attention.key_value) == "attention"
    assert group_of(qnet.c51.advantages[2]) == "dqn"
    assert group_of(qnet.iqn.embed) == "iqn"
    assert group_of(qnet.tokens.fc2) == "dqn"


def test_untagged_parameters_and_unknown_groups_are_errors():
    with pytest.raises(ValueError):
        parameter_groups(nn.Linear(2, 2))
    with pytest.raises(ValueError):
        tag(nn.Linear(2, 2), "replay")
