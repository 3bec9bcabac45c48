"""cuBLAS and cuBLASLt workspaces made first, so that they sit at the start of each stream's memory.

PyTorch allocates one cuBLAS and one cuBLASLt workspace per (handle, stream), through its caching allocator, at
the first product on that stream (``fitdqn.memory.overhead`` sizes them). Made lazily, in the middle of a step,
such a block lands anywhere in the stream's segment: with expandable segments (20 MiB pages) a 32 MiB workspace
at an unaligned offset keeps three pages (60 MiB) mapped after ``empty_cache``, and which pages depends on what
ran before it. :func:`reserve_blas_workspaces` runs one plain product (cuBLAS) and one with a bias epilogue
(cuBLASLt) on each of the run's streams before anything else is allocated there, so the workspaces are each
stream's first blocks, one after the other: on the default stream the replay follows them in the same pages,
on the capture stream they take their size rounded up to whole pages (what the plan budgets).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PRODUCT_SIZE = 16  # rows and columns of the products that make the workspaces (a few KiB, small pool)


def reserve_blas_workspaces(device: torch.device, streams: Iterable[torch.cuda.Stream | None]) -> None:
    """On each of ``streams`` (None: the current stream), make its cuBLAS and cuBLASLt workspaces now."""
    if device.type != "cuda":
        return
    # bf16 products only where cuBLAS has them (compute capability 8.0 on): elsewhere they would raise
    dtypes = (torch.float32, torch.bfloat16) if torch.cuda.get_device_capability(device) >= (8, 0) else (torch.float32,)
    for stream in streams:
        with torch.cuda.stream(stream or torch.cuda.current_stream(device)):
            for dtype in dtypes:
                matrix = torch.ones(PRODUCT_SIZE, PRODUCT_SIZE, device=device, dtype=dtype)
                torch.mm(matrix, matrix)  # cuBLAS
                torch.addmm(matrix[0], matrix, matrix)  # a 1-D bias: the cuBLASLt epilogue path
    torch.cuda.synchronize(device)  # host sync, once at set-up: the workspaces exist before the system is built
