"""One way to capture a step in a CUDA graph, used by every capture in fitdqn.

Warm-up steps run eagerly on the capture stream (so cuBLAS makes that stream's workspaces outside the graph
and lazy initialisation happens before capture); then the warm-up's cached blocks go back to the driver
(while capturing, the allocator keeps them, so the card would hold them and the graph's pool at once);
then one call is captured on the same stream.

``premap_bytes``: the graph's private pool is made first (a ``torch.cuda.MemPool``) and one block of that size
is allocated in it on the capture stream and freed, so its pages stay mapped and the capture takes its blocks
from them instead of growing the pool. For a process under PyTorch's per-process memory cap
(``set_per_process_memory_fraction``): before each growth of an expandable segment the capped allocator
charges the whole request on top of what is mapped, even when the growth reuses the segment's free end, and
during a capture a refused growth is an out-of-memory error (``fitdqn.memory.allocator_model``'s docstring). One
premapping is charged exactly what it maps. The block's layout inside the pool is the same either way: the
free block at a segment's mapped end is taken last whether it can grow or is already mapped.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch


def capture_graph(step: Callable[[], Any], device: torch.device, stream: torch.cuda.Stream | None = None,
                  warmup: int = 2, generators: Iterable[torch.Generator | None] = (),
                  pool: tuple | None = None, premap_bytes: int = 0) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``step`` up ``warmup`` times, capture one call; returns the graph and that call's outputs.

    The warm-up calls are real calls (their effects stand). ``generators`` (custom ones; the default
    generator is handled by PyTorch) are registered so each replay draws fresh numbers. ``premap_bytes``
    (without ``pool``): map the graph's pool to that size before capture (module docstring); the graph keeps
    that pool as ``graph.premapped_pool``.
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
    premapped = premapped_pool(premap_bytes, device, stream) if premap_bytes > 0 and pool is None else None
    graph = torch.cuda.CUDAGraph()
    graph.premapped_pool = premapped  # alive as long as the graph
    for generator in generators:
        if generator is not None:
            graph.register_generator_state(generator)
    with torch.cuda.graph(graph, pool=premapped.id if premapped is not None else pool, stream=stream):
        outputs = step()
    return graph, outputs


def premapped_pool(nbytes: int, device: torch.device, stream: torch.cuda.Stream) -> torch.cuda.MemPool:
    """A private pool whose segment on ``stream`` already maps ``nbytes``: one block allocated there and freed
    (a freed block keeps its pages until ``empty_cache``)."""
    pool = torch.cuda.MemPool()
    with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool, device):
        torch.empty(nbytes, dtype=torch.uint8, device=device)
    return pool


def captured_pool_bytes(graph: torch.cuda.CUDAGraph) -> int:
    """Bytes of the segments in the graph's private pool (``torch.cuda.memory_snapshot``)."""
    return pool_bytes(graph.pool())


def pool_bytes(pool: tuple) -> int:
    """Bytes of the segments in the private pool ``pool`` (a graph's ``pool()``; ``torch.cuda.memory_snapshot``)."""
    pool_id = tuple(pool)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", ())) == pool_id)
