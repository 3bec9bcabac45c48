"""The CUDA fast paths against the eager torch reference (skipped without CUDA)."""

import pytest
import torch
from support.replay_reference import FakeEnv, buffer_options, goal_reward, transition_spec

from fitdqn.ops import sum_tree as sum_tree_ops
from fitdqn.replay import ReplayBuffer, SumTree

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.skipif(not sum_tree_ops.available(torch.device("cuda")) if torch.cuda.is_available()
                    else True, reason="needs Triton")
@pytest.mark.parametrize("fanout", [2, 16, 24, 64])
def test_triton_rebuild_matches_torch(fanout):
    torch.manual_seed(fanout)
    n = 100_003
    fast, ref = SumTree(n, fanout, "cuda", use_triton=True), SumTree(n, fanout, "cuda", use_triton=False)
    for _ in range(20):
        index = torch.randint(0, n, (4096,), device="cuda")
        values = torch.rand(4096, device="cuda", dtype=torch.float64)
        fast.update_max(index, values)
        ref.update_max(index, values)
    assert torch.equal(fast.leaves, ref.leaves)
    for a, b in zip(fast.levels, ref.levels, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)


@cuda
def test_compiled_sampling_matches_eager():
    env = FakeEnv(64, 12, 0.05, seed=3)
    buffer = ReplayBuffer(transition_spec(), 64 * 30, 64, **buffer_options(
        n_step=3, gamma=0.95, episode_length=12, device="cuda"), goal_reward=goal_reward)
    for _ in range(45):
        buffer.write({k: v.cuda() for k, v in env.step().items()})
    buffer.update_priorities(torch.arange(0, 1500, 7, device="cuda"), torch.rand(215, device="cuda"))
    uniform = torch.rand(2048, 3, device="cuda", dtype=torch.float64)
    beta = torch.tensor(0.6, device="cuda", dtype=torch.float64)
    eager = buffer.batch_from_uniforms(uniform, beta)
    buffer.use_compiled(True)
    compiled = buffer.batch_from_uniforms(uniform, beta)
    assert torch.equal(eager["index"], compiled["index"])
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-5, atol=1e-6)


@cuda
def test_sample_and_update_capture_in_a_cuda_graph():
    env = FakeEnv(32, 10, 0.05, seed=4)
    buffer = ReplayBuffer(transition_spec(), 32 * 20, 32, **buffer_options(
        n_step=3, gamma=0.99, episode_length=10, device="cuda", compile=True), goal_reward=goal_reward)
    for _ in range(25):
        buffer.write({k: v.cuda() for k, v in env.step().items()})
    beta = torch.tensor(0.5, device="cuda", dtype=torch.float64)
    rows = {k: v.cuda() for k, v in env.step().items()}

    def step():
        batch = buffer.sample(256, beta)
        buffer.update_priorities(batch["index"], batch["reward"].abs())
        buffer.write(rows)
        return batch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch = step()
    written = int(buffer.storage.written)
    graph.replay()
    graph.replay()
    assert int(buffer.storage.written) == written + 2
    assert batch["weight"].shape == (256,) and torch.isfinite(batch["reward"]).all()
    leaves = buffer.sampler.tree.leaves
    assert float(buffer.sampler.tree.total()) == pytest.approx(float(leaves.sum()), rel=1e-12)
