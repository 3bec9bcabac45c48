"""Capture ``Learner.update`` in a CUDA graph over static input buffers.

Follows PyTorch's whole-network capture recipe: warm up on a side stream (lazy cuBLAS/autotuning/Adam
work happens there, outside the graph), then capture one update. Warm-up updates are real updates, so the
learner's state (nets, target, Adam, step counter) is snapshotted before and copied back in place after
capture: the learner is left exactly as it was, and nothing the graph reads changes address.
"""

from __future__ import annotations

import copy

import torch

from fitdqn.device.graphs import capture_graph
from fitdqn.learn.learner import Learner


class GraphedUpdate:
    """Callable ``batch -> outputs``: copies ``batch`` into the static inputs and replays the graph.

    The returned dict holds the graph's static output tensors: the next call overwrites them, so clone
    what you keep. ``graph``, ``static_batch`` and ``static_outputs`` are public for callers that fill the
    inputs themselves (e.g. a replay sampler writing straight into ``static_batch``) and call ``replay``.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, static_batch: dict[str, torch.Tensor],
                 static_outputs: dict[str, torch.Tensor]) -> None:
        self.graph = graph
        self.static_batch = static_batch
        self.static_outputs = static_outputs

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for key, value in self.static_batch.items():
            value.copy_(batch[key], non_blocking=True)
        return self.replay()

    def replay(self) -> dict[str, torch.Tensor]:
        self.graph.replay()
        return self.static_outputs


def capture_update(learner: Learner, example_batch: dict[str, torch.Tensor], warmup: int = 3,
                   pool: tuple | None = None) -> GraphedUpdate:
    """Capture one ``learner.update`` on buffers shaped like ``example_batch`` (CUDA only)."""
    device = learner.device
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; the learner is on {device}")
    static_batch = {key: value.detach().to(device).clone() for key, value in example_batch.items()}
    snapshot = copy.deepcopy(learner.state_dict())
    graph, static_outputs = capture_graph(lambda: learner.update(static_batch), device, warmup=warmup, pool=pool)
    learner.load_state_dict(snapshot)  # undo the warm-up updates, in place
    return GraphedUpdate(graph, static_batch, static_outputs)
