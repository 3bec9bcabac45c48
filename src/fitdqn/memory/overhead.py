"""The `cuda_overhead` component: what CUDA and its libraries take besides our own tensors.

- CUDA context: already gone from the probed free memory (probing creates it), so it is counted only for
  what-if devices, where ``total - free`` is what the user said is in use.
- cuBLAS and cuBLASLt workspaces: PyTorch allocates one per (handle, stream) through its caching allocator.
  The size follows PyTorch's rule: ``CUBLAS_WORKSPACE_CONFIG=:SIZE_KIB:COUNT[:SIZE_KIB:COUNT...]`` if set,
  else ``:4096:8`` on compute capability 9.0 and ``:4096:2:16:8`` elsewhere; cuBLASLt gets the same size
  (``TORCH_CUBLASLT_WORKSPACE_SIZE`` in KiB overrides it). fitdqn uses ``streams`` streams (the default
  stream and the CUDA-graph capture stream).
- Driver-side bytes are the separate ``cuda_driver`` component (``cuda_driver_component``): module and kernel
  images loaded lazily, cuBLAS handles, CUDA-graph executables, none of them visible to the allocator.
  ``fitdqn profile`` measures them over a whole training process on the real card and stores them in the card's
  profile (``driver_bytes``), which the plan uses; ``fitdqn plan --calibrate`` measures them for the update alone
  (a lower bound) and the plan takes the larger of the two.

CUDA-graph pools hold the captured step's activations (the networks' per-sample bytes) plus what the caching
allocator's segments and fragmentation add on top: that slack is the separate ``cuda_graphs`` component, from
an allocator model replayed over the traced step (``fitdqn.memory.allocator_model``).
"""

from __future__ import annotations

import os

from fitdqn.device.sizes import format_bytes
from fitdqn.memory.allocator_model import LARGE_BUFFER
from fitdqn.memory.component import Component

DEFAULT_STREAMS = 2
HOPPER_RULE = ":4096:8"  # PyTorch's CUBLAS_WORKSPACE_CONFIG default on compute capability 9.0
OTHER_RULE = ":4096:2:16:8"  # ... and on every other


def parse_workspace_config(text: str) -> int:
    """``':4096:8'`` -> 4096 KiB x 8 = 33554432 bytes; pairs add up."""
    numbers = [int(part) for part in text.split(":") if part.strip()]
    if len(numbers) % 2:
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG {text!r}: expected :SIZE_KIB:COUNT pairs")
    return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2], strict=True))


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None) -> tuple[int, str]:
    """Bytes of one cuBLAS workspace, and where that number came from."""
    configured = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if configured:
        return parse_workspace_config(configured), f"CUBLAS_WORKSPACE_CONFIG={configured}"
    if compute_capability is None:  # a described GPU the card table does not know: the larger rule, safe side
        return (parse_workspace_config(HOPPER_RULE),
                f"PyTorch default {HOPPER_RULE} of sm_90 (compute capability unknown)")
    hopper = compute_capability == (9, 0)
    rule = HOPPER_RULE if hopper else OTHER_RULE
    return parse_workspace_config(rule), f"PyTorch default {rule} for sm_{'90' if hopper else 'other'}"


def cublaslt_workspace_bytes(cublas_bytes: int) -> int:
    configured = os.environ.get("TORCH_CUBLASLT_WORKSPACE_SIZE")
    return int(configured) * 1024 if configured else cublas_bytes


def cuda_overhead_component(compute_capability: tuple[int, int] | None, streams: int = DEFAULT_STREAMS,
                            expandable: bool = False) -> Component:
    """cuBLAS + cuBLASLt workspaces for ``streams`` streams.

    The trainer makes them first on each stream (``device.blas.reserve_blas_workspaces``), one after the other. On
    the default stream the replay follows them in the same segment; on each other stream (the capture stream)
    little else stays allocated, so with ``expandable`` segments its workspaces keep their size rounded up to
    whole 20 MiB pages mapped."""
    cublas, source = cublas_workspace_bytes(compute_capability)
    cublaslt = cublaslt_workspace_bytes(cublas)
    per_stream = cublas + cublaslt
    text = f"{streams} streams x (cuBLAS + cuBLASLt workspace, {source})"
    rounding = 0
    if expandable and streams > 1:
        rounding = (streams - 1) * (-(-per_stream // LARGE_BUFFER) * LARGE_BUFFER - per_stream)
        text += f" + {format_bytes(rounding)}: the capture stream's pair rounded up to whole 20 MiB pages"
    return Component("cuda_overhead", streams * per_stream + rounding, 0, text)


def cuda_driver_component(driver_bytes: int, source: str) -> Component:
    """What the driver takes outside PyTorch's allocator, as ``source`` measured it."""
    return Component("cuda_driver", driver_bytes, 0,
                     f"driver-side bytes (kernel images, cuBLAS handles, graph executables) {source}")


def profile_driver_source(profile) -> str:
    """Where a profile's ``driver_bytes`` came from, for ``derived_from``: its ``[source] driver_bytes`` text where
    it has one (a figure borrowed from another card), else the card and date of the profile's measurement."""
    source = profile.source
    if "driver_bytes" in source:
        return str(source["driver_bytes"])
    return f"measured by `fitdqn profile` on {source.get('card', profile.name)} ({source.get('date', '?')})"
