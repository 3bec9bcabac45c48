"""Scratch memory that CUDA kernels allocate inside one op, which a fake-tensor trace cannot see.

A fake tensor runs an op's meta function (output shapes) and never its kernel, so buffers the kernel takes
from the caching allocator for the duration of the launch are missing from a trace. They are transient but
they count toward ``torch.cuda.max_memory_allocated`` and so toward the step's peak.

Modelled: the global-memory staging buffer of ATen's generic CUDA reduction (``ATen/native/cuda/Reduce.cuh``,
``setReduceConfig`` and ``ReduceConfig::global_memory_size``). Reducing over outer dims with inner dims kept,
e.g. the bias gradient of every ``nn.Linear``, ``grad.sum(0)`` of a ``[B, N]`` gradient, splits the batch
over up to ``ctas_per_output`` thread blocks, each writing ``block.x * output_vec_size`` partial sums per
output: with N a multiple of 4 that is 2 x the input's bytes (fp32 accumulation). Checked on an H200 with
torch 2.11: ``[4096, 256].sum(0)`` took 8 MiB of scratch, as the model says. The number of blocks is capped
by the GPU's SM count; with ``sm_count=None`` the cap is ignored (an upper bound).

Not modelled (measure them with ``trace.measure_step_memory``): reductions over the innermost dim (their
staging is one value per block, small); Welford reductions (var/std); workspaces of cuBLAS/cuBLASLt beyond the
persistent one; LayerNorm backward's partial sums; fused attention backward (flash keeps an fp32 dq
accumulator); cub-based ops (sort, cumsum, nonzero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_REDUCTIONS = {
    torch.ops.aten.sum.dim_IntList,
    torch.ops.aten.mean.dim,
    torch.ops.aten.nansum.default,
    torch.ops.aten.amax.default,
    torch.ops.aten.amin.default,
    torch.ops.aten.linalg_vector_norm.default,
}
MODELLED_OPS = frozenset(_REDUCTIONS)  # the ops whose scratch is modelled (the rest take none here)
_MAX_THREADS = 512  # ReduceConfig's thread budget per block for 4-byte types, divided by output_vec_size
_WARP = 32
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256


@dataclass(frozen=True)
class CudaShape:
    """What the reduction launcher reads from the device: SMs and threads per SM (None: no SM cap)."""

    sm_count: int | None = None
    max_threads_per_sm: int = 2048

    @classmethod
    def of_current_device(cls) -> CudaShape:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return cls(props.multi_processor_count, props.max_threads_per_multi_processor)


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def reduction_staging_bytes(outer: int, inner: int, acc_bytes: int, device: CudaShape) -> int:
    """Staging bytes of reducing a contiguous ``[outer, inner]`` over ``outer`` (``setReduceConfig`` port).

    ``outer``: product of the reduced (leading) dims; ``inner``: product of the kept (trailing) dims.
    """
    if outer <= 1 or inner < 1:
        return 0
    vec = 4 if inner % 4 == 0 else 2 if inner % 2 == 0 else 1
    max_threads = _MAX_THREADS // vec
    dim0, dim1 = inner // vec, outer
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, _WARP)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    step_output = block_width  # outputs are split across the lanes of a warp
    values_per_thread = outer
    if values_per_thread < min(block_height * _MIN_VALUES_PER_THREAD, _MAX_VALUES_PER_THREAD):
        return 0  # each warp reduces its own outputs: no global reduction
    values_per_thread = math.ceil(outer / block_height)  # the reduced dim is split across warps
    if values_per_thread < _MAX_VALUES_PER_THREAD:
        return 0
    grid = math.ceil(dim0 / step_output)
    ctas_by_grid = math.inf
    if device.sm_count is not None:
        target_grid = device.sm_count * (device.max_threads_per_sm // (block_width * block_height))
        if grid > target_grid:
            return 0
        ctas_by_grid = math.ceil(target_grid / grid)
    ctas = max(min(ctas_by_grid, math.ceil(values_per_thread / _MIN_VALUES_PER_THREAD)),
               math.ceil(values_per_thread / _MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0
    return acc_bytes * inner * int(ctas) * block_width * vec


def cuda_kernel_scratch(func, args, kwargs, device: CudaShape) -> int:
    """Transient bytes ``func(*args, **kwargs)`` takes inside its CUDA kernel (0 when not modelled)."""
    if func not in _REDUCTIONS or not args or not isinstance(args[0], torch.Tensor):
        return 0
    tensor = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if func is torch.ops.aten.linalg_vector_norm.default:
        dims = args[2] if len(args) > 2 else kwargs.get("dim")
    if tensor.dim() == 0 or not tensor.is_contiguous():
        return 0
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return 0  # a full reduction reduces the innermost dim: small staging
    dims = [dims] if isinstance(dims, int) else list(dims)
    reduced = sorted({d % tensor.dim() for d in dims})
    if reduced[-1] == tensor.dim() - 1:
        return 0  # innermost dim reduced: one partial per block
    outer = math.prod(tensor.shape[d] for d in reduced)
    inner = tensor.numel() // max(outer, 1)
    acc_bytes = 8 if tensor.dtype in (torch.float64, torch.int64, torch.complex64) else 4
    return reduction_staging_bytes(outer, inner, acc_bytes, device)
