"""Device memory of data-parallel training: the gradient all-reduce buffer and NCCL's own buffers.

- ``all_reduce``: the gradients are copied into one flat buffer per dtype and all-reduced there (one
  collective per update, ``fitdqn.train.distributed.GradientAllReduce``), so the buffer is exactly the
  gradients' bytes, taken from the real parameters by the caller. It lives in PyTorch's allocator.
- ``nccl``: what NCCL allocates for itself, outside PyTorch's allocator (cuMem), per communicator: for every
  channel and every connection to a peer, one FIFO per protocol. The sizes are NCCL's defaults in
  ``src/init.cc`` (``DEFAULT_BUFFSIZE`` 4 MiB for Simple; ``DEFAULT_LL_BUFFSIZE`` = 8 lines x 512 threads x
  8 steps x 16 B = 512 KiB; ``DEFAULT_LL128_BUFFSIZE`` = 120 elements x 640 threads x 8 steps x 8 B =
  4,800 KiB), each overridden by ``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE`` as NCCL reads
  them. One connection's FIFOs are one allocation rounded up to cuMem's 2 MiB granularity: 10 MiB, the
  ``10485760``-byte allocations ``NCCL_DEBUG_SUBSYS=ALLOC`` shows per channel on 8 x H100 (NVIDIA/nccl#1685).
  Channels: at most ``MAXCHANNELS`` = 32 (``src/include/device.h``; the 32 channels of that same report),
  capped by ``NCCL_MAX_NCHANNELS`` / ``NCCL_MAX_CTAS``. Connections per channel: the ring receives from one
  peer, the tree (a chain within a node) from up to two; an all-reduce may use both algorithms, so 3 are
  budgeted (the upper bound: NCCL connects an algorithm when it is first used). NVLink SHARP (multicast)
  buffers are not counted: fitdqn turns it off (``NCCL_NVLS_ENABLE=0`` unless set). On top of the FIFOs, what
  creating the communicator itself takes outside the allocator (its kernels and device structures):
  ``NCCL_INIT_BYTES``, the driver's free memory drop less PyTorch's reserved bytes across
  ``init_process_group`` and a first all-reduce at world size 1 (no peers, so no FIFOs), measured on an H200 with
  NCCL 2.28.9 and torch 2.11.0+cu130. Gloo (the CPU) takes no device memory.

A job of one rank (torchrun with one process) makes no all-reduce (no ``all_reduce``), but its NCCL communicator
still takes ``NCCL_INIT_BYTES``. A process outside torchrun has no components: do not call this for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fitdqn.memory.component import Component, ComponentName

ALLREDUCE = ComponentName.ALL_REDUCE
NCCL = ComponentName.NCCL

NCCL_SIMPLE_BUFFSIZE = 1 << 22  # DEFAULT_BUFFSIZE (src/init.cc)
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x line bytes
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8
NCCL_MAX_CHANNELS = 32  # MAXCHANNELS (src/include/device.h)
NCCL_GRANULARITY = 2 << 20  # cuMem allocation granularity NCCL rounds each connection's buffers up to
NCCL_CONNECTIONS_PER_CHANNEL = 3  # ring: 1 receiving connection; tree (chain in a node): up to 2
NCCL_INIT_BYTES = 681_574_400  # 650 MiB: communicator init, world size 1, measured (H200, NCCL 2.28.9, torch 2.11)
NCCL_INIT_SOURCE = "650 MiB communicator init measured on an H200 (NCCL 2.28.9, torch 2.11, world size 1)"


def _env_int(environ: Mapping[str, str], key: str, default: int) -> tuple[int, bool]:
    text = environ.get(key, "").strip()
    if not text:
        return default, False
    try:
        return int(text), True
    except ValueError:
        return default, False  # NCCL ignores a value it cannot read, too


def nccl_bytes(world_size: int, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Bytes NCCL allocates on each rank's device for one communicator of ``world_size`` ranks (its init and its
    connections' FIFOs), and how."""
    if world_size <= 1:
        return NCCL_INIT_BYTES, f"NCCL: {NCCL_INIT_SOURCE}; one rank: no peer connections"
    environ = os.environ if environ is None else environ
    sizes = []
    notes = []
    for key, default in (("NCCL_BUFFSIZE", NCCL_SIMPLE_BUFFSIZE), ("NCCL_LL_BUFFSIZE", NCCL_LL_BUFFSIZE),
                         ("NCCL_LL128_BUFFSIZE", NCCL_LL128_BUFFSIZE)):
        value, given = _env_int(environ, key, default)
        sizes.append(value)
        if given:
            notes.append(f"{key}={value}")
    channels = NCCL_MAX_CHANNELS
    for key in ("NCCL_MAX_NCHANNELS", "NCCL_MAX_CTAS"):
        value, given = _env_int(environ, key, channels)
        if given and 0 < value < channels:
            channels = value
            notes.append(f"{key}={value}")
    per_connection = -(-sum(sizes) // NCCL_GRANULARITY) * NCCL_GRANULARITY
    total = NCCL_INIT_BYTES + channels * NCCL_CONNECTIONS_PER_CHANNEL * per_connection
    sizes_from = ", ".join(notes) if notes else "NCCL defaults"
    text = (f"NCCL: {NCCL_INIT_SOURCE}, + {channels} channels x {NCCL_CONNECTIONS_PER_CHANNEL} connections (ring + "
            f"tree) x {per_connection >> 20} MiB (Simple + LL + LL128 FIFOs, {sizes_from}, 2 MiB granularity)")
    return total, text


def distributed_components(world_size: int, gradient_bytes: int, device_kind: str,
                           environ: Mapping[str, str] | None = None) -> list[Component]:
    """The memory a rank of a ``world_size``-rank job adds: the all-reduce buffer (``gradient_bytes``, the
    gradients of every trainable parameter, from the real parameters; none at one rank, which makes no
    all-reduce) and, on CUDA, NCCL's own memory. Only for a process of a torchrun job (module docstring)."""
    components = [] if world_size <= 1 else [
        Component(ALLREDUCE, int(gradient_bytes), 0,
                  f"one flat copy of the gradients for the all-reduce ({world_size} ranks)")]
    if device_kind == "cuda":
        nbytes, text = nccl_bytes(world_size, environ)
        components.append(Component(NCCL, nbytes, 0, text))
    return components
