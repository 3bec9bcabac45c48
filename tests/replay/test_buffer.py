import io

import numpy as np
import pytest
import torch
from scipy import stats
from support.replay_reference import (
    GOAL_COLUMN,
    FakeEnv,
    absolute_step,
    buffer_options,
    goal_reward,
    nstep_reference,
    transition_spec,
)

from fitdqn.replay import ReplayBuffer

GAMMA = 0.9


def filled(num_envs=4, steps=13, written=31, length=6, n_step=3, terminal=0.15, her=False,
           prioritized=True, with_goal_reward=True, terminal_sets_end=True, seed=0, observe=None):
    env = FakeEnv(num_envs, length, terminal, terminal_sets_end=terminal_sets_end, seed=seed)
    buffer = ReplayBuffer(
        transition_spec(), steps * num_envs, num_envs, **buffer_options(
            n_step=n_step, gamma=GAMMA, episode_length=length, prioritized=prioritized, her=her),
        goal_reward=goal_reward if with_goal_reward else None, observe=observe,
    )
    for _ in range(written):
        buffer.write(env.step())
    return buffer, env


def valid_slots(buffer, written):
    """Slots of steps max(0, T - S) .. T - n (the sampleable window), by a plain loop."""
    steps, E = buffer.storage.steps, buffer.num_envs
    return {(s % steps) * E + e for s in range(max(0, written - steps), written - buffer.n_step + 1)
            for e in range(E)}


@pytest.mark.parametrize("written", [1, 2, 3, 5, 13, 14, 30])
def test_only_complete_windows_have_priority(written):
    buffer, _ = filled(written=written)
    leaves = buffer.sampler.tree.leaves[: buffer.capacity]
    live = set(torch.nonzero(leaves > 0).flatten().tolist())
    assert live == valid_slots(buffer, written)
    assert int(buffer.sampleable()) == len(live)


@pytest.mark.parametrize("terminal_sets_end", [True, False])
@pytest.mark.parametrize("n_step", [1, 3, 5])
def test_nstep_matches_loop_reference(n_step, terminal_sets_end):
    written = 40
    buffer, env = filled(written=written, n_step=n_step, terminal=0.2, terminal_sets_end=terminal_sets_end)
    index = torch.tensor(sorted(valid_slots(buffer, written)))
    batch = buffer.gather(index)
    for b, slot in enumerate(index.tolist()):
        step, e = absolute_step(slot, buffer.num_envs, buffer.storage.steps, written)
        row = env.log[step]
        goal = float(row["agent"][e, GOAL_COLUMN])
        ret, discount, last = nstep_reference(env.log, step, e, n_step, GAMMA, goal, True)
        assert float(batch["reward"][b]) == pytest.approx(ret, abs=1e-5)
        assert float(batch["discount"][b]) == pytest.approx(discount, abs=1e-6)
        assert int(batch["bar"][b]) == row["bar"][e]
        assert int(batch["next_bar"][b]) == env.log[last]["bar"][e] + 1
        np.testing.assert_array_equal(batch["agent"][b].numpy(), row["agent"][e])
        np.testing.assert_array_equal(batch["next_agent"][b].numpy(), env.log[last]["next_agent"][e])
        np.testing.assert_array_equal(batch["action"][b].numpy(), row["action"][e])
    assert batch["action"].dtype == torch.int64 and batch["reward"].dtype == torch.float32


def test_nstep_without_goal_reward():
    buffer, env = filled(with_goal_reward=False, terminal=0.3)
    index = torch.tensor(sorted(valid_slots(buffer, 31)))
    batch = buffer.gather(index)
    for b, slot in enumerate(index.tolist()):
        step, e = absolute_step(slot, buffer.num_envs, buffer.storage.steps, 31)
        ret, discount, _ = nstep_reference(env.log, step, e, 3, GAMMA, 0.0, False)
        assert float(batch["reward"][b]) == pytest.approx(ret, abs=1e-5)
        assert float(batch["discount"][b]) == pytest.approx(discount, abs=1e-6)


@pytest.mark.parametrize("terminal", [0.0, 0.1])
def test_her_goal_is_a_future_achieved_of_the_same_episode(terminal):
    """Relabelled goal = achieved of a written step j in [s, episode end]; reward recomputed with it."""
    written = 37
    buffer, env = filled(written=written, her=True, terminal=terminal, length=7, steps=20)
    generator = torch.Generator().manual_seed(5)
    index = torch.tensor(sorted(valid_slots(buffer, written)) * 6)
    batch = buffer.gather(index, generator)
    relabelled = 0
    for b, slot in enumerate(index.tolist()):
        step, e = absolute_step(slot, buffer.num_envs, buffer.storage.steps, written)
        episode = env.log[step]["episode_id"][e]
        goal = float(batch["agent"][b, GOAL_COLUMN])
        assert float(batch["next_agent"][b, GOAL_COLUMN]) == goal
        if goal != env.log[step]["agent"][e, GOAL_COLUMN]:
            relabelled += 1
            candidates = [j for j in range(step, written)
                          if env.log[j]["episode_id"][e] == episode and env.log[j]["achieved"][e] == goal]
            assert candidates, f"slot {slot}: goal {goal} is no future achieved of its episode"
        ret, discount, _ = nstep_reference(env.log, step, e, 3, GAMMA, goal, True)
        assert float(batch["reward"][b]) == pytest.approx(ret, abs=1e-5)
        assert float(batch["discount"][b]) == pytest.approx(discount, abs=1e-6)
    # relabel probability 4 / 5
    assert abs(relabelled / len(index) - 0.8) < 0.06


