"""Live device bytes of a running program, counted the way PyTorch's CUDA caching allocator counts them.

``LiveBytes`` is a ``TorchDispatchMode``: every ATen op's output tensors pass through it, and it records each
*storage* it has not seen yet (views and in-place results share their base's storage, so they add nothing).
A storage is charged when it first appears and released when it dies: ``weakref.finalize`` on the Python
``UntypedStorage`` fires exactly when the C++ ``StorageImpl`` is freed (PyTorch keeps a storage's Python
object alive for as long as the storage itself), so storages that autograd keeps alive for backward, with no
Python tensor left pointing at them, stay counted until backward releases them.

Bytes are what ``torch.cuda.memory_allocated`` would report: each storage's ``nbytes`` rounded up to a whole
number of 512-byte blocks (``round_block``). Not modelled: the caching allocator hands out a cached or fresh
large-pool block whole when the unused tail would be 1 MiB or less, so each live block over 1 MiB may be up
to 1 MiB bigger than its request (on an H200, torch 2.11: 11.5 MiB -> 12 MiB, 21 MiB -> 22 MiB allocated,
10.5 MiB -> 10.5 MiB); ``large_blocks`` counts those blocks, so 1 MiB each bounds the slack.
``PYTORCH_CUDA_ALLOC_CONF`` (``roundup_power2_divisions``, ``expandable_segments``) changes the rounding.

Each storage is charged to an owner group, named by ``owner_of()`` at the moment it appears; at the peak
the tracker copies the live bytes per group, so the parts sum exactly to the peak.

``scratch(func, args, kwargs)``, when given, names the bytes a kernel takes for the duration of one op
(``kernel_scratch``): they count toward the peak at that op (as a record whose op starts with 'scratch of')
but are never live after it.

``start_events()`` / ``stop_events()`` bracket an ordered log (``events``) of what the caching allocator
would be asked for in between: ``AllocEvent('alloc', serial, nbytes)`` when a storage appears (or a kernel's
scratch is taken), ``AllocEvent('free', serial, nbytes)`` when it dies (scratch: right after its op). Each
allocation gets a new serial (storage addresses are reused), a storage resized in place is an 'alloc' of
the new size then a 'free' of the old one (``resize_`` copies into a new block), and frees of storages made
before the log started are left out. ``allocator_model`` replays the log through a model of the caching
allocator to get the bytes a CUDA graph's private pool reserves.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BLOCK_BYTES = 512  # kMinBlockSize of c10/cuda/CUDACachingAllocator.cpp: every request is a multiple of it
LARGE_BLOCK_BYTES = 1 << 20  # kSmallSize: requests above it come from the large pool


def round_block(nbytes: int) -> int:
    """Bytes the CUDA caching allocator charges for a request of ``nbytes`` (0 stays 0: no block)."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


@dataclass(frozen=True)
class LiveStorage:
    """One live storage: its charged bytes, owner group, the op that made it and the first tensor's view."""

    nbytes: int
    group: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    phase: str  # 'forward' or 'backward' (made while the autograd engine ran a node)


class AllocEvent(NamedTuple):
    """One allocator request of a traced step: ``op`` 'alloc' or 'free', ``key`` a serial unique to the
    allocation (the same on its 'free'), ``nbytes`` the bytes charged (``round_block``)."""

    op: Literal["alloc", "free"]
    key: int
    nbytes: int


