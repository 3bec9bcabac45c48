"""CUDA-graph capture of the update (``fitdqn.device.graphs.capture_graph``, the one capture path): the graphed
step equals the eager one (GPU only)."""

from __future__ import annotations

import copy

import pytest
import torch
from learn_helpers import make_batch, make_learner, small_config
from support.graphs import capture_update

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


@cuda
@pytest.mark.parametrize("options", [{}, {"target_update": "hard", "target_period": 2}, {"precision": "fp32"}])
def test_graphed_update_equals_eager(options):
    config = small_config(**options)
    eager, graphed = make_learner(0, "cuda", config), make_learner(0, "cuda", config)
    batches = [make_batch(64, seed=s, device="cuda") for s in range(3)]
    before = copy.deepcopy(graphed.state_dict())
    step = capture_update(graphed, batches[0])
    for key, value in graphed.state_dict()["online"].items():  # capture left the learner as it was
        assert torch.equal(value, before["online"][key]), key
    assert int(graphed.step) == 0
    for seed, batch in enumerate(batches):
        torch.manual_seed(100 + seed)
        expected = eager.update(batch)
        torch.manual_seed(100 + seed)
        got = step(batch)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)
    for a, b in zip(eager.params, graphed.params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(eager.target_params, graphed.target_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert int(graphed.step) == 3


@cuda
def test_act_is_capturable():
    learner = make_learner(0, "cuda")
    obs = make_batch(32, device="cuda")["obs"]
    epsilon = torch.tensor(0.0, device="cuda")
    expected = learner.act(obs, epsilon)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        learner.act(obs, epsilon)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        actions = learner.act(obs, epsilon)
    graph.replay()
    assert torch.equal(actions, expected)
