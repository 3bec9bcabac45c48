"""One way to capture a step in a CUDA graph, used by every capture in fitdqn.

Warm-up steps run eagerly on the capture stream (so cuBLAS makes that stream's workspaces outside the graph
and lazy initialisation happens before capture); then the warm-up's cached blocks go back to the driver
(while capturing, the allocator keeps them, so the card would hold them and the graph's pool at once);
then one call is captured on the same stream.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch


def capture_graph(step: Callable[[], Any], device: torch.device, stream: torch.cuda.Stream | None = None,
                  warmup: int = 2, generators: Iterable[torch.Generator | None] = (),
                  pool: tuple | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``step`` up ``warmup`` times, capture one call; returns the graph and that call's outputs.

    The warm-up calls are real calls (their effects stand). ``generators`` (custom ones; the default
    generator is handled by PyTorch) are registered so each replay draws fresh numbers.
    """
    stream = stream or torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)  # host sync: the warm-up is done before its cached blocks are freed
    gc.collect()
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        if generator is not None:
            graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = step()
    return graph, outputs


def captured_pool_bytes(graph: torch.cuda.CUDAGraph) -> int:
    """Bytes of the segments in the graph's private pool (``torch.cuda.memory_snapshot``)."""
    pool_id = tuple(graph.pool())
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", ())) == pool_id)