class LiveBytes(TorchDispatchMode):
    """Counts live storages on one device type and remembers the peak (see the module docstring).

    ``owner_of()`` names the group to charge a new storage to; ``in_backward()`` says whether the autograd
    engine is running a node (only for the record's ``phase``). ``reset_peak()`` starts a new peak from the
    bytes live now, like ``torch.cuda.reset_peak_memory_stats``.
    """

    def __init__(self, device_type: str, owner_of: Callable[[], str], in_backward: Callable[[], bool],
                 scratch: Callable[..., int] | None = None):
        super().__init__()
        self.scratch = scratch
        self.device_type = device_type
        self.owner_of = owner_of
        self.in_backward = in_backward
        self.live: dict[int, LiveStorage] = {}  # StorageImpl address -> record
        self.live_bytes = 0
        self.by_group: dict[str, int] = {}
        self.peak_bytes = 0
        self.peak_by_group: dict[str, int] = {}
        self.peak_op = ""
        self.peak_storages: list[LiveStorage] = []
        self.scratch_at_peak = 0  # bytes of kernel scratch in the peak (0: the peak is between ops)
        self.allocations = 0
        self.events: list[AllocEvent] = []  # filled between start_events() and stop_events()
        self._recording = False
        self._serials = itertools.count()
        self._logged: dict[int, AllocEvent] = {}  # storage key -> its logged 'alloc' (live, made while recording)
        self._finalizers: dict[int, weakref.finalize] = {}
        self._lock = threading.RLock()  # storages die on the autograd engine's threads too
        # told of every change of the live bytes, in order, with the storages' raw sizes (``trace.Ledger``)
        self.ledger = None

    # -- counting -------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device_type:
                self._see(tensor, str(func))
        if self.scratch is not None:
            nbytes = self.scratch(func, args, kwargs)
            if self.ledger is not None:
                with self._lock:
                    self.ledger.transient(func, args, kwargs, nbytes, self.owner_of)
            self._transient(func, nbytes)
        return out

    def _transient(self, func, nbytes: int) -> None:
        """Kernel scratch: live with the op's inputs and outputs, gone when the op returns."""
        nbytes = round_block(nbytes)
        with self._lock:
            if nbytes and self._recording:
                serial = next(self._serials)
                self.events += [AllocEvent("alloc", serial, nbytes), AllocEvent("free", serial, nbytes)]
            if nbytes == 0 or self.live_bytes + nbytes <= self.peak_bytes:
                return
            group = self.owner_of()
            record = LiveStorage(nbytes, group, f"scratch of {func}", (nbytes,), torch.uint8,
                                 "backward" if self.in_backward() else "forward")
            self.peak_bytes = self.live_bytes + nbytes
            self.peak_by_group = dict(self.by_group)
            self.peak_by_group[group] = self.peak_by_group.get(group, 0) + nbytes
            self.peak_op = record.op
            self.peak_storages = [*self.live.values(), record]
            self.scratch_at_peak = nbytes

    def _see(self, tensor: torch.Tensor, op: str) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        nbytes = round_block(storage.nbytes())
        with self._lock:
            known = self.live.get(key)
            if known is not None:
                if known.nbytes == nbytes:
                    return
                # resized in place (resize_, out= ops): charge the difference to the same owner
                self._release(key)
                self._charge(key, LiveStorage(nbytes, known.group, op, known.shape, known.dtype, known.phase))
                if self.ledger is not None:
                    self.ledger.charged(key, storage.nbytes(), known.group, op, known)
                self._log_alloc(key, nbytes)
                return
            phase = "backward" if self.in_backward() else "forward"
            record = LiveStorage(nbytes, self.owner_of(), op, tuple(tensor.shape), tensor.dtype, phase)
            self._charge(key, record)
            if self.ledger is not None:
                self.ledger.charged(key, storage.nbytes(), record.group, op, None)
            self.allocations += 1
            self._log_alloc(key, nbytes)
            self._finalizers[key] = weakref.finalize(storage, self._free, key)

    def _log_alloc(self, key: int, nbytes: int) -> None:
        """Log a new block for ``key`` (while recording); a block it had before is freed after it."""
        previous = self._logged.pop(key, None)
        if self._recording and nbytes:
            event = AllocEvent("alloc", next(self._serials), nbytes)
            self.events.append(event)
            self._logged[key] = event
        if previous is not None and self._recording:
            self.events.append(AllocEvent("free", previous.key, previous.nbytes))

    def _charge(self, key: int, record: LiveStorage) -> None:
        self.live[key] = record
        self.live_bytes += record.nbytes
        self.by_group[record.group] = self.by_group.get(record.group, 0) + record.nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_by_group = dict(self.by_group)
            self.peak_op = record.op
            self.peak_storages = list(self.live.values())
            self.scratch_at_peak = 0

    def _release(self, key: int) -> None:
        record = self.live.pop(key)
        self.live_bytes -= record.nbytes
        self.by_group[record.group] -= record.nbytes

    def _free(self, key: int) -> None:
        with self._lock:
            if key in self.live:
                if self.ledger is not None:
                    self.ledger.released(key, self.live[key])
                self._release(key)
            self._finalizers.pop(key, None)
            logged = self._logged.pop(key, None)
            if logged is not None and self._recording:
                self.events.append(AllocEvent("free", logged.key, logged.nbytes))

    # -- the event log -----------------------------------------------------------------------------------
    def start_events(self) -> None:
        """Start a new event log (``events``): storages alive now are not in it, nor are their frees."""
        with self._lock:
            self.events = []
            self._logged.clear()
            self._recording = True

    def stop_events(self) -> list[AllocEvent]:
        """Stop logging and return the log (storages still alive have an 'alloc' and no 'free')."""
        with self._lock:
            self._recording = False
            self._logged.clear()
            return self.events

    # -- reading ---------------------------------------------------------------------------------------
    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes
            self.peak_by_group = dict(self.by_group)
            self.peak_op = "(no allocation since the reset)"
            self.peak_storages = list(self.live.values())
            self.scratch_at_peak = 0

    def snapshot_by_group(self) -> dict[str, int]:
        with self._lock:
            return {group: count for group, count in self.by_group.items() if count}

    def recharge(self, tensor: torch.Tensor, group: str) -> None:
        """Move a live storage (e.g. a parameter's) to ``group``; unknown storages are ignored."""
        with self._lock:
            key = tensor.untyped_storage()._cdata
            record = self.live.get(key)
            if record is None or record.group == group:
                return
            self._release(key)
            self._charge(key, LiveStorage(record.nbytes, group, record.op, record.shape, record.dtype,
                                          record.phase))

    def detach_finalizers(self) -> None:
        """Stop listening for deaths (after the trace: the fake storages may outlive the tracker)."""
        with self._lock:
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()


def large_blocks(storages: list[LiveStorage]) -> int:
    """How many of these blocks come from the large pool (each may carry up to 1 MiB of unsplit tail)."""
    return sum(1 for record in storages if record.nbytes > LARGE_BLOCK_BYTES)
