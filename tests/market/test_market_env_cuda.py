"""CUDA only: the env step captured in a CUDA graph and replayed matches the eager step exactly, and random
resets keep drawing fresh numbers on replay (the env's generator registered with the graph)."""

from __future__ import annotations

import pytest
import torch
from support.env import market_env

from fitdqn.config import Config
from fitdqn.market.loader import load_market
from fitdqn.transitions import EPISODE_END

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_graph_replay_matches_eager():
    device = torch.device("cuda")
    market = load_market(Config().market, window=8, device=device)
    E, steps, warm, L = 512, 100, 3, 16
    g = torch.Generator(device=device).manual_seed(0)
    actions = torch.randint(0, 5, (warm + steps, E, 3), device=device, generator=g)
    eager = market_env(market, "train", num_envs=E, episode_length=L, seed=3)
    graphed = market_env(market, "train", num_envs=E, episode_length=L, seed=3)
    static = torch.zeros(E, 3, dtype=torch.long, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(warm):
            eager.step(actions[k])
            static.copy_(actions[k])
            graphed.step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(graphed.generator)
    with torch.cuda.graph(graph):
        out_graph = graphed.step(static)
    starts = []
    for k in range(warm, warm + steps):
        out = eager.step(actions[k])
        static.copy_(actions[k])
        graph.replay()
        for key in ("bar", "agent", "reward", "achieved", "next_agent", "flags", "current_bar"):
            assert torch.equal(out[key], out_graph[key]), (k, key)
        if bool(((out_graph["flags"] & EPISODE_END) != 0).any()):
            starts.append(out_graph["current_bar"].clone())
    assert len(starts) >= 5 and len({tuple(s[:32].tolist()) for s in starts}) == len(starts)
