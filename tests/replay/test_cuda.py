"""The replay on CUDA against the torch maths (skipped without CUDA)."""

import pytest
import torch
from support.replay_reference import FakeEnv, buffer_options, goal_reward, transition_spec, update_max

from fitdqn.ops import prioritized as prioritized_ops
from fitdqn.ops import replay_gather as replay_gather_ops
from fitdqn.ops import sum_tree as sum_tree_ops
from fitdqn.replay import ReplayBuffer, SumTree

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.skipif(not sum_tree_ops.available(torch.device("cuda")) if torch.cuda.is_available()
                    else True, reason="needs Triton")
@pytest.mark.parametrize("fanout", [2, 16, 24, 64])
def test_triton_rebuild_matches_torch(fanout):
    """The tree's rebuild on CUDA (the Triton kernel) against the torch maths on copies of the same levels."""
    torch.manual_seed(fanout)
    n = 100_003
    fast = SumTree(n, fanout, "cuda")
    ref = [level.clone() for level in fast.levels]
    for _ in range(20):
        index = torch.randint(0, n, (4096,), device="cuda")
        values = torch.rand(4096, device="cuda", dtype=torch.float64)
        update_max(fast, index, values)
        ref[-1].scatter_reduce_(0, index, values, reduce="amax", include_self=False)
        sum_tree_ops.propagate_reference(ref, index, fanout)
    assert torch.equal(fast.leaves, ref[-1])
    for a, b in zip(fast.levels, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)


@cuda
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "torch-maths"])
def test_sample_and_update_capture_in_a_cuda_graph(triton, monkeypatch):
    """The replay's step in a CUDA graph, with its operators' Triton kernels and with Triton off (their CUDA kernels
    then run the torch maths, which must be capturable too)."""
    if not triton:
        for module in (prioritized_ops, replay_gather_ops, sum_tree_ops):
            monkeypatch.setattr(module, "triton_available", lambda: False)
    elif not sum_tree_ops.triton_available():
        pytest.skip("needs Triton")
    env = FakeEnv(32, 10, 0.05, seed=4)
    buffer = ReplayBuffer(transition_spec(), 32 * 20, 32, **buffer_options(
        n_step=3, gamma=0.99, episode_length=10, device="cuda"), goal_reward=goal_reward)
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
