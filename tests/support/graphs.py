"""``Learner.update`` captured in a CUDA graph over static input buffers, for tests that compare it with the eager
update. The capture is ``fitdqn.device.graphs.capture_graph``, the one capture path (the trainer's too)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fitdqn.device.graphs import capture_graph
from fitdqn.learn.learner import Learner


@dataclass
class CapturedUpdate:
    """``step(batch) -> outputs``: copies ``batch`` into ``static_batch`` and replays ``graph``. The outputs are the
    graph's static tensors: the next call overwrites them."""

    graph: torch.cuda.CUDAGraph
    static_batch: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for key, value in self.static_batch.items():
            value.copy_(batch[key], non_blocking=True)
        self.graph.replay()
        return self.outputs


def capture_update(learner: Learner, example_batch: dict[str, torch.Tensor], warmup: int = 3) -> CapturedUpdate:
    """Capture one ``learner.update`` on copies of ``example_batch`` (CUDA). The warm-up updates are real ones:
    the learner's state is put back in place after the capture, so it is left as it was."""
    static_batch = {key: value.detach().clone() for key, value in example_batch.items()}
    snapshot = copy.deepcopy(learner.state_dict())
    graph, outputs = capture_graph(lambda: learner.update(static_batch), learner.device, warmup=warmup)
    learner.load_state_dict(snapshot)
    return CapturedUpdate(graph, static_batch, outputs)