def test_her_future_step_is_uniform_over_the_written_rest_of_the_episode():
    length, written = 8, 20
    buffer, env = filled(written=written, her=True, terminal=0.0, length=length, steps=20, num_envs=2)
    # env 0, step 9: episode step 1 of the episode 8..15 -> j uniform in 9..15
    slot = (9 % buffer.storage.steps) * buffer.num_envs
    assert env.log[9]["episode_step"][0] == 1
    index = torch.full((20000,), slot)
    batch = buffer.gather(index, torch.Generator().manual_seed(0))
    achieved = {float(env.log[j]["achieved"][0]): j for j in range(9, 16)}
    goals = batch["agent"][:, GOAL_COLUMN]
    own_goal = float(env.log[9]["agent"][0, GOAL_COLUMN])
    chosen = [achieved[g] for g in goals.tolist() if g != own_goal]
    counts = np.bincount(np.array(chosen) - 9, minlength=7)
    assert counts.sum() == pytest.approx(16000, rel=0.03)
    _, p_value = stats.chisquare(counts)
    assert p_value > 1e-3
    # newest written step bounds the window: env 0 step 17 has episode step 1; only 17..19 are written
    slot = (17 % buffer.storage.steps) * buffer.num_envs
    batch = buffer.gather(torch.full((3000,), slot), torch.Generator().manual_seed(1))
    allowed = {float(env.log[j]["achieved"][0]) for j in (17, 18, 19)} | {float(env.log[17]["agent"][0, 4])}
    assert set(batch["agent"][:, GOAL_COLUMN].tolist()) == allowed


def test_prioritized_sample_weights_and_updates():
    buffer, _ = filled(written=30)
    generator = torch.Generator().manual_seed(0)
    first = buffer.sample(64, 0.4, generator)
    assert torch.all(first["weight"] == 1.0)  # all at max priority
    index = first["index"]
    new = torch.rand(64) * 5
    buffer.update_priorities(index, new)
    leaves = buffer.sampler.tree.leaves
    for i in set(index.tolist()):
        expected = ((new[index == i].double().abs() + 1e-6) ** 0.6).max()
        assert float(leaves[i]) == pytest.approx(float(expected), rel=1e-12)
    assert float(buffer.sampler.max_priority) == pytest.approx(float(leaves.max()), rel=1e-12)
    batch = buffer.sample(256, 0.7, generator)
    total = float(buffer.sampler.tree.total())
    count = int(buffer.sampleable())
    weight = (count * leaves[batch["index"]] / total) ** -0.7
    np.testing.assert_allclose(batch["weight"].numpy(), (weight / weight.max()).numpy(), rtol=1e-6)
    # beta as a device tensor works the same
    again = buffer.sample(8, torch.tensor(0.7), torch.Generator().manual_seed(9))
    assert again["weight"].shape == (8,)


def test_update_never_revives_a_slot_that_left_the_window():
    buffer, env = filled(written=30)
    batch = buffer.sample(128, 0.4, torch.Generator().manual_seed(1))
    for _ in range(5):
        buffer.write(env.step())
    buffer.update_priorities(batch["index"], torch.full((128,), 3.0))
    live = set(torch.nonzero(buffer.sampler.tree.leaves > 0).flatten().tolist())
    assert live == valid_slots(buffer, 35)


def test_sampled_slots_are_always_sampleable_and_new_entries_get_max_priority():
    buffer, env = filled(written=20)
    generator = torch.Generator().manual_seed(2)
    for written in range(21, 60):
        batch = buffer.sample(32, 0.5, generator)
        assert set(batch["index"].tolist()) <= valid_slots(buffer, written - 1)
        buffer.update_priorities(batch["index"], torch.rand(32) * 10)
        buffer.write(env.step())
        entering = ((written - 3) % buffer.storage.steps) * buffer.num_envs
        entered = buffer.sampler.tree.leaves[entering:entering + buffer.num_envs]
        assert torch.all(entered == buffer.sampler.max_priority)


