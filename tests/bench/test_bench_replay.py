"""benchmarks/bench_replay.py: the plain-torch sum tree samples, gathers and updates as fitdqn's replay does."""

from __future__ import annotations

import json
import sys

import torch
from support.benchmarks import load_benchmark

from fitdqn.replay import ReplayBuffer

NUM_ENVS, EPISODE, AGENT_DIM = 16, 8, 8


def load_bench():
    return load_benchmark("bench_replay")


def filled(bench, capacity: int = 16 * 40):
    buffer = ReplayBuffer(bench.transition_spec(AGENT_DIM), capacity, NUM_ENVS, n_step=3, gamma=0.9,
                          episode_length=EPISODE, goal_column=bench.GOAL_COLUMN, goal_reward=bench.goal_reward,
                          prioritized=True, alpha=0.6, priority_eps=1e-6, her=True, her_k=4, tree_fanout=4,
                          device="cpu")
    bench.fill(buffer, EPISODE, AGENT_DIM, torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    index = torch.randint(0, capacity - 3 * NUM_ENVS, (200,), generator=generator)
    buffer.update_priorities(index, torch.rand(200, generator=generator) * 3)  # leaves of many values
    plain = bench.PlainPrioritizedReplay(buffer.storage.fields, buffer.storage.written, NUM_ENVS,
                                         buffer.sampler.tree.leaves.clone(), n_step=3, gamma=0.9,
                                         episode_length=EPISODE, goal_column=bench.GOAL_COLUMN,
                                         goal_reward=bench.goal_reward)
    return buffer, plain


def test_plain_gather_equals_fitdqns():
    bench = load_bench()
    buffer, plain = filled(bench)
    generator = torch.Generator().manual_seed(2)
    index = torch.randint(0, buffer.capacity - 3 * NUM_ENVS, (300,), generator=generator)
    uniform = torch.rand(300, 2, dtype=torch.float64, generator=generator)
    expected = buffer.gather_with_uniforms(index, uniform)
    got = plain.gather(index, uniform)
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, msg=key)


def test_plain_tree_descent_and_update():
    bench = load_bench()
    buffer, plain = filled(bench)
    leaves = buffer.sampler.tree.leaves
    torch.testing.assert_close(plain.tree[1], leaves.sum())
    edges = torch.cumsum(leaves, 0)  # [capacity]
    mass = torch.rand(500, dtype=torch.float64) * edges[-1]
    expected = torch.searchsorted(edges, mass, right=True)  # the leaf whose range [edge_{i-1}, edge_i) holds mass
    assert torch.equal(plain.locate(mass), expected)
    index = torch.tensor([3, 17, 17, 40])
    plain.update_priorities(index, torch.tensor([2.0, 0.5, 0.5, 0.0]))
    leaf = plain.tree[plain.size:plain.size + plain.capacity]
    torch.testing.assert_close(leaf[index], (torch.tensor([2.0, 0.5, 0.5, 0.0], dtype=torch.float64) + 1e-6) ** 0.6)
    torch.testing.assert_close(plain.tree[1], leaf.sum())
    batch = plain.sample(64, torch.tensor(0.4, dtype=torch.float64))
    assert (leaf[batch["index"]] > 0).all() and batch["weight"].max() == 1.0


def test_main_writes_json_on_cpu(tmp_path, monkeypatch):
    bench = load_bench()
    out = tmp_path / "replay.json"
    monkeypatch.setattr(sys, "argv", ["bench_replay.py", "--device", "cpu", "--capacities", "2048", "--batch", "64",
                                      "--iters", "1", "--warmup", "0", "--no-torchrl", "--out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["results"]
    assert {r["impl"] for r in rows} == {"fitdqn prioritized", "plain-torch sum tree", "fitdqn uniform"}
    assert all(r["samples_per_s"] > 0 for r in rows)
