import pytest
import torch
from support.replay_reference import FakeEnv, check_rows, transition_spec

from fitdqn.replay.storage import RingStorage
from fitdqn.transitions import FieldSpec, bytes_per_transition


def test_spec_bytes():
    spec = transition_spec()
    # bar 4 + agent 6*4 + action 3 + reward 4 + achieved 4 + next_agent 24 + episode_step 4 + flags 1
    assert bytes_per_transition(spec) == 68
    assert FieldSpec((2, 3), torch.float64).row_bytes() == 48


def test_check_rows_names_the_problem():
    spec = transition_spec()
    rows = FakeEnv(4, 5).step()
    check_rows(spec, rows, 4)
    with pytest.raises(ValueError, match="agent"):
        check_rows(spec, {**rows, "agent": rows["agent"][:, :2]}, 4)
    with pytest.raises(ValueError, match="missing"):
        check_rows(spec, {k: v for k, v in rows.items() if k != "flags"}, 4)


def test_ring_layout_and_wrap():
    """Step t of env e is slot (t * E + e) % capacity, across several wraps."""
    E, capacity = 3, 12
    ring = RingStorage({"x": FieldSpec((2,), torch.int64)}, capacity, E, "cpu")
    for t in range(11):
        rows = torch.stack([torch.arange(E) + 100 * t, torch.full((E,), t)], 1)  # [E, 2]
        slots = ring.write({"x": rows})
        assert slots.tolist() == [(t * E + e) % capacity for e in range(E)]
        assert int(ring.written) == t + 1
        for e in range(E):
            assert ring.fields["x"][(t * E + e) % capacity].tolist() == [100 * t + e, t]
    # after 11 steps the ring (4 steps) holds steps 7..10
    held = sorted(set(ring.fields["x"][:, 1].tolist()))
    assert held == [7, 8, 9, 10]


def test_capacity_must_be_a_multiple_of_num_envs():
    with pytest.raises(ValueError, match="multiple"):
        RingStorage(transition_spec(), 10, 4, "cpu")