def test_uniform_mode_samples_the_window_uniformly():
    written = 25
    buffer, _ = filled(written=written, prioritized=False)
    allowed = sorted(valid_slots(buffer, written))
    generator = torch.Generator().manual_seed(4)
    counts = np.zeros(buffer.capacity)
    for _ in range(20):
        batch = buffer.sample(2000, 0.4, generator)
        assert torch.all(batch["weight"] == 1.0)
        counts += np.bincount(batch["index"].numpy(), minlength=buffer.capacity)
    assert set(np.nonzero(counts)[0].tolist()) == set(allowed)
    _, p_value = stats.chisquare(counts[allowed])
    assert p_value > 1e-3
    buffer.update_priorities(batch["index"], torch.rand(2000))  # a no-op, not an error
    assert buffer.sampler.tensors() == []


def test_early_fill_uniform_window():
    buffer, _ = filled(written=4, prioritized=False)
    batch = buffer.sample(500, 1.0, torch.Generator().manual_seed(0))
    assert set(batch["index"].tolist()) == valid_slots(buffer, 4)


def test_observe_callable_builds_obs():
    buffer, _ = filled(written=20, observe=lambda bar, agent: torch.cat([bar.float().unsqueeze(1), agent], 1)[:, None])
    batch = buffer.sample(16, 0.4, torch.Generator().manual_seed(0))
    assert batch["obs"].shape == (16, 1, 7)
    assert torch.equal(batch["next_obs"][:, 0, 0], batch["next_bar"].float())


def saved_and_loaded(state: dict) -> dict:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint holds it."""
    stream = io.BytesIO()
    torch.save(state, stream)
    stream.seek(0)
    return torch.load(stream, weights_only=True)


def stored_bytes(state: dict) -> int:
    """Bytes of the storages the tensors of a nested ``state`` keep alive: what ``torch.save`` writes."""
    if isinstance(state, torch.Tensor):
        return state.untyped_storage().nbytes()
    return sum(stored_bytes(value) for value in state.values()) if isinstance(state, dict) else 0


def assert_same_contents(one: ReplayBuffer, two: ReplayBuffer) -> None:
    """The same rows, step counter, tree and running max (scratch tensors apart)."""
    tensors = [[*b.storage.fields.values(), b.storage.written] for b in (one, two)]
    if one.prioritized:
        for b, listed in zip((one, two), tensors, strict=True):
            listed += [*b.sampler.tree.levels, b.sampler.max_priority]
    for a, b in zip(*tensors, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("written", [7, 13, 27], ids=["part-filled", "just-full", "wrapped"])
@pytest.mark.parametrize("prioritized", [True, False])
def test_state_dict_holds_the_filled_part_and_resumes_exactly(prioritized, written):
    """The state holds the ring's filled rows and the tree's leaves up to them, each tensor owning no more bytes
    than it shows (a view would save its whole buffer); through torch.save and back the buffer samples and updates as
    the original, bit for bit."""
    buffer, env = filled(written=written, prioritized=prioritized, her=True)  # 13 ring steps of 4 envs
    buffer.update_priorities(torch.arange(0, 20), torch.rand(20))
    state = buffer.state_dict()
    filled_slots = min(written, buffer.storage.steps) * buffer.num_envs
    assert all(t.shape[0] == filled_slots for key, t in state["storage"].items() if key.startswith("field."))
    shown = sum(t.numel() * t.element_size() for part in ("storage", "sampler") for t in state[part].values())
    assert stored_bytes(state) == shown
    if prioritized:
        tree = buffer.sampler.tree
        leaves = state["sampler"][f"tree.level{len(tree.levels) - 1}"]
        assert leaves.shape[0] == (filled_slots if filled_slots < buffer.capacity else tree.leaves.shape[0])
    fresh, _ = filled(written=0, prioritized=prioritized, her=True)
    fresh.load_state_dict(saved_and_loaded(state))
    assert_same_contents(buffer, fresh)
    rows = env.step()
    for b in (buffer, fresh):
        b.write({k: v.clone() for k, v in rows.items()})
    one = buffer.sample(64, 0.5, torch.Generator().manual_seed(7))
    two = fresh.sample(64, 0.5, torch.Generator().manual_seed(7))
    for key in one:
        assert torch.equal(one[key], two[key]), key
    for b, batch in ((buffer, one), (fresh, two)):
        b.update_priorities(batch["index"], batch["reward"].abs())
    assert_same_contents(buffer, fresh)
    other, _ = filled(written=0, steps=14)
    with pytest.raises(ValueError, match="capacity"):
        other.load_state_dict(state)


def test_capacity_too_small_for_n_step():
    with pytest.raises(ValueError, match="n_step"):
        ReplayBuffer(transition_spec(), 8, 4, **buffer_options(n_step=3))


def test_a_goal_reward_the_gather_operator_does_not_take_is_refused():
    """The gather operator takes the env's kind of goal bonus (a GoalCrossing) or none: any other callable is
    refused at construction, saying what is taken."""
    with pytest.raises(TypeError, match="GoalCrossing"):
        ReplayBuffer(transition_spec(), 40, 4, **buffer_options(n_step=3),
                     goal_reward=lambda before, after, goal: after - before)
