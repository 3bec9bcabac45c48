"""What this device is and how much memory is free — probed, or described for a GPU you do not have."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass

import torch

from fitdqn.device.cards import find_card, known_names
from fitdqn.errors import UserError


@dataclass(frozen=True)
class DeviceInfo:
    """A device as the planner sees it. ``what_if`` marks a described (not probed) device."""

    name: str
    kind: str  # "cuda" | "cpu"
    index: int | None
    total_bytes: int | None
    free_bytes: int | None
    compute_capability: tuple[int, int] | None
    bf16: bool
    what_if: bool = False
    # PyTorch's cap on its allocator (``set_per_process_memory_fraction``: fraction x total), None if uncapped.
    # Under a cap the allocator charges a whole request before it grows a segment, so the trainer maps the update
    # graph's pool before capturing it (``device.graphs``); ``free_bytes`` is at most the cap less what the
    # allocator reserved.
    allocator_limit_bytes: int | None = None
    # what the reduction launcher reads (memory.kernel_scratch): None = unknown (no SM cap, an upper bound)
    sm_count: int | None = None
    max_threads_per_sm: int | None = None
    # how a what-if device's facts were found (the card table entry, or why none), "" for a probed device
    described_from: str = ""

    def to_json(self) -> dict:
        data = asdict(self)
        data["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return data

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind if self.index is None else f"{self.kind}:{self.index}")


def resolve_device(spec: str = "auto") -> torch.device:
    """'auto' -> the current CUDA device if there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
            torch.device("cpu")
        )
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"unknown device {spec!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {spec!r} asked for, but this machine has no CUDA GPU: use --device cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UserError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise UserError(f"device type {device.type!r} is not supported: use 'cpu' or 'cuda'")
    return device


ALLOCATOR_CONFIG = "expandable_segments:True"


def configure_allocator() -> None:
    """Expandable segments, unless the user set PYTORCH_CUDA_ALLOC_CONF: a captured update graph's private
    pool then holds ~92 KiB/sample instead of ~133 KiB/sample at batch 8192 (H200, torch 2.11), same speed.
    Read by PyTorch at the first CUDA allocation, so it must run before anything touches the GPU."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONFIG)


def probe(spec: str = "auto") -> DeviceInfo:
    """Probe the real device once: name, compute capability, bf16, total and free bytes."""
    configure_allocator()
    device = resolve_device(spec)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)  # host sync: driver query
        limit = allocator_limit(device, total)
        if limit is not None:
            free = min(free, max(limit - torch.cuda.memory_reserved(device), 0))
        return DeviceInfo(
            name=props.name, kind="cuda", index=device.index, total_bytes=int(total), free_bytes=int(free),
            compute_capability=(props.major, props.minor), bf16=torch.cuda.is_bf16_supported(including_emulation=False),
            allocator_limit_bytes=limit, sm_count=props.multi_processor_count,
            max_threads_per_sm=props.max_threads_per_multi_processor,
        )
    total, free = system_memory()
    return DeviceInfo(
        name=cpu_name(), kind="cpu", index=None, total_bytes=total, free_bytes=free,
        compute_capability=None, bf16=True,
    )


def allocator_limit(device: torch.device, total_bytes: int) -> int | None:
    """The bytes PyTorch lets its allocator hold on ``device`` (``allowed_memory_maximum``: the per-process
    memory fraction x total), or None when no fraction is set (or this PyTorch cannot say)."""
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is None:
        return None
    value = float(fraction(device))
    return int(value * total_bytes) if value < 1.0 else None


def what_if(name: str, total_bytes: int | None, free_bytes: int | None) -> DeviceInfo:
    """A described GPU: free defaults to total (an idle card), total to free; both may stay unknown.

    A name the card table knows (``device.cards``: ``h100``, ``NVIDIA A100-SXM4-40GB``, ...) gives the card's
    compute capability, SM count and, when no size is given, its total memory; ``described_from`` says which
    card was used, or that none was (then the plan takes the larger cuBLAS workspace rule and no SM cap)."""
    card = find_card(name)
    given_total = total_bytes is not None
    if total_bytes is None and card is not None:
        total_bytes = card.total_bytes
    if total_bytes is None and free_bytes is not None:
        total_bytes = free_bytes
    if free_bytes is None:
        free_bytes = total_bytes
    if total_bytes is not None and free_bytes is not None and free_bytes > total_bytes:
        whose = f", the card table's {card.name}" if card is not None else ""
        raise UserError(f"--free-memory ({free_bytes} bytes) exceeds the total memory ({total_bytes} bytes{whose}): "
                        "lower --free-memory or give --total-memory")
    if card is None:
        described = (f"warning: '{name}' is not in fitdqn's card table: compute capability and SM count unknown, so "
                     "the larger cuBLAS workspace rule (sm_90's) and no SM cap on reduction scratch (upper bounds)"
                     + ("" if given_total else "; total memory unknown: give --total-memory SIZE")
                     + f"; known cards: {known_names()}")
        return DeviceInfo(name=name, kind="cuda", index=0, total_bytes=total_bytes, free_bytes=free_bytes,
                          compute_capability=None, bf16=True, what_if=True, described_from=described)
    return DeviceInfo(
        name=name, kind="cuda", index=0, total_bytes=total_bytes, free_bytes=free_bytes,
        compute_capability=card.compute_capability, bf16=card.compute_capability >= (8, 0), what_if=True,
        sm_count=card.sm_count, max_threads_per_sm=card.max_threads_per_sm,
        described_from=f"what-if '{name}': {card.name}, sm_{card.compute_capability[0]}{card.compute_capability[1]}"
                       f", {card.sm_count} SMs, {card.total_bytes / 2**30:.1f} GiB total ({card.source})",
    )


def what_if_device(name: str | None, total_bytes: int | None, free_bytes: int | None) -> DeviceInfo:
    """``what_if`` for the command line (``--gpu``, ``--total-memory``, ``--free-memory``): a card the table does
    not know is planned on the safe side with a warning in the plan's notes (``described_from``)."""
    return what_if(name or "what-if GPU", total_bytes, free_bytes)


def system_memory() -> tuple[int, int]:
    """(total, available) bytes of system RAM, from /proc/meminfo where it exists."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        kib = lambda key: int(fields[key].strip().split()[0]) * 1024
        return kib("MemTotal"), kib("MemAvailable")
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU: " + (platform.processor() or platform.machine())
